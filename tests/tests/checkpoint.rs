use std::path::{Path, PathBuf};

use ferry::checkpoint::{self, Checkpoint, Mismatch};
use ferry::nn::{Init, Linear, Module, ReLU, Sequential};
use ferry::{CheckpointError, DeviceMove, TransferPath};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{device_test, values};

pub(crate) fn scratch(name: &str) -> PathBuf {
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
/// streams each device tensor in one piece (they are far below the staging bound), and a load
/// streamed onto the device fills a model the same way.
fn model_round_trip(device: Device) -> Result<()> {
    let dir = scratch(&format!("round-{device}"));
    let path = dir.join("m.safetensors");
    let model = mlp(DType::F32, device)?;
    let report = checkpoint::save(&path, &model.state_dict()).unwrap();
    if device.is_cuda() {
        assert_eq!(report.path, TransferPath::Chunked { chunks: 4 });
        assert_eq!(report.bytes_moved, (5 * 7 + 7 + 7 * 3 + 3) * 4);
    } else {
        assert_eq!(report.bytes_moved, 0);
    }
    let (streamed, load_report) =
        checkpoint::load_to(&path, device, checkpoint::LoadOptions::default()).unwrap();
    assert!(streamed.iter().all(|(_, t)| t.device() == device));
    assert_eq!(load_report.tensors, 4);
    let mut third = mlp(DType::F32, device)?;
    third.load_state_dict(&streamed).unwrap();
    assert_eq!(snapshot(&third), snapshot(&model));
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

/// The CRC32 of `bytes` (IEEE, reflected, as zlib computes it), written out here so the test
/// checks ferry's checksums against an implementation of its own.
fn zlib_crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

/// The JSON header of a safetensors file and where its data section starts.
fn header(path: &Path) -> (serde_json::Value, usize) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), 8 + n)
}

/// The byte range of tensor `key` in the file.
fn tensor_bytes(path: &Path, key: &str) -> std::ops::Range<usize> {
    let (h, data) = header(path);
    let offsets = &h[key]["data_offsets"];
    let at = |i: usize| data + offsets[i].as_u64().unwrap() as usize;
    at(0)..at(1)
}

fn damage(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_saved_file_carries_the_crc32_of_every_tensor() {
    let dir = scratch("crc");
    let path = dir.join("m.safetensors");
    let state = mlp(DType::F32, Device::Cpu).unwrap().state_dict();
    checkpoint::save(&path, &state).unwrap();
    let (h, _) = header(&path);
    let record: serde_json::Value = serde_json::from_str(
        h["__metadata__"][checkpoint::CHECKSUM_KEY]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let sums = record["tensors"].as_object().unwrap();
    assert_eq!(sums.len(), state.len());
    let file = std::fs::read(&path).unwrap();
    for (key, _) in &state {
        let expected = format!("{:08x}", zlib_crc32(&file[tensor_bytes(&path, key)]));
        assert_eq!(sums[key], expected.as_str(), "{key}");
    }
    assert_eq!(record["header"].as_str().unwrap().len(), 8);
    // The record is ferry's own: a loaded checkpoint does not show it, and saves again.
    let back = Checkpoint::load(&path).unwrap();
    assert_eq!(back.metadata(checkpoint::CHECKSUM_KEY), None);
    back.save(&path).unwrap();
    assert_eq!(checkpoint::load(&path).unwrap().len(), state.len());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_flipped_bit_names_the_file_and_the_tensor_and_loads_nothing() {
    let mut model = mlp(DType::F32, Device::Cpu).unwrap();
    for key in ["0.weight", "2.bias"] {
        refused(
            &format!("flip-{key}"),
            |p| {
                let range = tensor_bytes(p, key);
                damage(p, |b| b[range.start + range.len() / 2] ^= 0x04);
            },
            &mut model,
            &[
                "m.safetensors",
                &format!("tensor {key:?} is corrupted"),
                "CRC32",
            ],
        );
    }
    let dir = scratch("flip-structured");
    let path = dir.join("m.safetensors");
    checkpoint::save(&path, &model.state_dict()).unwrap();
    let range = tensor_bytes(&path, "2.weight");
    damage(&path, |b| b[range.end - 1] ^= 0x80);
    match checkpoint::load(&path) {
        Err(CheckpointError::ChecksumMismatch {
            path: p,
            key,
            expected,
            found,
        }) => {
            assert_eq!((p, key.as_str()), (path.clone(), "2.weight"));
            assert_ne!(expected, found);
        }
        other => panic!("expected a checksum mismatch, got {other:?}"),
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A tensor of several read chunks (4 MiB each, read and hashed by separate threads, their
/// checksums combined): it loads bit for bit, and a flip in any chunk, the first, a middle one
/// or the last, partial one, is found and named.
#[test]
fn a_tensor_read_in_chunks_side_by_side_loads_whole_and_any_damage_is_found() {
    let dir = scratch("chunks");
    let path = dir.join("big.safetensors");
    // 10 MiB + 12 bytes: two whole chunks and a partial third, after a small tensor so the big
    // one starts off a chunk boundary.
    let big = Tensor::arange(0.0, ((10 << 20) / 4 + 3) as f64, DType::F32, Device::Cpu).unwrap();
    let small = Tensor::full(&[5], 2.0, DType::F32, Device::Cpu).unwrap();
    let state = vec![("a".to_string(), small), ("big".to_string(), big.clone())];
    checkpoint::save(&path, &state).unwrap();
    let back = checkpoint::load(&path).unwrap();
    assert_eq!(
        back[1].1.to_vec::<f32>().unwrap(),
        big.to_vec::<f32>().unwrap()
    );
    let clean = std::fs::read(&path).unwrap();
    let range = tensor_bytes(&path, "big");
    for at in [range.start, range.start + (6 << 20), range.end - 1] {
        let mut bytes = clean.clone();
        bytes[at] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        match checkpoint::load(&path) {
            Err(CheckpointError::ChecksumMismatch { key, .. }) => assert_eq!(key, "big"),
            other => panic!("a flip at {at} was not found: {other:?}"),
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_changed_header_is_caught_too() {
    let dir = scratch("header");
    let path = dir.join("m.safetensors");
    let mut ck = Checkpoint::new();
    ck.insert_section(
        "t",
        vec![(
            "x".into(),
            Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap(),
        )],
    );
    ck.set_metadata("epoch", "12");
    ck.save(&path).unwrap();
    // Same length, still valid JSON and a valid safetensors header: only the checksum knows.
    for (from, to) in [(&b"\"12\""[..], &b"\"13\""[..]), (b"[2,2]", b"[1,4]")] {
        let original = std::fs::read(&path).unwrap();
        damage(&path, |b| {
            let at = b.windows(from.len()).position(|w| w == from).unwrap();
            b[at..at + to.len()].copy_from_slice(to);
        });
        let err = checkpoint::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("m.safetensors") && err.contains("its header") && err.contains("CRC32"),
            "{err}"
        );
        std::fs::write(&path, original).unwrap();
    }
    assert!(checkpoint::load(&path).is_ok());
    std::fs::remove_dir_all(&dir).ok();
}

/// `verify` reads a file without loading it: a sound one is counted, each kind of damage is
/// the error `load` gives, naming the tensor; a plain safetensors file is checked for structure.
#[test]
fn verify_checks_every_checksum_without_loading_and_names_the_damage() {
    let dir = scratch("verify");
    let path = dir.join("m.safetensors");
    let state = mlp(DType::F32, Device::Cpu).unwrap().state_dict();
    checkpoint::save(&path, &state).unwrap();
    let verified = checkpoint::verify(&path).unwrap();
    let bytes: usize = state.iter().map(|(_, t)| t.nbytes()).sum();
    assert_eq!(
        verified,
        checkpoint::Verified {
            tensors: state.len(),
            bytes,
            checksummed: true
        }
    );
    let original = std::fs::read(&path).unwrap();
    let range = tensor_bytes(&path, "2.weight");
    damage(&path, |b| b[range.start] ^= 0x01);
    match checkpoint::verify(&path) {
        Err(CheckpointError::ChecksumMismatch { key, .. }) => assert_eq!(key, "2.weight"),
        other => panic!("expected a checksum mismatch, got {other:?}"),
    }
    std::fs::write(&path, &original).unwrap();
    let cut = tensor_bytes(&path, "2.bias").start + 1;
    damage(&path, |b| b.truncate(cut));
    let err = checkpoint::verify(&path).unwrap_err().to_string();
    assert!(err.contains("2.bias"), "{err}");
    // A file without ferry's record (another writer's safetensors file): structure only.
    let plain = dir.join("plain.safetensors");
    let mut json = br#"{"x":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}"#.to_vec();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&json);
    for v in [1.0f32, 2.0, 3.0] {
        file.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(&plain, file).unwrap();
    let verified = checkpoint::verify(&plain).unwrap();
    assert_eq!((verified.tensors, verified.checksummed), (1, false));
    std::fs::remove_dir_all(&dir).ok();
}

/// `read_metadata` reads what a file says of itself from its header alone, less ferry's
/// checksum record; a file cut inside its header is an error naming it, not a panic.
#[test]
fn read_metadata_reads_the_header_alone() {
    let dir = scratch("metadata");
    let path = dir.join("m.safetensors");
    let mut ck = Checkpoint::from_tensors(mlp(DType::F32, Device::Cpu).unwrap().state_dict());
    ck.set_metadata("epoch", "7");
    ck.save(&path).unwrap();
    let meta = checkpoint::read_metadata(&path).unwrap();
    assert_eq!(
        meta.into_iter().collect::<Vec<_>>(),
        vec![("epoch".to_string(), "7".to_string())]
    );
    // Only the header matters: the tensors' bytes may be anything.
    let first = tensor_bytes(&path, "0.weight").start;
    damage(&path, |b| b[first] ^= 0xff);
    assert!(checkpoint::read_metadata(&path).is_ok());
    damage(&path, |b| b.truncate(20));
    let err = checkpoint::read_metadata(&path).unwrap_err().to_string();
    assert!(
        err.contains("m.safetensors") && err.contains("truncated"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Names of the files in `dir`.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .is_some_and(|ids| ids.split_whitespace().nth(1) == Some("0"))
    })
}

#[test]
fn no_temporary_file_is_left_after_a_save_or_a_failed_one() {
    let dir = scratch("temp");
    let state = mlp(DType::F32, Device::Cpu).unwrap().state_dict();
    checkpoint::save(dir.join("m.safetensors"), &state).unwrap();
    checkpoint::save(dir.join("m.safetensors"), &state).unwrap();
    assert_eq!(listing(&dir), ["m.safetensors"]);
    // The rename fails (the name is a non-empty directory) after the data was written.
    std::fs::create_dir_all(dir.join("taken.safetensors/inside")).unwrap();
    let err = checkpoint::save(dir.join("taken.safetensors"), &state).unwrap_err();
    assert!(matches!(err, CheckpointError::Io { .. }), "{err}");
    assert!(err.to_string().contains("taken.safetensors"), "{err}");
    assert_eq!(listing(&dir), ["m.safetensors", "taken.safetensors"]);
    // A directory the process cannot write to (root writes anywhere, so only for others).
    #[cfg(unix)]
    if !running_as_root() {
        use std::os::unix::fs::PermissionsExt;
        let locked = dir.join("locked");
        std::fs::create_dir(&locked).unwrap();
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o555)).unwrap();
        let err = checkpoint::save(locked.join("m.safetensors"), &state).unwrap_err();
        assert!(err.to_string().contains("locked"), "{err}");
        assert!(listing(&locked).is_empty());
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    // A refused save leaves the previous file as it was.
    let before = std::fs::read(dir.join("m.safetensors")).unwrap();
    let mut twice = state.clone();
    twice.push(state[0].clone());
    assert!(checkpoint::save(dir.join("m.safetensors"), &twice).is_err());
    assert_eq!(std::fs::read(dir.join("m.safetensors")).unwrap(), before);
    assert_eq!(listing(&dir), ["m.safetensors", "taken.safetensors"]);
    std::fs::remove_dir_all(&dir).ok();
}

/// Run in a child process whose umask is 027 (by `saves_follow_the_umask`): saves a file and
/// prints its mode.
#[test]
#[ignore = "run by saves_follow_the_umask in a child process with its own umask"]
fn umask_child() {
    let Some(dir) = std::env::var_os("FERRY_UMASK_CHILD_DIR") else {
        return;
    };
    let path = Path::new(&dir).join("m.safetensors");
    checkpoint::save(&path, &[("x".into(), Tensor::scalar(1.0f32))]).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        println!("FERRY_MODE={mode:o}");
    }
}

#[test]
#[cfg(unix)]
fn saves_follow_the_umask() {
    let dir = scratch("umask");
    // umask is process-wide: a child process of this binary gets its own, touching no other test.
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("umask 027 && exec \"$0\" --ignored --exact checkpoint::umask_child --nocapture --test-threads 1")
        .arg(std::env::current_exe().unwrap())
        .env("FERRY_UMASK_CHILD_DIR", &dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 0666 less 027: neither the 0644 ferry used to force nor the 0600 of a private temp file.
    assert!(stdout.contains("FERRY_MODE=640"), "{stdout}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Run in a child process by `a_save_killed_at_any_moment_leaves_only_checkpoints_that_verify`:
/// saves checkpoints of 16 MiB on the device `FERRY_KILL_CHILD_DEVICE` names, one after
/// another over three names, by `save` and `save_async` (bounded and pageable snapshots) in
/// turn, until it is killed.
#[test]
#[ignore = "run by the kill test in a child process, which it kills"]
fn kill_child() {
    let Some(dir) = std::env::var_os("FERRY_KILL_CHILD_DIR") else {
        return;
    };
    let device = match std::env::var("FERRY_KILL_CHILD_DEVICE").as_deref() {
        Ok("cuda") => Device::Cuda(0),
        _ => Device::Cpu,
    };
    // The device is set up before the parent starts its clock.
    Tensor::zeros(&[1], DType::F32, device).unwrap();
    println!("FERRY_SAVING");
    for n in 0u32.. {
        // Every tensor of save n holds n: a file mixing two saves would show it.
        let state: Vec<(String, Tensor)> = (0..4)
            .map(|k| {
                let values = vec![n as f32; 1 << 20];
                let t = Tensor::from_slice(&values, &[1 << 20]).unwrap();
                (format!("t{k}"), t.to(device).unwrap())
            })
            .collect();
        let path = Path::new(&dir).join(format!("ckpt-{}.safetensors", n % 3));
        // Synchronous and asynchronous saves in turn: the kill finds each at every stage.
        if n % 2 == 0 {
            checkpoint::save(&path, &state).unwrap();
        } else {
            let memory = if n % 4 == 1 {
                checkpoint::SnapshotMemory::Bounded(4 << 20)
            } else {
                checkpoint::SnapshotMemory::Pageable
            };
            let options = checkpoint::AsyncSaveOptions {
                memory,
                staging_bytes: 1 << 20,
                ..checkpoint::AsyncSaveOptions::default()
            };
            checkpoint::save_async(&path, &state, options)
                .unwrap()
                .wait()
                .unwrap();
        }
    }
}

device_test!(
    a_save_killed_at_any_moment_leaves_only_checkpoints_that_verify,
    saves_killed_at_any_moment
);

/// SIGKILL at many moments of a run of saves of tensors on `device`: every file with a
/// checkpoint's name verifies (header and every checksum) and holds one save whole; anything
/// else is a temporary.
fn saves_killed_at_any_moment(device: Device) -> Result<()> {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let kind = if device.is_cuda() { "cuda" } else { "cpu" };
    let dir = scratch(&format!("kill-{kind}"));
    let (mut kills, mut checked) = (0, 0);
    // Each one left by a save a kill cut short.
    let mut temporaries = std::collections::BTreeSet::new();
    for k in 0..24u64 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "checkpoint::kill_child",
                "--nocapture",
            ])
            .args(["--test-threads", "1"])
            .env("FERRY_KILL_CHILD_DIR", &dir)
            .env("FERRY_KILL_CHILD_DEVICE", kind)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        // Once it is saving, kill it 0 to 230 ms later: before, inside and between saves.
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        assert!(lines.any(|l| l.is_ok_and(|l| l.contains("FERRY_SAVING"))));
        std::thread::sleep(std::time::Duration::from_millis(k * 10));
        child.kill().unwrap();
        child.wait().unwrap();
        kills += 1;
        for name in listing(&dir) {
            let path = dir.join(&name);
            if !name.ends_with(".safetensors") {
                assert!(name.starts_with('.') && name.ends_with(".tmp"), "{name}");
                temporaries.insert(name);
                continue;
            }
            let verified = checkpoint::verify(&path)
                .unwrap_or_else(|e| panic!("after kill {k}: {name} does not verify: {e}"));
            assert_eq!((verified.tensors, verified.checksummed), (4, true));
            let state = checkpoint::load(&path).unwrap();
            let first = state[0].1.to_vec::<f32>()?[0];
            for (key, t) in &state {
                let values = t.to_vec::<f32>()?;
                assert!(
                    values.iter().all(|&v| v == first),
                    "{name}: {key} mixes two saves"
                );
            }
            checked += 1;
        }
    }
    println!(
        "{device}: {kills} kills ({} inside a save, which left its temporary), {checked} \
         checkpoint files checked: all verified and whole",
        temporaries.len()
    );
    assert!(checked > 0);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn repeated_and_reserved_names_are_errors_and_write_nothing() {
    let dir = scratch("names");
    let path = dir.join("m.safetensors");
    let state = mlp(DType::F32, Device::Cpu).unwrap().state_dict();
    let mut ck = Checkpoint::new();
    ck.insert_section("model", state.clone());
    ck.insert_section("model", state.clone());
    let err = ck.save(&path).unwrap_err();
    assert!(
        matches!(&err, CheckpointError::DuplicateName { key } if key == "model.0.weight"),
        "{err}"
    );
    assert!(err.to_string().contains("insert_section") && err.to_string().contains("own name"));
    let reserved = vec![("__metadata__".to_string(), Tensor::scalar(1.0f32))];
    let err = checkpoint::save(&path, &reserved).unwrap_err();
    assert!(matches!(&err, CheckpointError::ReservedName { key, .. } if key == "__metadata__"));
    assert!(err.to_string().contains("rename the tensor"), "{err}");
    let mut ck = Checkpoint::from_tensors(state);
    ck.set_metadata(checkpoint::CHECKSUM_KEY, "mine");
    let err = ck.save(&path).unwrap_err();
    assert!(err.to_string().contains("another key"), "{err}");
    assert!(listing(&dir).is_empty(), "{:?}", listing(&dir));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_file_without_checksums_still_loads() {
    // As Python's safetensors writes it: no `__metadata__`, F32 then U8, aligned.
    let dir = scratch("plain");
    let header = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}"#;
    let mut header = header.to_vec();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(&1.5f32.to_le_bytes());
    bytes.extend_from_slice(&(-2.0f32).to_le_bytes());
    bytes.extend_from_slice(&[7, 8, 9]);
    let path = dir.join("plain.safetensors");
    std::fs::write(&path, &bytes).unwrap();
    let state = checkpoint::load(&path).unwrap();
    assert_eq!(state[0].0, "a");
    assert_eq!(state[0].1.to_vec::<f32>().unwrap(), [1.5, -2.0]);
    assert_eq!(state[1].1.to_vec::<u8>().unwrap(), [7, 8, 9]);
    // Trailing bytes and a short file are still refused without checksums.
    std::fs::write(&path, [bytes.as_slice(), &[0]].concat()).unwrap();
    assert!(
        checkpoint::load(&path)
            .unwrap_err()
            .to_string()
            .contains("trailing")
    );
    std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    assert!(
        matches!(checkpoint::load(&path), Err(CheckpointError::Truncated { key, .. }) if key == "b")
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Peak memory of a load, measured alone in a child process (`load_takes_about_the_file_size`).
#[test]
#[ignore = "run by load_takes_about_the_file_size in a child process"]
fn load_peak_child() {
    let Some(dir) = std::env::var_os("FERRY_PEAK_CHILD_DIR") else {
        return;
    };
    let mb: usize = std::env::var("FERRY_CKPT_PEAK_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let path = Path::new(&dir).join("big.safetensors");
    {
        // Four tensors of mb/4 MiB each, written and dropped before measuring.
        let n = mb * (1 << 20) / 16;
        let state: Vec<(String, Tensor)> = (0..4)
            .map(|i| {
                (
                    format!("t{i}"),
                    Tensor::full(&[n], i as f64, DType::F32, Device::Cpu).unwrap(),
                )
            })
            .collect();
        let start = std::time::Instant::now();
        checkpoint::save(&path, &state).unwrap();
        println!(
            "FERRY_SAVE {mb} MiB saved durably (fsync of file and directory) in {:.3} s",
            start.elapsed().as_secs_f64()
        );
    }
    let file_len = std::fs::metadata(&path).unwrap().len() as f64;
    let status = |field: &str| -> f64 {
        let text = std::fs::read_to_string("/proc/self/status").unwrap();
        let kb: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap();
        kb * 1024.0
    };
    // Reset the high-water mark of resident memory to what is resident now (Linux >= 4.0).
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    ferry::host::reset_peak();
    let (rss_before, host_before) = (status("VmRSS:"), ferry::host::memory_allocated() as f64);
    let start = std::time::Instant::now();
    let state = checkpoint::load(&path).unwrap();
    let took = start.elapsed().as_secs_f64();
    let rss_peak = status("VmHWM:") - rss_before;
    let host_peak = ferry::host::max_memory_allocated() as f64 - host_before;
    assert_eq!(state.len(), 4);
    let mib = |b: f64| b / f64::from(1 << 20);
    println!(
        "FERRY_PEAK file {:.1} MiB, load {took:.3} s, host buffers peak +{:.1} MiB ({:.3}x), resident peak +{:.1} MiB ({:.3}x)",
        mib(file_len),
        mib(host_peak),
        host_peak / file_len,
        mib(rss_peak),
        rss_peak / file_len
    );
    // Reading the whole file and then copying it, as loads used to, peaks at twice its size.
    assert!(
        host_peak <= file_len * 1.01,
        "host peak {host_peak} for a {file_len}-byte file"
    );
    assert!(
        rss_peak <= file_len * 1.1 + 8e6,
        "resident peak {rss_peak} for a {file_len}-byte file"
    );
}

#[test]
fn load_takes_about_the_file_size() {
    let dir = scratch("peak");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "checkpoint::load_peak_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("FERRY_PEAK_CHILD_DIR", &dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| Some(&l[l.find("FERRY_PEAK")?..]))
        .expect("the child reports its figures");
    eprintln!("{line}");
    std::fs::remove_dir_all(&dir).ok();
}

// Bounded saves and loads: the piece logic on the CPU, the bounds on a GPU.

/// A state dict with every kind of entry a bounded save cuts differently, on `device`: a
/// contiguous tensor many slots long, a view into it at an offset, a transposed tensor whose
/// rows are longer than a slot, a narrowed (non-contiguous) view, f16 and i64, an empty and a
/// 0-d tensor.
pub(crate) fn awkward_dict(device: Device) -> Result<Vec<(String, Tensor)>> {
    let big = Tensor::randn(&[300, 250], DType::F32, device)?; // 300,000 bytes
    Ok(vec![
        ("big".into(), big.clone()),
        ("rows".into(), big.narrow(0, 5, 50)?),
        ("cols".into(), big.narrow(1, 10, 100)?),
        (
            "transposed".into(),
            Tensor::randn(&[3000, 40], DType::F64, device)?.t()?,
        ),
        (
            "half".into(),
            Tensor::randn(&[70, 90], DType::F32, device)?.to_dtype(DType::F16)?,
        ),
        (
            "steps".into(),
            Tensor::randn(&[2500], DType::F32, device)?
                .mul_scalar(1000.0)?
                .to_dtype(DType::I64)?,
        ),
        ("empty".into(), Tensor::zeros(&[0, 7], DType::F32, device)?),
        ("scalar".into(), Tensor::full(&[], 3.5, DType::F64, device)?),
    ])
}

const SMALL_BOUND: usize = 16 << 10;

/// A save through a 16 KiB staging bound (4 KiB slots) writes the same bytes as the default
/// save and as a save of the tensors made contiguous on the host first, within its bound; a
/// load through the same bound gives the values back on `device`.
fn a_bounded_save_writes_the_same_bytes(device: Device) -> Result<()> {
    let dir = scratch(&format!("bounded-{device}"));
    let dict = awkward_dict(device)?;
    let host: Vec<(String, Tensor)> = dict
        .iter()
        .map(|(k, t)| Ok((k.clone(), t.cpu()?.contiguous()?)))
        .collect::<Result<_>>()?;
    let (small, default, reference) = (
        dir.join("small.safetensors"),
        dir.join("default.safetensors"),
        dir.join("reference.safetensors"),
    );
    let options = checkpoint::SaveOptions {
        staging_bytes: SMALL_BOUND,
    };
    let report = checkpoint::save_with(&small, &dict, options).unwrap();
    checkpoint::save(&default, &dict).unwrap();
    checkpoint::save(&reference, &host).unwrap();
    let bytes = std::fs::read(&small).unwrap();
    assert!(
        bytes == std::fs::read(&default).unwrap(),
        "bounded != default"
    );
    assert!(
        bytes == std::fs::read(&reference).unwrap(),
        "bounded != host copy"
    );

    let total: usize = dict.iter().map(|(_, t)| t.nbytes()).sum();
    assert_eq!((report.tensors, report.bytes), (dict.len(), total));
    assert!(report.peak_extra_host_bytes <= SMALL_BOUND, "{report}");
    assert!(report.peak_extra_device_bytes <= SMALL_BOUND, "{report}");
    assert!(!report.pageable, "{report}");
    if device.is_cuda() {
        assert_eq!(report.device_bytes, total);
        // `big` alone is 74 slots of 4 KiB.
        assert!(report.pieces >= 74 + 50 / 4, "{report}");
        // The ring: four 4 KiB pinned slots.
        assert!(report.peak_extra_host_bytes >= 4 * 4096, "{report}");
    } else {
        assert_eq!(
            (report.device_bytes, report.peak_extra_device_bytes),
            (0, 0)
        );
        // Only the non-contiguous tensors are staged: `cols` in blocks of 10 rows (4,000
        // bytes), `transposed` row by row in blocks of 512 f64.
        assert_eq!(report.pieces, 30 + 40 * 6, "{report}");
        assert!(report.peak_extra_host_bytes > 0, "{report}");
    }

    let load = checkpoint::LoadOptions {
        staging_bytes: SMALL_BOUND,
    };
    let (back, load_report) = checkpoint::load_to(&small, device, load).unwrap();
    assert_eq!(back.len(), dict.len());
    for (name, t) in &dict {
        let (_, got) = back.iter().find(|(k, _)| k == name).unwrap();
        assert_eq!(got.device(), device, "{name}");
        assert_eq!((got.dtype(), got.shape()), (t.dtype(), t.shape()), "{name}");
        assert_eq!(values(got), values(t), "{name}");
    }
    assert!(
        load_report.peak_extra_host_bytes <= SMALL_BOUND,
        "{load_report}"
    );
    if device.is_cuda() {
        let pieces: usize = dict.iter().map(|(_, t)| t.nbytes().div_ceil(4096)).sum();
        assert_eq!(load_report.pieces, pieces, "{load_report}");
        assert_eq!(load_report.device_bytes, total);
    } else {
        assert_eq!(load_report.pieces, 0);
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
device_test!(
    a_bounded_save_writes_the_same_bytes,
    a_bounded_save_writes_the_same_bytes
);

/// A flipped bit fails a streamed load with the tensor named, and nothing is handed out.
fn a_streamed_load_of_a_damaged_file_hands_out_nothing(device: Device) -> Result<()> {
    let dir = scratch(&format!("streamed-damage-{device}"));
    let path = dir.join("m.safetensors");
    checkpoint::save(&path, &awkward_dict(device)?).unwrap();
    let range = tensor_bytes(&path, "transposed");
    damage(&path, |b| b[range.start + 9_000] ^= 0x10);
    let options = checkpoint::LoadOptions {
        staging_bytes: SMALL_BOUND,
    };
    match checkpoint::load_to(&path, device, options) {
        Err(CheckpointError::ChecksumMismatch { key, .. }) => assert_eq!(key, "transposed"),
        other => panic!("expected a checksum mismatch, got {other:?}"),
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
device_test!(
    a_streamed_load_of_a_damaged_file_hands_out_nothing,
    a_streamed_load_of_a_damaged_file_hands_out_nothing
);

#[test]
fn a_staging_bound_too_small_is_an_error_that_writes_and_loads_nothing() {
    let dir = scratch("small-bound");
    let path = dir.join("m.safetensors");
    let dict = awkward_dict(Device::Cpu).unwrap();
    let too_small = checkpoint::SaveOptions {
        staging_bytes: 16383,
    };
    let err = checkpoint::save_with(&path, &dict, too_small).unwrap_err();
    assert!(
        matches!(err, CheckpointError::StagingTooSmall { minimum: 16384, .. }),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("16384") && text.contains("staging_bytes"),
        "{text}"
    );
    assert!(listing(&dir).is_empty(), "{:?}", listing(&dir));

    checkpoint::save(&path, &dict).unwrap();
    let err = checkpoint::load_to(
        &path,
        Device::Cpu,
        checkpoint::LoadOptions { staging_bytes: 0 },
    )
    .unwrap_err();
    assert!(err.to_string().contains("load_to"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn load_to_the_host_reads_what_load_reads_with_no_extra_memory() {
    let dir = scratch("load-to-host");
    let path = dir.join("m.safetensors");
    let dict = awkward_dict(Device::Cpu).unwrap();
    let mut ck = Checkpoint::from_tensors(dict.clone());
    ck.set_metadata("epoch", "3");
    ck.save_with(&path, checkpoint::SaveOptions::default())
        .unwrap();
    let (back, report) =
        Checkpoint::load_to(&path, Device::Cpu, checkpoint::LoadOptions::default()).unwrap();
    assert_eq!(back.metadata("epoch"), Some("3"));
    let plain = checkpoint::load(&path).unwrap();
    assert_eq!(back.tensors().len(), plain.len());
    for ((k, a), (l, b)) in back.tensors().iter().zip(&plain) {
        assert_eq!(k, l);
        assert_eq!(values(a), values(b), "{k}");
    }
    let total: usize = dict.iter().map(|(_, t)| t.nbytes()).sum();
    assert_eq!((report.tensors, report.bytes), (dict.len(), total));
    assert_eq!(
        (
            report.device_bytes,
            report.peak_extra_host_bytes,
            report.peak_extra_device_bytes
        ),
        (0, 0, 0)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `VmRSS` or `VmHWM` of this process, in bytes.
fn resident(field: &str) -> f64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kb * 1024.0
}

#[test]
#[ignore = "run by a_gpu_state_dict_streams_within_the_bound in a child process"]
fn gpu_bound_child() {
    use ferry::memory::cuda::{CudaDevice, PinnedPool};
    let Some(dir) = std::env::var_os("FERRY_BOUND_CHILD_DIR") else {
        return;
    };
    let path = Path::new(&dir).join("big.safetensors");
    let gpu = Device::Cuda(0);
    let bound = 64usize << 20;
    let dev = CudaDevice::get(0).unwrap();
    let pool = PinnedPool::global().unwrap();
    // 8 x 64 MiB + a 16 MiB transposed view + small ones: over 8x the bound.
    let mut dict: Vec<(String, Tensor)> = (0..8)
        .map(|i| {
            let w = Tensor::randn(&[4096, 4096], DType::F32, gpu).unwrap();
            (format!("layer{i}.weight"), w)
        })
        .collect();
    dict.push((
        "transposed".into(),
        Tensor::randn(&[2048, 2048], DType::F32, gpu)
            .unwrap()
            .t()
            .unwrap(),
    ));
    dict.push((
        "bias".into(),
        Tensor::randn(&[4096], DType::F32, gpu).unwrap(),
    ));
    dict.push((
        "step".into(),
        Tensor::full(&[], 7.0, DType::I64, gpu).unwrap(),
    ));
    dev.synchronize().unwrap();
    let total: usize = dict.iter().map(|(_, t)| t.nbytes()).sum();
    let mib = |b: usize| b as f64 / f64::from(1 << 20);
    // Untimed: compiles the strided-copy kernel and makes the copy stream, so neither lands in
    // the figures below.
    let warm = Path::new(&dir).join("warm.safetensors");
    let small = Tensor::randn(&[64, 32], DType::F32, gpu)
        .unwrap()
        .t()
        .unwrap();
    let options = checkpoint::SaveOptions {
        staging_bytes: bound,
    };
    checkpoint::save_with(&warm, &[("w".into(), small)], options).unwrap();
    std::fs::remove_file(&warm).unwrap();

    // The peaks of the whole process, from a start at what is allocated now (a test may reset
    // them; library code never does).
    let start = || {
        std::fs::write("/proc/self/clear_refs", "5").unwrap();
        ferry::host::reset_peak();
        dev.reset_peak();
        pool.reset_peak();
        (
            dev.memory_stats().allocated_bytes,
            pool.stats().allocated_bytes,
            ferry::host::memory_allocated(),
            resident("VmRSS:"),
        )
    };
    let peaks = |(d, p, h, r): (usize, usize, usize, f64)| {
        (
            dev.memory_stats().peak_allocated_bytes - d,
            pool.stats().peak_allocated_bytes - p,
            ferry::host::max_memory_allocated() - h,
            (resident("VmHWM:") - r).max(0.0) as usize,
        )
    };
    // Resident memory also grows by what the driver and the allocators keep for themselves.
    let rss_slack = 64usize << 20;

    let before = start();
    let t0 = std::time::Instant::now();
    let save = checkpoint::save_with(
        &path,
        &dict,
        checkpoint::SaveOptions {
            staging_bytes: bound,
        },
    )
    .unwrap();
    let took = t0.elapsed().as_secs_f64();
    let (d, p, h, r) = peaks(before);
    println!(
        "FERRY_BOUND save {:.0} MiB in {took:.3} s ({:.2} GB/s, fsync included), bound {:.0} MiB: device +{:.1} MiB, pinned +{:.1} MiB, host buffers +{:.1} MiB, resident +{:.1} MiB; report: {save}",
        mib(total),
        total as f64 / took / 1e9,
        mib(bound),
        mib(d),
        mib(p),
        mib(h),
        mib(r)
    );
    assert_eq!(save.device_bytes, total);
    assert!(d <= bound && p <= bound && h <= bound, "save: {d} {p} {h}");
    assert!(r <= bound + rss_slack, "save: resident +{r}");
    assert!(save.peak_extra_host_bytes <= bound && save.peak_extra_device_bytes <= bound);
    assert!(!save.pageable);

    let before = start();
    let t0 = std::time::Instant::now();
    let (loaded, load) = checkpoint::load_to(
        &path,
        gpu,
        checkpoint::LoadOptions {
            staging_bytes: bound,
        },
    )
    .unwrap();
    let took = t0.elapsed().as_secs_f64();
    let (d, p, h, r) = peaks(before);
    let results: usize = dict
        .iter()
        .map(|(_, t)| CudaDevice::block_size(t.nbytes()))
        .sum();
    println!(
        "FERRY_BOUND load {:.0} MiB in {took:.3} s ({:.2} GB/s), bound {:.0} MiB: device +{:.1} MiB over the {:.1} MiB of results, pinned +{:.1} MiB, host buffers +{:.1} MiB, resident +{:.1} MiB; report: {load}",
        mib(total),
        total as f64 / took / 1e9,
        mib(bound),
        mib(d.saturating_sub(results)),
        mib(results),
        mib(p),
        mib(h),
        mib(r)
    );
    assert!(
        d <= results + bound && p <= bound && h <= bound,
        "load: {d} {p} {h}"
    );
    assert!(r <= bound + rss_slack, "load: resident +{r}");
    assert!(load.peak_extra_host_bytes <= bound);
    // The values: small tensors whole, the first and last rows of the large ones.
    for (name, t) in &dict {
        let (_, got) = loaded.iter().find(|(k, _)| k == name).unwrap();
        assert_eq!((got.device(), got.shape()), (gpu, t.shape()), "{name}");
        let ends = |x: &Tensor| -> Vec<f64> {
            if x.ndim() == 0 || x.shape()[0] <= 8 {
                return values(x);
            }
            let n = x.shape()[0];
            [x.narrow(0, 0, 4).unwrap(), x.narrow(0, n - 4, 4).unwrap()]
                .iter()
                .flat_map(values)
                .collect()
        };
        assert_eq!(ends(got), ends(t), "{name}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_gpu_state_dict_streams_within_the_bound() {
    let dir = scratch("gpu-bound");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "checkpoint::gpu_bound_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("FERRY_BOUND_CHILD_DIR", &dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in stdout
        .lines()
        .filter_map(|l| Some(&l[l.find("FERRY_BOUND")?..]))
    {
        eprintln!("{line}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Temporaries named as a save of this process id would name them (`.NAME.PID.N.tmp`, as a
/// killed save of an earlier process with the same id leaves them in a container) do not block
/// a save; once it is in place every one of them is removed, old or fresh, since no live writer
/// holds its lock (a live writer's stays: `durable`'s unit tests), and other targets' are left.
#[test]
fn a_temporary_left_by_a_killed_save_does_not_block_the_next() {
    let dir = scratch("stale-temp");
    let path = dir.join("m.safetensors");
    let pid = std::process::id();
    let temp = |n: usize| dir.join(format!(".m.safetensors.{pid}.{n}.tmp"));
    for n in 0..10_000 {
        std::fs::write(temp(n), b"killed mid-save").unwrap();
    }
    let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let old = |p: &Path| {
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(hour_ago).unwrap();
    };
    let stale = [
        temp(0),
        temp(1),
        dir.join(format!(".m.safetensors.{pid}.5.77.tmp")),
    ];
    std::fs::write(&stale[2], b"killed mid-save").unwrap();
    let other = dir.join(format!(".other.safetensors.{pid}.0.tmp"));
    std::fs::write(&other, b"another target").unwrap();
    for p in stale.iter().chain([&other]) {
        old(p);
    }
    let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
    checkpoint::save(&path, &[("t".to_string(), t)]).unwrap();
    assert_eq!(
        values(&checkpoint::load(&path).unwrap()[0].1),
        [1.0, 2.0, 3.0]
    );
    for p in &stale {
        assert!(!p.exists(), "{} was left", p.display());
    }
    assert!(
        !temp(2).exists() && !temp(9_999).exists(),
        "fresh, but nobody holds them"
    );
    assert!(other.exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// The child of `killed_saves_leave_nothing_behind`: saves 32 MiB to the target it is given,
/// over and over, until it is killed. Without the variable it does nothing.
#[test]
#[ignore = "run by killed_saves_leave_nothing_behind in a child process"]
fn saver_child() {
    let Some(target) = std::env::var_os("FERRY_TEST_SAVER_TARGET") else {
        return;
    };
    let w = Tensor::zeros(&[8 << 20], DType::F32, Device::Cpu).unwrap();
    loop {
        checkpoint::save(&target, &[("w".to_string(), w.clone())]).unwrap();
    }
}

/// Issue 42's kill test: a process killed (SIGKILL) in the middle of saves, eight times, leaves
/// a temporary each time; the next save that completes removes them all, and only the target
/// remains.
#[test]
#[cfg(unix)]
fn killed_saves_leave_nothing_behind() {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let dir = scratch("killed");
    let target = dir.join("ckpt.safetensors");
    let temporaries = || {
        listing(&dir)
            .into_iter()
            .filter(|n| n.starts_with(".ckpt.safetensors.") && n.ends_with(".tmp"))
            .count()
    };
    for kill in 0..8 {
        let before = temporaries();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "checkpoint::saver_child", "--include-ignored"])
            .env("FERRY_TEST_SAVER_TARGET", &target)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Killed as soon as its save has a temporary: in the middle of writing it.
        let deadline = Instant::now() + Duration::from_secs(30);
        while temporaries() == before && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(temporaries() > before, "kill {kill}: no save was under way");
    }
    assert_eq!(temporaries(), 8, "{:?}", listing(&dir));
    let w = Tensor::ones(&[4], DType::F32, Device::Cpu).unwrap();
    checkpoint::save(&target, &[("w".to_string(), w)]).unwrap();
    assert_eq!(listing(&dir), ["ckpt.safetensors"]);
}

/// One checkpoint saved twice is the same bytes twice (metadata in a fixed order), and a file
/// with empty tensors at one offset, named against their file order, verifies every time.
#[test]
fn saves_are_byte_for_byte_repeatable_and_empty_tensors_verify() {
    let dir = scratch("repeatable");
    let mut ck = Checkpoint::from_tensors(vec![
        (
            "w".into(),
            Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap(),
        ),
        (
            "z_empty".into(),
            Tensor::from_slice::<f32>(&[], &[0]).unwrap(),
        ),
        (
            "a_empty".into(),
            Tensor::from_slice::<f32>(&[], &[0, 4]).unwrap(),
        ),
        // Five empty tensors and one other: at most two offsets, so some share one.
        (
            "q_empty".into(),
            Tensor::from_slice::<f32>(&[], &[2, 0]).unwrap(),
        ),
        (
            "c_empty".into(),
            Tensor::from_slice::<f32>(&[], &[0]).unwrap(),
        ),
        (
            "m_empty".into(),
            Tensor::from_slice::<f32>(&[], &[0, 0]).unwrap(),
        ),
    ]);
    for (key, value) in [
        ("step", "7"),
        ("epoch", "2"),
        ("model", "gpt"),
        ("lr", "3e-4"),
    ] {
        ck.set_metadata(key, value);
    }
    let (first, second) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    ck.save(&first).unwrap();
    ck.save(&second).unwrap();
    assert_eq!(
        std::fs::read(&first).unwrap(),
        std::fs::read(&second).unwrap()
    );
    for _ in 0..16 {
        checkpoint::verify(&first).unwrap();
    }
    std::fs::remove_dir_all(&dir).ok();
}
