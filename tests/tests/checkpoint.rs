use std::path::{Path, PathBuf};

use ferry::checkpoint::{self, Checkpoint, Mismatch};
use ferry::nn::{Init, Linear, Module, ReLU, Sequential};
use ferry::{CheckpointError, TransferPath};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{device_test, values};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn mlp(dtype: DType, device: Device) -> Result<Sequential> {
    Ok(Sequential::new()
        .push(Linear::with_init(
            5,
            7,
            Init::KaimingUniform,
            dtype,
            device,
        )?)
        .push(ReLU)
        .push(Linear::with_init(7, 3, Init::XavierUniform, dtype, device)?))
}

fn snapshot(model: &dyn Module) -> Vec<Vec<f64>> {
    model.parameters().iter().map(values).collect()
}

/// A model saved on `device` and loaded into a fresh one there has the same values; the save
/// goes through one batched move.
fn model_round_trip(device: Device) -> Result<()> {
    let dir = scratch(&format!("round-{device}"));
    let path = dir.join("m.safetensors");
    let model = mlp(DType::F32, device)?;
    let report = checkpoint::save(&path, &model.state_dict()).unwrap();
    if device.is_cuda() {
        assert_eq!(report.path, TransferPath::Batched { tensors: 4 });
    }
    let mut other = mlp(DType::F32, device)?;
    let before_ids: Vec<Tensor> = other.parameters();
    other
        .load_state_dict(&checkpoint::load(&path).unwrap())
        .unwrap();
    assert_eq!(snapshot(&other), snapshot(&model));
    for (p, q) in other.parameters().iter().zip(&before_ids) {
        assert!(
            p.shares_storage(q),
            "loading replaced a parameter instead of writing in place"
        );
        assert!(p.is_leaf() && p.requires_grad() && p.device() == device);
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
device_test!(model_round_trip, model_round_trip);

#[test]
fn every_dtype_round_trips_bit_for_bit_with_metadata() {
    let dir = scratch("dtypes");
    let path = dir.join("all.safetensors");
    let base = Tensor::from_slice(&[0.0f64, -1.5, 3.25, 1e-3, 7.0, -0.0], &[2, 3]).unwrap();
    let mut ck = Checkpoint::new();
    let tensors: Vec<(String, Tensor)> = DType::ALL
        .iter()
        .map(|&d| (d.name().to_string(), base.to_dtype(d).unwrap()))
        .chain([
            ("transposed".into(), base.t().unwrap()),
            ("scalar".into(), Tensor::scalar(5i64)),
        ])
        .collect();
    ck.insert_section("t", tensors.clone());
    ck.set_metadata("epoch", "12");
    ck.save(&path).unwrap();
    let back = Checkpoint::load(&path).unwrap();
    assert_eq!(back.metadata("epoch"), Some("12"));
    let section = back.section("t");
    assert_eq!(section.len(), tensors.len());
    for (name, t) in &tensors {
        let (_, got) = section.iter().find(|(k, _)| k == name).unwrap();
        assert_eq!((got.dtype(), got.shape()), (t.dtype(), t.shape()), "{name}");
        assert_eq!(values(got), values(t), "{name}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Saves a model, lets `damage` rewrite the file or the state, and checks the load fails with
/// an error mentioning every string of `expect` and leaves the target model unchanged.
fn refused(name: &str, damage: impl FnOnce(&Path), target: &mut dyn Module, expect: &[&str]) {
    let dir = scratch(name);
    let path = dir.join("m.safetensors");
    checkpoint::save(&path, &mlp(DType::F32, Device::Cpu).unwrap().state_dict()).unwrap();
    damage(&path);
    let before = snapshot(target);
    let err = checkpoint::load(&path).and_then(|state| target.load_state_dict(&state));
    let err = err.expect_err("a bad checkpoint loaded").to_string();
    for e in expect {
        assert!(err.contains(e), "{e:?} not in: {err}");
    }
    assert_eq!(snapshot(target), before, "a failed load changed the model");
    std::fs::remove_dir_all(&dir).ok();
}

fn entry<'a>(state: &'a mut [(String, Tensor)], key: &str) -> &'a mut Tensor {
    &mut state.iter_mut().find(|(k, _)| k == key).unwrap().1
}

fn rewrite(path: &Path, f: impl FnOnce(&mut Vec<(String, Tensor)>)) {
    let mut state = checkpoint::load(path).unwrap();
    f(&mut state);
    checkpoint::save(path, &state).unwrap();
}

#[test]
fn a_truncated_file_names_the_first_missing_tensor() {
    let mut model = mlp(DType::F32, Device::Cpu).unwrap();
    refused(
        "truncated",
        |p| {
            let bytes = std::fs::read(p).unwrap();
            std::fs::write(p, &bytes[..bytes.len() - 10]).unwrap();
        },
        &mut model,
        &["truncated", "tensor \"", "interrupted"],
    );
    refused(
        "header-only",
        |p| std::fs::write(p, [1u8, 2, 3]).unwrap(),
        &mut model,
        &["3 bytes", "truncated"],
    );
}

#[test]
fn wrong_dtype_shape_missing_and_extra_keys_are_named() {
    let mut model = mlp(DType::F32, Device::Cpu).unwrap();
    refused(
        "dtype",
        |p| {
            rewrite(p, |s| {
                let t = entry(s, "0.weight");
                *t = t.to_dtype(DType::F64).unwrap();
            });
        },
        &mut model,
        &["key \"0.weight\": dtype f64 in the checkpoint, f32 expected"],
    );
    refused(
        "shape",
        |p| {
            rewrite(p, |s| {
                *entry(s, "2.bias") = Tensor::zeros(&[4], DType::F32, Device::Cpu).unwrap()
            })
        },
        &mut model,
        &["key \"2.bias\": shape [4] in the checkpoint, [3] expected"],
    );
    refused(
        "missing-extra",
        |p| {
            rewrite(p, |s| {
                s.retain(|(k, _)| k != "0.bias");
                s.push((
                    "3.weight".into(),
                    Tensor::zeros(&[2], DType::F32, Device::Cpu).unwrap(),
                ));
            })
        },
        &mut model,
        &["missing key \"0.bias\"", "unexpected key \"3.weight\""],
    );
}

#[test]
fn mismatches_are_structured() {
    let mut model = mlp(DType::F32, Device::Cpu).unwrap();
    let mut state = model.state_dict();
    state.retain(|(k, _)| k != "2.weight");
    let Err(CheckpointError::Mismatch { what, problems }) = model.load_state_dict(&state) else {
        panic!("a state without 2.weight loaded");
    };
    assert_eq!(what, "model");
    assert_eq!(
        problems,
        [Mismatch::Missing {
            key: "2.weight".into(),
            shape: vec![3, 7],
            dtype: DType::F32
        }]
    );
}

#[test]
fn unsupported_dtypes_and_garbage_are_errors() {
    let dir = scratch("garbage");
    // A valid safetensors file holding an I32 tensor, which ferry has no dtype for.
    let header = br#"{"n":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0; 8]);
    let i32_file = dir.join("i32.safetensors");
    std::fs::write(&i32_file, bytes).unwrap();
    let err = checkpoint::load(&i32_file).unwrap_err();
    assert!(
        matches!(&err, CheckpointError::UnsupportedDType { key, .. } if key == "n"),
        "{err}"
    );
    let junk = dir.join("junk.safetensors");
    std::fs::write(
        &junk,
        [
            8u8, 0, 0, 0, 0, 0, 0, 0, b'n', b'o', b't', b' ', b'j', b's', b'o', b'n',
        ],
    )
    .unwrap();
    assert!(matches!(
        checkpoint::load(&junk),
        Err(CheckpointError::Format { .. })
    ));
    let missing = checkpoint::load(dir.join("nope.safetensors")).unwrap_err();
    assert!(matches!(missing, CheckpointError::Io { .. }) && missing.to_string().contains("nope"));
    std::fs::remove_dir_all(&dir).ok();
}
