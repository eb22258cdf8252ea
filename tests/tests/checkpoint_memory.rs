//! The device copy of an asynchronous save, by the device allocator's statistics: periodic
//! saves and a reserved first save allocate nothing, and a budget without room reads in place.
//! Device-wide counts and budgets: run serialised behind the binary's lock.

use std::path::PathBuf;

use ferry::checkpoint::{self, AsyncSaveOptions, DeviceCopy};
use ferry::cuda_libs::Kernels;
use ferry::memory::cuda::CudaDevice;
use ferry_tensor::{DType, Device, Tensor};
use ferry_tests::values;

/// An empty directory of the test's own, under the system's temporary directory.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-ckpt-mem-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Periodic saves of one state: the device copy's memory goes back to ferry's allocator once
/// the snapshot is taken, and the next save's copies come from its cache, not `cuMemAlloc`.
#[test]
#[ignore = "needs a CUDA device"]
fn periodic_saves_take_the_device_copy_from_the_last_ones_memory() {
    let _serial = super::serial_lock();
    let dev = CudaDevice::get(0).unwrap();
    let dir = scratch("periodic");
    let path = dir.join("p.safetensors");
    let state: Vec<(String, Tensor)> = (0..4)
        .map(|i| {
            let t = Tensor::full(&[1 << 20], f64::from(i), DType::F32, Device::Cuda(0)).unwrap();
            (format!("t{i}"), t)
        })
        .collect();
    let options = AsyncSaveOptions {
        device_copy: DeviceCopy::Always,
        ..AsyncSaveOptions::default()
    };
    for save in 0..3 {
        let before = dev.memory_stats();
        let pending = checkpoint::save_async(&path, &state, options.clone()).unwrap();
        assert!(pending.device_copied_all(), "save {save}");
        let report = pending.wait().unwrap();
        assert_eq!(report.device_copied, 16 << 20, "save {save}");
        let after = dev.memory_stats();
        if save > 0 {
            assert_eq!(
                after.device_allocations, before.device_allocations,
                "save {save} allocated device memory: {before:?} -> {after:?}"
            );
            assert!(after.cache_hits > before.cache_hits, "{after:?}");
        }
        // The copies are given back: nothing of the save stays allocated.
        assert_eq!(after.allocated_bytes, before.allocated_bytes, "save {save}");
    }
    let saved = checkpoint::load(&path).unwrap();
    for (i, (_, t)) in saved.iter().enumerate() {
        assert!(values(t).iter().all(|&v| v == i as f64));
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Memory reserved ahead of the loop serves the device copy of the first save too: its call
/// makes no device allocation and compiles no kernel, the file holds the state, and `Off`
/// reserves nothing.
#[test]
#[ignore = "needs a CUDA device"]
fn a_reserved_device_copy_lets_even_the_first_save_allocate_nothing() {
    let _serial = super::serial_lock();
    let dev = CudaDevice::get(0).unwrap();
    let dir = scratch("reserved");
    let path = dir.join("r.safetensors");
    // Sizes no other test caches: the first save's memory can only be the reservation's.
    let mut state: Vec<(String, Tensor)> = (0..3)
        .map(|i| {
            let n = (1 << 20) + 4099 * (i + 1);
            let t = Tensor::full(&[n], i as f64, DType::F32, Device::Cuda(0)).unwrap();
            (format!("w{i}"), t)
        })
        .collect();
    let lone = Tensor::full(&[777, 1001], 1.5, DType::BF16, Device::Cuda(0)).unwrap();
    state.push(("b".into(), lone));
    let bytes: usize = state.iter().map(|(_, t)| t.nbytes()).sum();
    assert_eq!(
        checkpoint::reserve_device_copy(&state, DeviceCopy::Off).unwrap(),
        0
    );
    let held = checkpoint::reserve_device_copy(&state, DeviceCopy::Always).unwrap();
    assert_eq!(held, bytes);
    let before = dev.memory_stats();
    let compiled = dev.compile_time();
    let options = AsyncSaveOptions {
        device_copy: DeviceCopy::Always,
        ..AsyncSaveOptions::default()
    };
    let report = checkpoint::save_async(&path, &state, options)
        .unwrap()
        .wait()
        .unwrap();
    let after = dev.memory_stats();
    assert_eq!(report.device_copied, bytes);
    assert_eq!(
        after.device_allocations, before.device_allocations,
        "the first save allocated device memory: {before:?} -> {after:?}"
    );
    // Nor did it compile a kernel: the reservation compiled the ones its copies launch.
    assert_eq!(dev.compile_time(), compiled);
    for (i, (_, t)) in checkpoint::load(&path).unwrap().iter().enumerate() {
        let expected = if i < 3 { i as f64 } else { 1.5 };
        assert!(values(t).iter().all(|&v| v == expected), "tensor {i}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// By default the device copy is made only where the GPU has room: within ferry's budget for
/// it, here lowered below the state's size, the tensors are read in place and the file is the
/// same; with the budget lifted, the next save copies them.
#[test]
#[ignore = "needs a CUDA device"]
fn the_default_device_copy_reads_in_place_where_the_budget_has_no_room() {
    let _serial = super::serial_lock();
    let dev = CudaDevice::get(0).unwrap();
    let dir = scratch("no-room");
    let path = dir.join("r.safetensors");
    let w = Tensor::full(&[4 << 20], 3.0, DType::F32, Device::Cuda(0)).unwrap();
    let state = vec![("w".to_string(), w.clone())];
    let budget = dev.budget();
    dev.set_budget(Some(dev.memory_stats().allocated_bytes + (1 << 20)));
    let pending = checkpoint::save_async(&path, &state, AsyncSaveOptions::default());
    dev.set_budget(budget);
    let pending = pending.unwrap();
    assert!(
        !pending.device_copied_all(),
        "16 MiB do not fit 1 MiB of budget"
    );
    assert_eq!(pending.wait().unwrap().device_copied, 0);
    assert!(
        values(&checkpoint::load(&path).unwrap()[0].1)
            .iter()
            .all(|&v| v == 3.0)
    );
    let pending = checkpoint::save_async(&path, &state, AsyncSaveOptions::default()).unwrap();
    assert!(pending.device_copied_all(), "with the budget lifted");
    assert_eq!(pending.wait().unwrap().device_copied, 16 << 20);
    std::fs::remove_dir_all(&dir).ok();
}
