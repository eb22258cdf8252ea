//! Asynchronous saves: the file a `save_async` writes is the file `save` writes, whatever the
//! snapshot's memory mode; in-place writes after the call never reach the file; errors reach
//! `wait()` or the next save.

use std::time::Duration;

use ferry::CheckpointError;
use ferry::checkpoint::{self, AsyncSaveOptions, DeviceCopy, SnapshotMemory};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{device_test, values};

// The awkward dict of the synchronous tests: every kind of entry a save cuts differently.
use crate::checkpoint::{awkward_dict, scratch};

const SMALL: usize = 16 << 10;

/// Each test's turn at saving: an error of a dropped save reaches the next `save_async` of the
/// process, whichever test makes it, so the tests here save one at a time.
fn turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Each memory mode, through a 16 KiB ring, writes the bytes a synchronous save writes.
fn every_mode_writes_the_bytes_of_a_synchronous_save(device: Device) -> Result<()> {
    let _turn = turn();
    let dir = scratch(&format!("modes-{device}"));
    let dict = awkward_dict(device)?;
    let reference = dir.join("reference.safetensors");
    checkpoint::save(&reference, &dict).unwrap();
    let expected = std::fs::read(&reference).unwrap();
    let total: usize = dict.iter().map(|(_, t)| t.nbytes()).sum();
    for (memory, device_copy) in [
        (SnapshotMemory::Pageable, DeviceCopy::Off),
        (SnapshotMemory::Bounded(SMALL), DeviceCopy::Off),
        (SnapshotMemory::Bounded(SMALL), DeviceCopy::Always),
        (SnapshotMemory::Pinned, DeviceCopy::Off),
        (SnapshotMemory::Pageable, DeviceCopy::Always),
        (SnapshotMemory::Pageable, DeviceCopy::IfRoom),
        (SnapshotMemory::Auto, DeviceCopy::Off),
        (SnapshotMemory::Auto, DeviceCopy::IfRoom),
    ] {
        let name = format!("{memory:?}-{device_copy:?}").replace(['(', ')'], "-");
        let path = dir.join(format!("{name}.safetensors"));
        let options = AsyncSaveOptions {
            staging_bytes: SMALL,
            memory,
            device_copy,
            ..AsyncSaveOptions::default()
        };
        let pending = checkpoint::save_async(&path, &dict, options).unwrap();
        assert_eq!(pending.path(), std::path::absolute(&path).unwrap());
        // Asked for, every GPU tensor is copied in the call (host tensors need none): a few
        // KiB find room on any GPU.
        let copies = device_copy != DeviceCopy::Off;
        assert_eq!(pending.device_copied_all(), copies, "{name}");
        let report = pending.wait().unwrap();
        assert!(
            std::fs::read(&path).unwrap() == expected,
            "{memory:?}: the file differs from a synchronous save's"
        );
        assert_eq!((report.tensors, report.bytes), (dict.len(), total));
        assert_eq!(
            report.device_bytes,
            if device.is_cuda() { total } else { 0 },
            "{memory:?}"
        );
        assert_eq!(
            report.device_copied,
            if device.is_cuda() && copies { total } else { 0 },
            "{name}"
        );
        // The default memory: pinned where GPU tensors are read in place, so their DMAs land
        // at the link's rate; where the device copies hold them all, nothing waits: the disk's
        // pace, within the staging's size; pageable on the host.
        let landed = match memory {
            SnapshotMemory::Auto if device.is_cuda() && !copies => SnapshotMemory::Pinned,
            SnapshotMemory::Auto if device.is_cuda() => SnapshotMemory::Bounded(SMALL),
            SnapshotMemory::Auto => SnapshotMemory::Pageable,
            chosen => chosen,
        };
        assert_eq!(report.memory, landed, "{name}");
        assert!(report.call <= report.elapsed, "{report:?}");
        assert!(report.snapshot <= report.elapsed, "{report:?}");
        match landed {
            // The snapshot's pieces (pageable, or pinned ones of their own) within the bound,
            // beside the 16 KiB ring.
            SnapshotMemory::Bounded(bound) => {
                assert!(report.peak_extra_host_bytes > 0, "{report:?}");
                assert!(
                    report.peak_extra_host_bytes <= 2 * bound,
                    "{name}: {report:?}"
                );
            }
            _ => assert!(report.peak_extra_host_bytes > 0, "{report:?}"),
        }
        if device.is_cuda() {
            assert!(report.peak_pinned_bytes > 0, "{memory:?}: {report:?}");
        } else {
            assert_eq!(report.peak_pinned_bytes, 0, "{memory:?}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
device_test!(
    every_mode_writes_the_bytes_of_a_synchronous_save,
    every_mode_writes_the_bytes_of_a_synchronous_save
);

/// Work queued before the call is in the file; an in-place write right after the call waits
/// for the tensor's copy, so the file holds the values of the moment of the call, and the
/// tensor the new ones.
fn a_write_after_the_call_waits_for_the_copy(device: Device) -> Result<()> {
    let _turn = turn();
    for device_copy in [DeviceCopy::Off, DeviceCopy::IfRoom] {
        a_write_after_the_call_waits_for_the_copy_with(device, device_copy)?;
    }
    Ok(())
}

fn a_write_after_the_call_waits_for_the_copy_with(
    device: Device,
    device_copy: DeviceCopy,
) -> Result<()> {
    let dir = scratch(&format!("order-{device}-{device_copy:?}"));
    let path = dir.join("w.safetensors");
    // 64 MiB: on a GPU, the copy takes milliseconds, far longer than queueing a write.
    let w = Tensor::zeros(&[16 << 20], DType::F32, device)?;
    let b = Tensor::full(&[1000], 1.0, DType::F32, device)?;
    // Queued before the call: the snapshot comes after it.
    w.assign(&Tensor::full(&[16 << 20], 1.0, DType::F32, device)?)?;
    let state = vec![("w".to_string(), w.clone()), ("b".to_string(), b.clone())];
    // The bounded mode through a small ring: the copy is slow on any machine.
    let options = AsyncSaveOptions {
        staging_bytes: 1 << 20,
        memory: SnapshotMemory::Bounded(1 << 20),
        device_copy,
        ..AsyncSaveOptions::default()
    };
    let pending = checkpoint::save_async(&path, &state, options).unwrap();
    // With the device copy, `w` (64 MiB) is copied on the copy stream, beside the writes
    // queued next, which ferry orders after that copy on the device; `b` on the default stream.
    let beside: &[&str] = if device.is_cuda() && device_copy != DeviceCopy::Off {
        &["w"]
    } else {
        &[]
    };
    assert_eq!(pending.side_copied(), beside, "{device_copy:?}");
    w.assign(&Tensor::full(&[16 << 20], 2.0, DType::F32, device)?)?;
    b.assign(&Tensor::full(&[1000], 2.0, DType::F32, device)?)?;
    let report = pending.wait().unwrap();
    let saved = checkpoint::load(&path).unwrap();
    for (key, t) in &saved {
        assert!(values(t).iter().all(|&v| v == 1.0), "{key}: {report:?}");
    }
    assert!(values(&w).iter().all(|&v| v == 2.0));
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
device_test!(
    a_write_after_the_call_waits_for_the_copy,
    a_write_after_the_call_waits_for_the_copy
);

/// An optimizer step right after the call (the training loop's case) leaves the file with
/// the weights of the call.
fn an_optimizer_step_after_the_call_leaves_the_file_whole(device: Device) -> Result<()> {
    let _turn = turn();
    use ferry::optim::{AdamW, Optimizer};
    let dir = scratch(&format!("step-{device}"));
    let path = dir.join("step.safetensors");
    let w = Tensor::randn(&[512, 512], DType::F32, device)?.with_grad()?;
    let mut opt = AdamW::new([w.clone()], 0.1)?;
    w.mul(&w)?.sum()?.backward()?;
    opt.step()?;
    let before = values(&w);
    let mut state = vec![("w".to_string(), w.clone())];
    state.extend(opt.state_dict());
    let pending = checkpoint::save_async(&path, &state, AsyncSaveOptions::default()).unwrap();
    opt.step()?;
    assert_ne!(values(&w), before, "the step changed the weights");
    pending.wait().unwrap();
    let saved = checkpoint::load(&path).unwrap();
    let (_, file_w) = saved.iter().find(|(k, _)| k == "w").unwrap();
    assert_eq!(values(file_w), before);
    let (_, step) = saved.iter().find(|(k, _)| k == "step").unwrap();
    assert_eq!(values(step), vec![1.0], "the step count of the call");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
device_test!(
    an_optimizer_step_after_the_call_leaves_the_file_whole,
    an_optimizer_step_after_the_call_leaves_the_file_whole
);

/// Host tensors need no device copy: reserving for them holds nothing, under any policy.
#[test]
fn reserving_a_device_copy_for_host_tensors_holds_nothing() {
    let state = vec![(
        "w".to_string(),
        Tensor::ones(&[64], DType::F32, Device::Cpu).unwrap(),
    )];
    for policy in [DeviceCopy::Off, DeviceCopy::IfRoom, DeviceCopy::Always] {
        assert_eq!(checkpoint::reserve_device_copy(&state, policy).unwrap(), 0);
    }
}

#[test]
fn a_second_save_to_one_path_waits_for_the_first_and_lands_after_it() {
    let _turn = turn();
    let dir = scratch("twice");
    let path = dir.join("t.safetensors");
    let big = |v: f32| {
        vec![(
            "t".to_string(),
            Tensor::full(&[8 << 20], v as f64, DType::F32, Device::Cpu).unwrap(),
        )]
    };
    let options = AsyncSaveOptions {
        memory: SnapshotMemory::Bounded(1 << 20),
        staging_bytes: 1 << 20,
        ..AsyncSaveOptions::default()
    };
    let first = checkpoint::save_async(&path, &big(1.0), options.clone()).unwrap();
    let second = checkpoint::save_async(&path, &big(2.0), options).unwrap();
    assert!(first.is_finished(), "the second call waited for the first");
    let report = second.wait().unwrap();
    assert!(report.waited_for_previous > Duration::ZERO);
    first.wait().unwrap();
    let saved = checkpoint::load(&path).unwrap();
    assert!(values(&saved[0].1).iter().all(|&v| v == 2.0));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_abandoned_save_leaves_the_target_and_its_dropped_error_reaches_the_next_save() {
    let _turn = turn();
    let dir = scratch("abandon");
    let path = dir.join("a.safetensors");
    let t = |v: f64| {
        vec![(
            "t".to_string(),
            Tensor::full(&[1 << 20], v, DType::F32, Device::Cpu).unwrap(),
        )]
    };
    checkpoint::save(&path, &t(1.0)).unwrap();

    let pending = checkpoint::save_async(&path, &t(2.0), AsyncSaveOptions::default()).unwrap();
    pending.abandon("a test changed its mind");
    let err = pending.wait().unwrap_err();
    assert!(matches!(err, CheckpointError::Abandoned { .. }), "{err}");
    assert!(err.to_string().contains("a test changed its mind"), "{err}");
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["a.safetensors"], "no temporary is left");
    assert!(
        values(&checkpoint::load(&path).unwrap()[0].1)
            .iter()
            .all(|&v| v == 1.0)
    );

    // Dropped without `wait()`: the next save reports it and starts nothing; the one after
    // that runs.
    let pending = checkpoint::save_async(&path, &t(3.0), AsyncSaveOptions::default()).unwrap();
    pending.abandon("dropped on purpose");
    drop(pending);
    let err = checkpoint::save_async(&path, &t(4.0), AsyncSaveOptions::default()).unwrap_err();
    assert!(
        matches!(err, CheckpointError::EarlierSaveFailed { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("dropped on purpose"), "{err}");
    checkpoint::save_async(&path, &t(5.0), AsyncSaveOptions::default())
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        values(&checkpoint::load(&path).unwrap()[0].1)
            .iter()
            .all(|&v| v == 5.0)
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn names_and_bounds_are_checked_at_the_call() {
    let _turn = turn();
    let dir = scratch("checks");
    let t = Tensor::zeros(&[4], DType::F32, Device::Cpu).unwrap();
    let twice = vec![("t".to_string(), t.clone()), ("t".to_string(), t.clone())];
    let err = checkpoint::save_async(
        dir.join("x.safetensors"),
        &twice,
        AsyncSaveOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(err, CheckpointError::DuplicateName { .. }),
        "{err}"
    );
    let options = AsyncSaveOptions {
        staging_bytes: 100,
        ..AsyncSaveOptions::default()
    };
    let err = checkpoint::save_async(
        dir.join("x.safetensors"),
        &[("t".into(), t.clone())],
        options,
    )
    .unwrap_err();
    assert!(
        matches!(err, CheckpointError::StagingTooSmall { .. }),
        "{err}"
    );
    let err = checkpoint::save_async(
        dir.join("missing/x.safetensors"),
        &[("t".into(), t)],
        AsyncSaveOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, CheckpointError::Io { .. }), "{err}");
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "nothing was written"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_save_that_needs_confirming_is_renamed_only_once_confirmed() {
    let _turn = turn();
    let dir = scratch("confirm");
    let path = dir.join("c.safetensors");
    let t = vec![(
        "t".to_string(),
        Tensor::full(&[1 << 16], 1.0, DType::F32, Device::Cpu).unwrap(),
    )];
    let options = AsyncSaveOptions {
        confirm: true,
        ..AsyncSaveOptions::default()
    };
    let pending = checkpoint::save_async(&path, &t, options.clone()).unwrap();
    pending.wait_snapshot();
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !path.exists() && !pending.is_finished(),
        "held for a confirmation"
    );
    pending.confirm();
    pending.wait().unwrap();
    assert!(path.exists());

    std::fs::remove_file(&path).unwrap();
    let pending = checkpoint::save_async(&path, &t, options).unwrap();
    pending.abandon("checked and refused");
    assert!(pending.wait().is_err());
    assert!(!path.exists());
    std::fs::remove_dir_all(&dir).ok();
}
