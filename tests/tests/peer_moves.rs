//! Moves between two GPUs (cuda:0 <-> cuda:1): values, dtype conversion, the gradient going
//! home, ordering after the source's producers without the host waiting, chunked and
//! asynchronous forms; plus what one GPU can check (a move to its own device is an alias with
//! a node, a missing device is an error naming what is there).
//!
//! The two-GPU tests are ignored without a GPU and, run with `--ignored` on a one-GPU machine,
//! say so on stderr and return: they need `nvidia-h200-x2` or any host with two GPUs.

use ferry::memory::cuda::{self, CudaDevice};
use ferry::{ChunkPlan, ChunkSpec, DeviceMove, MoveOptions, TransferPath};
use std::sync::Mutex;

use ferry_tensor::{DType, Device, Result, Tensor};

const G0: Device = Device::Cuda(0);
const G1: Device = Device::Cuda(1);

/// The CUDA tests read allocator statistics and time the host against the device: one at a
/// time within this binary.
static GPU: Mutex<()> = Mutex::new(());

fn run(body: impl FnOnce() -> Result<()>) {
    // A failed test must not fail the others: a poisoned lock still serialises.
    let _one_at_a_time = GPU.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    ferry_tests::fresh_seed();
    if let Err(e) = body() {
        panic!("(replay with FERRY_SEED={}): {e}", ferry_tests::seed());
    }
}

/// Runs `body` when there are two GPUs; otherwise says why it did not.
fn on_two_gpus(body: impl FnOnce() -> Result<()>) {
    match cuda::devices() {
        Ok(found) if found.len() >= 2 => run(body),
        Ok(found) => eprintln!(
            "skipped: needs two CUDA devices, found {} (run on nvidia-h200-x2)",
            found.len()
        ),
        Err(err) => eprintln!("skipped: needs two CUDA devices: {err}"),
    }
}

/// The raw bits of every element, so comparisons are bit-exact.
fn bits(t: &Tensor) -> Result<Vec<u64>> {
    Ok(t.to_vec_f64()?.iter().map(|v| v.to_bits()).collect())
}

// ---- What runs anywhere ----

#[test]
fn a_move_to_a_gpu_that_is_not_there_is_an_error_not_a_panic() {
    // Without a driver this says so; with fewer than eight GPUs it names how many there are.
    let x = Tensor::ones(&[4], DType::F32, Device::Cpu).unwrap();
    let err = x.to(Device::Cuda(7)).unwrap_err().to_string();
    assert!(
        err.contains("no CUDA driver") || err.contains("cuda:7 is not available"),
        "{err}"
    );
}

#[test]
fn a_peer_path_says_whether_it_was_direct_and_in_how_many_copies() {
    // What the method table and the bench print for a report's path.
    let direct = TransferPath::Peer {
        direct: true,
        chunks: 1,
    };
    let staged = TransferPath::Peer {
        direct: false,
        chunks: 4,
    };
    assert_ne!(direct, staged);
    assert_eq!(format!("{staged:?}"), "Peer { direct: false, chunks: 4 }");
}

// ---- One GPU ----

#[test]
#[ignore = "needs a CUDA device"]
fn a_move_to_its_own_gpu_is_the_identity_and_a_missing_gpu_names_those_present() {
    run(|| {
        let found = cuda::devices()?.len();
        let x = Tensor::randn(&[64, 33], DType::F32, G0)?.with_grad()?;
        let (y, report) = x.to_with(G0, MoveOptions::default())?;
        assert_eq!(report.path, TransferPath::SameDevice);
        assert_eq!(report.bytes_moved, 0);
        assert!(y.shares_storage(&x), "a move to its own device copied");
        assert_eq!(
            y.node().expect("a node, as for any move").meta().op,
            "to_device"
        );
        assert_eq!(bits(&y)?, bits(&x)?);
        let (y, report) = x.to_chunked(G0, ChunkSpec::Count(4))?;
        assert_eq!(report.path, TransferPath::SameDevice);
        assert!(y.shares_storage(&x));

        let missing = Device::Cuda(found + 6);
        let err = x.to(missing).unwrap_err().to_string();
        assert!(err.contains(&missing.to_string()), "{err}");
        assert!(
            err.contains(&format!("{found} CUDA device(s) found")),
            "the error does not say which devices are present: {err}"
        );
        let err = x
            .to_chunked(missing, ChunkSpec::Count(2))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("{found} CUDA device(s) found")),
            "{err}"
        );
        Ok(())
    });
}

// ---- Two GPUs ----

#[test]
#[ignore = "needs a CUDA device"]
fn peer_moves_keep_every_bit_both_ways() {
    on_two_gpus(|| {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64] {
            let x = Tensor::randn(&[1000, 333], DType::F32, G0)?
                .mul_scalar(100.0)?
                .to_dtype(dtype)?;
            let expected = bits(&x)?;
            let (y, report) = x.to_with(G1, MoveOptions::default())?;
            assert_eq!(y.device(), G1);
            assert_eq!(y.dtype(), dtype);
            assert!(
                matches!(report.path, TransferPath::Peer { chunks: 1, .. }),
                "{report}"
            );
            assert_eq!(report.bytes_moved, x.nbytes());
            assert_eq!(bits(&y)?, expected, "{dtype} cuda:0 -> cuda:1");
            let back = y.to(G0)?;
            assert_eq!(back.device(), G0);
            assert_eq!(bits(&back)?, expected, "{dtype} cuda:1 -> cuda:0");
        }
        // A non-contiguous source (a transpose) and a view with an offset.
        let x = Tensor::randn(&[300, 200], DType::F32, G0)?;
        let t = x.t()?;
        assert_eq!(bits(&t.to(G1)?)?, bits(&t)?);
        let view = x.narrow(0, 17, 100)?;
        assert_eq!(bits(&view.to(G1)?)?, bits(&view)?);
        // Empty and zero-dimensional tensors.
        let empty = Tensor::zeros(&[0, 5], DType::F32, G0)?;
        assert_eq!(empty.to(G1)?.shape(), &[0, 5]);
        let scalar = Tensor::full(&[], 2.5, DType::F32, G0)?;
        assert_eq!(scalar.to(G1)?.to_vec::<f32>()?, vec![2.5]);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_peer_move_converts_dtypes_on_the_way() {
    on_two_gpus(|| {
        let x = Tensor::randn(&[512, 256], DType::F32, G0)?;
        // Down: cast on cuda:0, then half the bytes cross.
        let (h, report) = x.to_with(G1, MoveOptions::dtype(DType::F16))?;
        assert_eq!((h.device(), h.dtype()), (G1, DType::F16));
        assert_eq!(report.bytes_moved, x.nbytes() / 2);
        assert_eq!(bits(&h)?, bits(&x.to_dtype(DType::F16)?)?);
        // Up: the f16 bytes cross, then the cast runs on cuda:0.
        let (f, report) = h.to_with(G0, MoveOptions::dtype(DType::F32))?;
        assert_eq!((f.device(), f.dtype()), (G0, DType::F32));
        assert_eq!(report.bytes_moved, h.nbytes());
        assert_eq!(bits(&f)?, bits(&h.to_dtype(DType::F32)?)?);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_gradient_of_a_peer_move_goes_home() {
    on_two_gpus(|| {
        let x = Tensor::randn(&[64, 48], DType::F32, G0)?.with_grad()?;
        let h = x.relu()?;
        let (y, report) = h.to_with(G1, MoveOptions::default())?;
        assert_eq!(report.nodes_recorded, 1);
        assert_eq!(report.grad_bytes_copied, 0);
        y.sum()?.backward()?;
        let grad = x.grad().expect("x has a gradient");
        assert_eq!(grad.device(), G0, "the gradient stayed on cuda:1");
        // d sum(relu(x)) / dx = 1 where x > 0, else 0.
        let expected: Vec<f32> = x
            .to_vec::<f32>()?
            .iter()
            .map(|&v| if v > 0.0 { 1.0 } else { 0.0 })
            .collect();
        assert_eq!(grad.to_vec::<f32>()?, expected);

        // A leaf moved straight across: the gradient is all ones, on cuda:0, in its dtype.
        let w = Tensor::randn(&[100], DType::F32, G0)?.with_grad()?;
        let (moved, _) = w.to_with(G1, MoveOptions::dtype(DType::F16))?;
        moved.to_dtype(DType::F32)?.sum()?.backward()?;
        let grad = w.grad().expect("w has a gradient");
        assert_eq!((grad.device(), grad.dtype()), (G0, DType::F32));
        assert_eq!(grad.to_vec::<f32>()?, vec![1.0; 100]);

        // detach() first records nothing.
        let (_, report) = x.detach().to_with(G1, MoveOptions::default())?;
        assert_eq!(report.nodes_recorded, 0);
        // The moved leaf's copy starts with no gradient of its own.
        assert!(x.to(G1)?.grad().is_none());
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_peer_move_follows_its_producers_without_the_host_waiting() {
    on_two_gpus(|| {
        let dev0 = CudaDevice::get(0)?;
        // Scaled so that products keep their magnitude: 16 chained 8192^3 GEMMs, tens of ms.
        let a = Tensor::randn(&[8192, 8192], DType::F32, G0)?.mul_scalar(1.0 / 90.5)?;
        a.matmul(&a)?; // loads the GEMM library outside the measured part
        let _ = Tensor::zeros(&[1], DType::F32, G0)?.to(G1)?; // enables peer access
        dev0.synchronize()?;
        // A long chain of producers on cuda:0, then the move queued right behind it.
        let mut b = a.clone();
        for _ in 0..16 {
            b = b.matmul(&a)?;
        }
        let producers_done = dev0.default_stream().record()?;
        let y = b.to(G1)?;
        assert!(
            !producers_done.is_complete(),
            "the host waited for cuda:0's producers: .to(cuda:1) synchronized"
        );
        assert_eq!(bits(&y)?, bits(&b)?, "the move read before its producer");
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_peer_source_is_neither_reused_nor_rewritten_before_the_copy_read_it() {
    on_two_gpus(|| {
        let dev0 = CudaDevice::get(0)?;
        // Work on cuda:1 that the copy (queued on cuda:1's default stream) waits behind, while
        // cuda:0 is idle: an unordered reuse or write of the source on cuda:0 would run first.
        let a = Tensor::randn(&[8192, 8192], DType::F32, G1)?.mul_scalar(1.0 / 90.5)?;
        a.matmul(&a)?;
        let busy = || -> Result<Tensor> {
            let mut b = a.clone();
            for _ in 0..8 {
                b = b.matmul(&a)?;
            }
            Ok(b)
        };
        let x = Tensor::randn(&[2048, 2048], DType::F32, G0)?;
        let expected = bits(&x)?;
        for round in 0..3 {
            let _busy = busy()?;
            let src = x.mul_scalar(1.0)?; // exact: the same bits, in a buffer of its own
            let before = dev0.memory_stats().allocated_bytes;
            let (y, report) = src.into_device(G1)?;
            assert!(
                dev0.memory_stats().allocated_bytes < before,
                "round {round}: into_device kept the source's block: {report}"
            );
            // Same size: the freed block is the allocator's first choice once it may be reused.
            let overwrite = Tensor::full(x.shape(), 7.0, DType::F32, G0)?;
            assert_eq!(
                bits(&y)?,
                expected,
                "round {round}: source reused before the copy"
            );
            drop(overwrite);
        }
        // An in-place write of the source issued right after the move waits for the copy.
        let src = x.mul_scalar(1.0)?;
        let _busy = busy()?;
        let y = src.to(G1)?;
        src.assign(&Tensor::zeros(src.shape(), DType::F32, G0)?)?;
        assert_eq!(
            bits(&y)?,
            expected,
            "the copy saw an assign issued after it"
        );
        assert!(
            src.to_vec::<f32>()?.iter().all(|&v| v == 0.0),
            "the assign ran"
        );
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_chunked_peer_move_matches_to_within_its_bound() {
    on_two_gpus(|| {
        let x = Tensor::randn(&[1000, 777], DType::F32, G0)?;
        let bound = 256 << 10;
        for (what, src) in [("contiguous", x.clone()), ("transposed", x.t()?)] {
            let expected = bits(&src.to(G1)?)?;
            let plan = ChunkPlan::new(src.shape(), src.dtype(), ChunkSpec::MaxStagingBytes(bound))?;
            let (y, report) = src.to_chunked(G1, ChunkSpec::MaxStagingBytes(bound))?;
            assert_eq!(y.device(), G1);
            assert_eq!(bits(&y)?, expected, "{what}");
            match report.path {
                TransferPath::Peer { chunks, .. } => assert_eq!(chunks, plan.len(), "{what}"),
                other => panic!("{what}: path {other:?}"),
            }
            assert!(plan.len() > 4, "{what}: only {} pieces", plan.len());
            // Scratch on both devices, each within the bound.
            assert!(report.staging_peak_bytes > 0, "{what}: {report}");
            assert!(report.staging_peak_bytes <= 2 * bound, "{what}: {report}");
            let back = y.to_chunked(G0, ChunkSpec::Count(3))?.0;
            assert_eq!(bits(&back)?, expected, "{what} back");
        }
        // The gradient path: one node for the whole move.
        let w = x.with_grad()?;
        let (y, report) = w.to_chunked(G1, ChunkSpec::Count(5))?;
        assert_eq!(report.nodes_recorded, 1);
        y.sum()?.backward()?;
        let grad = w.grad().expect("w has a gradient");
        assert_eq!(grad.device(), G0);
        assert!(grad.to_vec::<f32>()?.iter().all(|&g| g == 1.0));
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_async_peer_move_runs_on_a_stream_of_either_gpu() {
    on_two_gpus(|| {
        let x = Tensor::randn(&[2048, 1024], DType::F32, G0)?.with_grad()?;
        let expected = bits(&x)?;
        for on in [1, 0] {
            let stream = CudaDevice::get(on)?.new_stream()?;
            let pending = x.to_async(G1, &stream)?;
            assert_eq!(pending.device(), G1);
            let (y, report) = pending.wait()?;
            assert_eq!(y.device(), G1);
            assert!(
                matches!(report.path, TransferPath::Peer { chunks: 1, .. }),
                "{report}"
            );
            assert_eq!(report.nodes_recorded, 1, "stream of cuda:{on}");
            assert_eq!(bits(&y)?, expected, "stream of cuda:{on}");
            // Used on cuda:1's default stream right away: ordered after the copy.
            assert_eq!(bits(&y.mul_scalar(2.0)?.mul_scalar(0.5)?)?, expected);
        }
        // Back home on a stream of cuda:1.
        let y = x.detach().to(G1)?;
        let stream = CudaDevice::get(1)?.new_stream()?;
        let (back, report) = y.to_async(G0, &stream)?.wait()?;
        assert_eq!(report.nodes_recorded, 0);
        assert_eq!(bits(&back)?, expected);
        // A stream of a third device, where there is one, is refused with the fix.
        if let Ok(dev2) = CudaDevice::get(2) {
            let err = x.to_async(G1, &dev2.new_stream()?).unwrap_err().to_string();
            assert!(err.contains("pass a stream of cuda:1"), "{err}");
        }
        Ok(())
    });
}
