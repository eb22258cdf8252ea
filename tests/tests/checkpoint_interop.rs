//! ferry checkpoints open in Python's safetensors, and files written from Python load into
//! ferry models, checked by running both models on the same input (tests/torch/checkpoint_interop.py);
//! files written from Python carry no checksums and still load, and Python finds `zlib.crc32` of
//! every tensor in the checksum record of ferry's files.

use std::path::{Path, PathBuf};
use std::process::Command;

use ferry::checkpoint;
use ferry::nn::{Linear, Module, ReLU, Sequential};
use ferry_tensor::{DType, Device, Tensor};
use ferry_tests::assert_close;

fn script() -> std::path::PathBuf {
    ferry_tests::repo_root().join("tests/torch/checkpoint_interop.py")
}

fn mlp() -> Sequential {
    Sequential::new()
        .push(Linear::new(64, 128, Device::Cpu).unwrap())
        .push(ReLU)
        .push(Linear::new(128, 10, Device::Cpu).unwrap())
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-interop-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `numpy` and `safetensors` for Python in a cache directory of their own (installed once),
/// or `None` with the reason when they cannot be had.
fn python_packages() -> Result<PathBuf, String> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("ferry/python-safetensors");
    let importable = |dir: &Path| {
        Command::new("python3")
            .args(["-c", "import numpy, safetensors.numpy"])
            .env("PYTHONPATH", dir)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if importable(&cache) {
        return Ok(cache);
    }
    let out = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .arg("--target")
        .arg(&cache)
        .args(["numpy", "safetensors"])
        .output()
        .map_err(|e| format!("python3 not runnable: {e}"))?;
    if importable(&cache) {
        Ok(cache)
    } else {
        Err(format!(
            "pip install numpy safetensors failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Writes ferry's files, runs the script with `extra` arguments, then loads Python's files.
fn round_trip(dir: &Path, python_path: Option<&Path>, extra: &[&str]) {
    ferry_tests::fresh_seed();
    let model = mlp();
    checkpoint::save(dir.join("ferry_model.safetensors"), &model.state_dict()).unwrap();
    let x = Tensor::randn(&[7, 64], DType::F32, Device::Cpu).unwrap();
    let logits = model.forward(&x).unwrap().detach();
    checkpoint::save(
        dir.join("ferry_io.safetensors"),
        &[("x".into(), x), ("logits".into(), logits)],
    )
    .unwrap();

    let mut cmd = Command::new("python3");
    cmd.arg(script()).arg(dir).args(extra);
    if let Some(p) = python_path {
        cmd.env("PYTHONPATH", p);
    }
    let out = cmd.output().expect("running python3");
    assert!(
        out.status.success(),
        "checkpoint_interop.py failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let mut loaded = mlp();
    loaded
        .load_state_dict(&checkpoint::load(dir.join("python_model.safetensors")).unwrap())
        .unwrap();
    let io = checkpoint::load(dir.join("python_io.safetensors")).unwrap();
    let get = |k: &str| io.iter().find(|(n, _)| n == k).unwrap().1.clone();
    let ours = loaded.forward(&get("x")).unwrap();
    assert_close(
        &ours.to_vec_f64().unwrap(),
        &get("logits").to_vec_f64().unwrap(),
        1e-5,
    );
}

#[test]
fn ferry_and_numpy_safetensors_read_each_other() {
    let packages = match python_packages() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("SKIPPED ferry_and_numpy_safetensors_read_each_other: {why}");
            return;
        }
    };
    let dir = scratch("numpy");
    round_trip(&dir, Some(&packages), &[]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs PyTorch and safetensors in python3 (the GPU machine)"]
fn ferry_and_pytorch_safetensors_read_each_other() {
    let dir = scratch("torch");
    let device = std::env::var("FERRY_TORCH_DEVICE").unwrap_or_else(|_| "cuda".into());
    round_trip(&dir, None, &["--torch", "--device", &device]);
    std::fs::remove_dir_all(&dir).ok();
}

/// Python reads ferry's checksum record from the metadata and finds `zlib.crc32` of every
/// tensor's bytes in it: the record means what docs/reliability.md says it means.
const CRC_CHECK: &str = r#"
import json, sys, zlib
from safetensors import safe_open
from safetensors.numpy import load_file
path = sys.argv[1]
with safe_open(path, "np") as f:
    record = json.loads(f.metadata()["ferry.crc32"])
state = load_file(path)
assert set(state) == set(record["tensors"]), (sorted(state), sorted(record["tensors"]))
for key, value in state.items():
    crc = format(zlib.crc32(value.tobytes()) & 0xFFFFFFFF, "08x")
    assert crc == record["tensors"][key], (key, crc, record["tensors"][key])
print(f"{len(state)} checksums match zlib.crc32")
"#;

#[test]
fn python_finds_zlib_crc32_of_each_tensor_in_ferrys_record() {
    let packages = match python_packages() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("SKIPPED python_finds_zlib_crc32_of_each_tensor_in_ferrys_record: {why}");
            return;
        }
    };
    let dir = scratch("crc");
    let path = dir.join("dtypes.safetensors");
    ferry_tests::fresh_seed();
    let base = Tensor::randn(&[3, 5], DType::F64, Device::Cpu).unwrap();
    // numpy has no bfloat16, so the record is checked on every other dtype.
    let state: Vec<(String, Tensor)> = [DType::F32, DType::F64, DType::F16, DType::I64, DType::U8]
        .into_iter()
        .map(|d| (d.name().to_string(), base.to_dtype(d).unwrap()))
        .collect();
    checkpoint::save(&path, &state).unwrap();
    let out = Command::new("python3")
        .args(["-c", CRC_CHECK])
        .arg(&path)
        .env("PYTHONPATH", &packages)
        .output()
        .expect("running python3");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("5 checksums match"));
    std::fs::remove_dir_all(&dir).ok();
}
