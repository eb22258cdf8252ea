//! NCCL collectives through `ferry_cuda::Communicator`.
//!
//! The CPU tests run everywhere, with or without libnccl. The GPU tests are ignored on machines
//! without one; run them with `cargo test -p ferry-cuda --test nccl -- --ignored` (the
//! two-GPU tests print a skip and return on a machine with one GPU).
//!
//! The GPU tests share the devices, so each holds a process-wide lock: two communicators on one
//! GPU used at once by concurrent tests could wait on each other.

use std::sync::{Mutex, MutexGuard};

use ferry_cuda::{
    Communicator, CudaLibError, KernelModule, Kernels, ReduceOp, UniqueId, blocks_for, group,
    nccl_present, nccl_version,
};
use ferry_memory::cuda::{CudaDevice, DeviceBuffer, Stream};
use ferry_memory::{DType, Device, MemoryError};

// ---------------------------------------------------------------------------------------------
// CPU: no GPU needed, libnccl optional.

#[test]
fn unique_ids_round_trip_their_bytes_and_refuse_other_lengths() {
    let bytes: Vec<u8> = (0..128u32).map(|i| (i * 7 + 3) as u8).collect();
    let id = UniqueId::from_bytes(&bytes).unwrap();
    assert_eq!(id.to_bytes().as_slice(), bytes.as_slice());
    assert_eq!(UniqueId::BYTES, 128);
    for len in [0, 1, 127, 129, 256] {
        let err = UniqueId::from_bytes(&vec![0; len]).unwrap_err();
        assert!(
            matches!(err, CudaLibError::CollectiveArgument { .. }),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("128 bytes") && text.contains(&format!("{len} were given")),
            "{text}"
        );
        assert!(text.contains("UniqueId::to_bytes"), "{text}");
    }
}

#[test]
fn reduce_ops_have_stable_names() {
    let names: Vec<&str> = ReduceOp::ALL.iter().map(|op| op.name()).collect();
    assert_eq!(names, ["sum", "prod", "max", "min", "avg"]);
    assert_eq!(ReduceOp::Sum.to_string(), "sum");
    assert_ne!(ReduceOp::Sum, ReduceOp::Avg);
}

#[test]
fn without_libnccl_every_entry_point_is_an_error_that_names_it() {
    if nccl_present() {
        let version = nccl_version().unwrap();
        assert!(version >= (2, 0, 0), "{version:?}");
        eprintln!("libnccl present: NCCL {version:?}");
        // Ids need no GPU; two are distinct (each names its own rendezvous).
        let (a, b) = (UniqueId::new().unwrap(), UniqueId::new().unwrap());
        assert_ne!(a.to_bytes(), b.to_bytes());
        let err = Communicator::for_devices(&[]).unwrap_err();
        assert!(err.to_string().contains("no devices"), "{err}");
        return;
    }
    let mut errors = vec![
        nccl_version().unwrap_err(),
        UniqueId::new().unwrap_err(),
        Communicator::for_devices(&[]).unwrap_err(),
        group(|| Ok(())).unwrap_err(),
    ];
    // for_rank needs a device; where a driver and GPU exist but libnccl does not, it must
    // still refuse cleanly.
    if let Ok(device) = CudaDevice::get(0) {
        let id = UniqueId::from_bytes(&[0; 128]).unwrap();
        errors.push(Communicator::for_rank(&id, 0, 1, &device).unwrap_err());
        errors.push(Communicator::for_devices(&[device]).unwrap_err());
    }
    eprintln!("libnccl absent: {}", errors[0]);
    for err in errors {
        assert!(matches!(err, CudaLibError::NoNccl { .. }), "{err}");
        let text = err.to_string();
        for needle in ["libnccl", "NCCL 2.x", "LD_LIBRARY_PATH"] {
            assert!(text.contains(needle), "`{needle}` missing from: {text}");
        }
    }
}

#[test]
fn a_group_closure_error_is_returned_and_the_group_still_ends() {
    if !nccl_present() {
        return; // covered by the test above: group refuses before running the closure
    }
    let err = group::<()>(|| {
        Err(CudaLibError::CollectiveArgument {
            op: "test",
            reason: "closure failed".into(),
        })
    })
    .unwrap_err();
    assert!(err.to_string().contains("closure failed"), "{err}");
    // The group ended: a new one starts and ends cleanly.
    assert_eq!(group(|| Ok(5)).unwrap(), 5);
}

// ---------------------------------------------------------------------------------------------
// GPU helpers.

static ONE_TEST_AT_A_TIME: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    ONE_TEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The first GPU, with the lock; fails with the reason otherwise.
fn gpu() -> (MutexGuard<'static, ()>, CudaDevice) {
    let guard = lock();
    let device = CudaDevice::get(0)
        .unwrap_or_else(|e| panic!("this test needs CUDA device 0, and getting it failed: {e}"));
    assert!(
        nccl_present(),
        "this test needs libnccl: {}",
        nccl_version().unwrap_err()
    );
    (guard, device)
}

/// The first two GPUs, or `None` (after printing a skip) on a machine with one.
fn two_gpus(test: &str) -> Option<(MutexGuard<'static, ()>, CudaDevice, CudaDevice)> {
    let (guard, first) = gpu();
    match CudaDevice::get(1) {
        Ok(second) => Some((guard, first, second)),
        Err(_) => {
            eprintln!("skipped: {test} needs two CUDA devices; this machine has one");
            None
        }
    }
}

fn upload(device: &CudaDevice, values: &[f32], stream: &Stream) -> DeviceBuffer {
    let mut buffer = device.alloc(values.len() * 4, stream).unwrap();
    buffer
        .copy_from_host(bytemuck::cast_slice(values), stream)
        .unwrap();
    buffer
}

fn download(buffer: &DeviceBuffer, stream: &Stream) -> Vec<f32> {
    let mut bytes = vec![0u8; buffer.len()];
    buffer.copy_to_host(&mut bytes, stream).unwrap();
    bytemuck::cast_slice(&bytes).to_vec()
}

/// Counts the values that differ from `expected`, for a short failure message.
fn wrong(values: &[f32], expected: impl Fn(usize) -> f32) -> usize {
    values
        .iter()
        .enumerate()
        .filter(|&(i, &v)| v != expected(i))
        .count()
}

/// Every thread spins for `cycles` clock ticks, then writes `value`: a producer slow enough
/// that a collective not ordered after it reads what was there before.
static SPIN: KernelModule = KernelModule {
    name: "nccl_test_spin",
    source: r#"
extern "C" __global__ void spin_then_fill(float *out, float value, unsigned int n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
"#,
};

/// About 50 ms per wave of blocks at the H200's ~2 GHz.
const SPIN_CYCLES: i64 = 100_000_000;

// ---------------------------------------------------------------------------------------------
// One GPU: a communicator of one rank.

#[test]
#[ignore = "needs a CUDA device"]
fn the_version_is_two_point_something_on_a_gpu_machine() {
    let (_lock, _device) = gpu();
    let (major, minor, _) = nccl_version().unwrap();
    assert!(major >= 2, "NCCL {major}.{minor}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn one_rank_collectives_keep_or_copy_the_values() {
    let (_lock, device) = gpu();
    let stream = device.default_stream();
    let values: Vec<f32> = (0..4096).map(|i| i as f32 * 0.5 - 7.0).collect();
    for comm in [
        Communicator::for_devices(std::slice::from_ref(&device))
            .unwrap()
            .pop()
            .unwrap(),
        Communicator::for_rank(&UniqueId::new().unwrap(), 0, 1, &device).unwrap(),
    ] {
        assert_eq!((comm.rank(), comm.world_size()), (0, 1));
        assert_eq!(comm.device().device(), Device::Cuda(0));
        let mut buf = upload(&device, &values, stream);
        for op in ReduceOp::ALL {
            comm.all_reduce(&mut buf, DType::F32, op, stream).unwrap();
            assert_eq!(download(&buf, stream), values, "all_reduce {op}");
        }
        comm.broadcast(&mut buf, DType::F32, 0, stream).unwrap();
        assert_eq!(download(&buf, stream), values, "broadcast");
        let mut recv = device.alloc_zeroed(buf.len(), stream).unwrap();
        comm.all_gather(&buf, &mut recv, DType::F32, stream)
            .unwrap();
        assert_eq!(download(&recv, stream), values, "all_gather");
        // Other dtypes reach NCCL with their own type (a wrong one would fail or garble).
        for dtype in DType::ALL {
            let mut bytes_buf = device.alloc(64 * 8, stream).unwrap();
            let bytes: Vec<u8> = (0..64 * 8).map(|i| (i % 7) as u8).collect();
            bytes_buf.copy_from_host(&bytes, stream).unwrap();
            comm.all_reduce(&mut bytes_buf, dtype, ReduceOp::Max, stream)
                .unwrap_or_else(|e| panic!("all_reduce of {dtype}: {e}"));
            let mut back = vec![0u8; bytes.len()];
            bytes_buf.copy_to_host(&mut back, stream).unwrap();
            assert_eq!(back, bytes, "{dtype}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn one_rank_argument_errors_are_found_before_anything_is_queued() {
    let (_lock, device) = gpu();
    let stream = device.default_stream();
    let mut comms = Communicator::for_devices(std::slice::from_ref(&device)).unwrap();
    let comm = comms.pop().unwrap();
    let mut odd = device.alloc(10, stream).unwrap();
    let err = comm
        .all_reduce(&mut odd, DType::F32, ReduceOp::Sum, stream)
        .unwrap_err();
    assert!(
        matches!(err, CudaLibError::CollectiveArgument { .. })
            && err.to_string().contains("10 bytes"),
        "{err}"
    );
    let mut buf = device.alloc(1024, stream).unwrap();
    let err = comm
        .all_reduce_region(&mut buf, 2, 8, DType::F32, ReduceOp::Sum, stream)
        .unwrap_err();
    assert!(err.to_string().contains("offset 2"), "{err}");
    let err = comm
        .all_reduce_region(&mut buf, 1000, 48, DType::F32, ReduceOp::Sum, stream)
        .unwrap_err();
    assert!(
        matches!(err, CudaLibError::Memory(MemoryError::OutOfBounds { .. })),
        "{err}"
    );
    let err = comm.broadcast(&mut buf, DType::F32, 1, stream).unwrap_err();
    assert!(err.to_string().contains("root 1"), "{err}");
    let mut small = device.alloc(512, stream).unwrap();
    let err = comm
        .all_gather(&buf, &mut small, DType::F32, stream)
        .unwrap_err();
    assert!(err.to_string().contains("world_size * send.len()"), "{err}");
    for devices in [vec![], vec![device.clone(), device.clone()]] {
        let err = Communicator::for_devices(&devices).unwrap_err();
        assert!(
            matches!(err, CudaLibError::CollectiveArgument { .. }),
            "{err}"
        );
    }
    let id = UniqueId::new().unwrap();
    let err = Communicator::for_rank(&id, 1, 1, &device).unwrap_err();
    assert!(err.to_string().contains("rank 1"), "{err}");
    // The communicator still works after refusing.
    comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, stream)
        .unwrap();
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_region_reduce_on_one_rank_leaves_the_whole_buffer_as_it_was() {
    let (_lock, device) = gpu();
    let stream = device.default_stream();
    let comm = Communicator::for_devices(std::slice::from_ref(&device))
        .unwrap()
        .pop()
        .unwrap();
    let values: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let mut buf = upload(&device, &values, stream);
    comm.all_reduce_region(&mut buf, 400, 800, DType::F32, ReduceOp::Avg, stream)
        .unwrap();
    assert_eq!(download(&buf, stream), values);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_collective_on_another_stream_is_ordered_after_producers_and_before_later_reads() {
    let (_lock, device) = gpu();
    let comm = Communicator::for_devices(std::slice::from_ref(&device))
        .unwrap()
        .pop()
        .unwrap();
    let spin = device.function(&SPIN, "spin_then_fill").unwrap();
    let (home, other) = (device.new_stream().unwrap(), device.new_stream().unwrap());
    // NCCL sets a communicator up on its first collectives (it may synchronize then): do that
    // before the slow producer starts, so the queue-while-spinning check below stays valid.
    let mut warm = device.alloc_zeroed(4096, &other).unwrap();
    let mut warm_all = device.alloc_zeroed(4096, &other).unwrap();
    comm.all_reduce(&mut warm, DType::F32, ReduceOp::Sum, &other)
        .unwrap();
    comm.all_gather(&warm, &mut warm_all, DType::F32, &other)
        .unwrap();
    other.synchronize().unwrap();
    let n = 1 << 20;
    // Both buffers live on `home`; a slow kernel there writes the source.
    let mut send = device.alloc_zeroed(n * 4, &home).unwrap();
    let mut recv = device.alloc_zeroed(n * 4, &home).unwrap();
    device
        .launch(&spin, (blocks_for(n, 256), 1, 1), (256, 1, 1), 0, &home)
        .arg_buffer_mut(&mut send)
        .arg_f32(7.5)
        .arg_u32(n as u32)
        .arg_i64(SPIN_CYCLES)
        .run()
        .unwrap();
    // Queued on `other` while `home` still spins: it must wait for the fill.
    comm.all_gather(&send, &mut recv, DType::F32, &other)
        .unwrap();
    comm.all_reduce(&mut send, DType::F32, ReduceOp::Sum, &other)
        .unwrap();
    assert!(
        !home.record().unwrap().query().unwrap(),
        "the producer finished before the collectives were queued: raise SPIN_CYCLES"
    );
    // A copy on `home` reads `recv`: it must wait for the gather still queued on `other`.
    let mut out = device.alloc_zeroed(n * 4, &home).unwrap();
    out.copy_from_device(&recv, &home).unwrap();
    let got = download(&out, &home);
    let bad = wrong(&got, |_| 7.5);
    assert_eq!(
        bad, 0,
        "{bad} values wrong: the gather ran before the producer, or the read before the gather"
    );
    assert_eq!(wrong(&download(&send, &home), |_| 7.5), 0);
}

// ---------------------------------------------------------------------------------------------
// Two GPUs.

/// Rank r's buffer of `n` floats, all r + 1, on its default stream.
fn rank_buffers(devices: &[CudaDevice], n: usize) -> Vec<DeviceBuffer> {
    devices
        .iter()
        .enumerate()
        .map(|(r, d)| upload(d, &vec![(r + 1) as f32; n], d.default_stream()))
        .collect()
}

#[test]
#[ignore = "needs two CUDA devices"]
fn two_gpus_one_thread_reduce_inside_a_group() {
    let Some((_lock, first, second)) = two_gpus("a grouped all_reduce") else {
        return;
    };
    let devices = [first, second];
    let comms = Communicator::for_devices(&devices).unwrap();
    assert_eq!(comms.len(), 2);
    for (r, comm) in comms.iter().enumerate() {
        assert_eq!((comm.rank(), comm.world_size()), (r, 2));
        assert_eq!(comm.device().ordinal(), r);
    }
    let n = 1 << 20;
    let mut bufs = rank_buffers(&devices, n);
    group(|| {
        for (comm, buf) in comms.iter().zip(bufs.iter_mut()) {
            comm.all_reduce(
                buf,
                DType::F32,
                ReduceOp::Sum,
                comm.device().default_stream(),
            )?;
        }
        Ok(())
    })
    .unwrap();
    for (r, buf) in bufs.iter().enumerate() {
        let got = download(buf, devices[r].default_stream());
        assert_eq!(wrong(&got, |_| 3.0), 0, "rank {r}: {:?}", &got[..4]);
    }

    // Avg over a region only: inside it (1 + 2) / 2, outside each rank's own value.
    let mut bufs = rank_buffers(&devices, 1000);
    let (offset, bytes) = (400, 800); // elements 100..300
    group(|| {
        for (comm, buf) in comms.iter().zip(bufs.iter_mut()) {
            comm.all_reduce_region(
                buf,
                offset,
                bytes,
                DType::F32,
                ReduceOp::Avg,
                comm.device().default_stream(),
            )?;
        }
        Ok(())
    })
    .unwrap();
    for (r, buf) in bufs.iter().enumerate() {
        let got = download(buf, devices[r].default_stream());
        let own = (r + 1) as f32;
        let bad = wrong(&got, |i| if (100..300).contains(&i) { 1.5 } else { own });
        assert_eq!(
            bad, 0,
            "rank {r}: the region reduce touched the wrong elements"
        );
    }

    // A buffer or stream on the other GPU is refused before anything is queued.
    let mut foreign = devices[1].alloc(1024, devices[1].default_stream()).unwrap();
    let err = comms[0]
        .all_reduce(
            &mut foreign,
            DType::F32,
            ReduceOp::Sum,
            devices[0].default_stream(),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            CudaLibError::Memory(MemoryError::DeviceMismatch {
                expected: Device::Cuda(0),
                actual: Device::Cuda(1),
                ..
            })
        ),
        "{err}"
    );
    let mut local = devices[0].alloc(1024, devices[0].default_stream()).unwrap();
    let err = comms[0]
        .broadcast(&mut local, DType::F32, 0, devices[1].default_stream())
        .unwrap_err();
    assert!(
        matches!(
            err,
            CudaLibError::Memory(MemoryError::DeviceMismatch { .. })
        ),
        "{err}"
    );
}

#[test]
#[ignore = "needs two CUDA devices"]
fn two_gpus_one_thread_per_rank_broadcast_and_gather_without_a_group() {
    let Some((_lock, first, second)) = two_gpus("thread-per-rank collectives") else {
        return;
    };
    let devices = [first, second];
    let mut comms = Communicator::for_devices(&devices).unwrap();
    let n = 1 << 16;
    let mut bufs = rank_buffers(&devices, n);
    let mut gathered: Vec<DeviceBuffer> = devices
        .iter()
        .map(|d| d.alloc_zeroed(2 * n * 4, d.default_stream()).unwrap())
        .collect();
    // all_gather first (each rank sends its own r + 1), then broadcast rank 1's values.
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .iter_mut()
            .zip(bufs.iter_mut().zip(gathered.iter_mut()))
            .map(|(comm, (buf, recv))| {
                scope.spawn(move || -> Result<(), CudaLibError> {
                    let stream = comm.device().default_stream().clone();
                    comm.all_gather(buf, recv, DType::F32, &stream)?;
                    comm.broadcast(buf, DType::F32, 1, &stream)?;
                    Ok(stream.synchronize()?)
                })
            })
            .collect();
        for handle in handles {
            handle.join().unwrap().unwrap();
        }
    });
    for (r, device) in devices.iter().enumerate() {
        let stream = device.default_stream();
        let got = download(&gathered[r], stream);
        let bad = wrong(&got, |i| if i < n { 1.0 } else { 2.0 });
        assert_eq!(bad, 0, "rank {r}: all_gather placed {bad} values wrong");
        let got = download(&bufs[r], stream);
        assert_eq!(wrong(&got, |_| 2.0), 0, "rank {r}: broadcast from rank 1");
    }
}

#[test]
#[ignore = "needs two CUDA devices"]
fn two_gpus_for_rank_with_one_unique_id_from_two_threads() {
    let Some((_lock, first, second)) = two_gpus("for_rank") else {
        return;
    };
    // The id travels as bytes, as it would between processes.
    let id_bytes = UniqueId::new().unwrap().to_bytes();
    let devices = [first, second];
    let n = 1 << 18;
    let results: Vec<Vec<f32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(rank, device)| {
                scope.spawn(move || {
                    let id = UniqueId::from_bytes(&id_bytes).unwrap();
                    let comm = Communicator::for_rank(&id, rank, 2, device).unwrap();
                    assert_eq!((comm.rank(), comm.world_size()), (rank, 2));
                    let stream = device.new_stream().unwrap();
                    let mut buf = upload(device, &vec![(rank + 1) as f32; n], &stream);
                    comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, &stream)
                        .unwrap();
                    download(&buf, &stream)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, got) in results.iter().enumerate() {
        assert_eq!(wrong(got, |_| 3.0), 0, "rank {rank}");
    }
}
