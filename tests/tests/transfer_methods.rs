use ferry::memory::cuda::CudaDevice;
use ferry::{
    ChunkPlan, ChunkSpec, DeviceMove, MoveOptions, TensorError, TransferPath, move_state_dict,
};
use ferry_tensor::{DType, Device, Result, Tensor, no_grad};
use ferry_tests::{randn, values};
use proptest::prelude::*;

const GPU: Device = Device::Cuda(0);

fn run(body: impl FnOnce() -> Result<()>) {
    ferry_tests::fresh_seed();
    if let Err(e) = body() {
        panic!("(replay with FERRY_SEED={}): {e}", ferry_tests::seed());
    }
}

/// The raw bits of every element, so comparisons are bit-exact (NaN included).
fn bits(t: &Tensor) -> Vec<u64> {
    match t.dtype() {
        DType::F64 => t
            .to_vec::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        _ => t
            .to_vec_f64()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
    }
}

// ---- The chunk plan: pure arithmetic, checked here. ----

proptest! {
    #[test]
    fn chunk_counts_cover_every_row_once_and_evenly(
        rows in 0usize..300, cols in 1usize..9, n in 1usize..40,
    ) {
        let plan = ChunkPlan::new(&[rows, cols], DType::F32, ChunkSpec::Count(n)).unwrap();
        // Staging stays within 1/n of the tensor, or one row's block when that is more.
        let fraction = (rows * cols * 4).div_ceil(n).max(ChunkPlan::min_staging_bytes(&[rows, cols], DType::F32));
        prop_assert!(plan.staging_bytes() <= fraction, "{} > {}", plan.staging_bytes(), fraction);
        let mut next = 0;
        for piece in plan.pieces() {
            prop_assert_eq!(piece.start, next);
            prop_assert!(!piece.is_empty());
            next = piece.end;
        }
        prop_assert_eq!(next, rows);
        let lens: Vec<usize> = plan.pieces().iter().map(|p| p.len()).collect();
        if let (Some(max), Some(min)) = (lens.iter().max(), lens.iter().min()) {
            prop_assert!(max - min <= 1, "uneven pieces {:?}", lens);
            prop_assert_eq!(plan.piece_bytes(), max * cols * 4);
        }
        prop_assert!(plan.staging_buffers() <= plan.len().min(2));
    }

    #[test]
    fn a_staging_bound_is_kept_or_refused_with_the_minimum(
        rows in 1usize..5000, cols in 1usize..3000, bound in 0usize..(64 << 20),
        dtype in prop::sample::select(DType::ALL.to_vec()),
    ) {
        let shape = [rows, cols];
        let minimum = ChunkPlan::min_staging_bytes(&shape, dtype);
        match ChunkPlan::new(&shape, dtype, ChunkSpec::MaxStagingBytes(bound)) {
            Err(e) => {
                prop_assert!(bound < minimum);
                prop_assert!(e.to_string().contains(&minimum.to_string()), "{}", e);
            }
            Ok(plan) => {
                prop_assert!(bound >= minimum);
                prop_assert!(plan.staging_bytes() <= bound,
                    "{} staging bytes over the bound {}", plan.staging_bytes(), bound);
                let covered: usize = plan.pieces().iter().map(|p| p.len()).sum();
                prop_assert_eq!(covered, rows);
                prop_assert_eq!(plan.byte_range(plan.len() - 1).end, rows * cols * dtype.size());
                // Overlap whenever two buffers of one row fit.
                if rows >= 2 && 2 * minimum <= bound {
                    prop_assert_eq!(plan.staging_buffers(), 2);
                }
            }
        }
    }
}

#[test]
fn zero_dimensional_and_empty_tensors_plan_sensibly() {
    let scalar = ChunkPlan::new(&[], DType::F64, ChunkSpec::Count(8)).unwrap();
    assert_eq!(scalar.len(), 1);
    assert_eq!(scalar.pieces()[0], 0..1);
    assert_eq!(scalar.byte_range(0), 0..8);
    let empty = ChunkPlan::new(&[0, 5], DType::F32, ChunkSpec::MaxStagingBytes(1)).unwrap();
    assert!(empty.is_empty() && empty.staging_bytes() == 0);
}

#[test]
fn bad_chunk_specs_are_errors_that_name_the_fix() {
    run(|| {
        let x = Tensor::randn(&[10, 4096], DType::F32, Device::Cpu)?;
        let zero = x.to_chunked(Device::Cpu, ChunkSpec::Count(0)).unwrap_err();
        assert!(matches!(
            zero,
            TensorError::InvalidArgument {
                op: "to_chunked",
                ..
            }
        ));
        assert!(zero.to_string().contains("at least 1"), "{zero}");
        let small = x
            .to_chunked(Device::Cpu, ChunkSpec::MaxStagingBytes(1000))
            .unwrap_err();
        // One row is 16 KiB: its staging block is the minimum.
        assert!(
            small.to_string().contains("MaxStagingBytes(16384)"),
            "{small}"
        );
        Ok(())
    })
}

// ---- Moves on the host still go through the API: same reports, same graph rules. ----

#[test]
fn reports_on_the_host_are_honest() {
    run(|| {
        let x = randn(Device::Cpu, &[6, 5])?.with_grad()?;
        let (y, report) = x.to_with(Device::Cpu, MoveOptions::default())?;
        assert_eq!(report.path, TransferPath::SameDevice);
        assert_eq!((report.bytes_moved, report.staging_peak_bytes), (0, 0));
        assert_eq!((report.nodes_recorded, report.grad_bytes_copied), (1, 0));
        assert!(y.requires_grad() && y.shares_storage(&x));
        let (_, report) = x.detach().to_with(Device::Cpu, MoveOptions::default())?;
        assert_eq!(report.nodes_recorded, 0);
        let (cast, report) = x.to_with(Device::Cpu, MoveOptions::dtype(DType::F32))?;
        assert_eq!((cast.dtype(), report.nodes_recorded), (DType::F32, 1));
        let _guard = no_grad();
        let (z, report) = x.to_with(Device::Cpu, MoveOptions::default())?;
        assert!(!z.requires_grad() && z.node().is_none());
        assert_eq!(report.nodes_recorded, 0);
        Ok(())
    })
}

#[test]
fn a_chunked_move_on_one_device_is_the_identity_and_keeps_the_gradient() {
    run(|| {
        let x = randn(Device::Cpu, &[7, 3])?.with_grad()?;
        let c = randn(Device::Cpu, &[7, 3])?;
        let (y, report) = x.t()?.to_chunked(Device::Cpu, ChunkSpec::Count(3))?;
        assert_eq!(y.shape(), &[3, 7]);
        assert_eq!(bits(&y), bits(&x.t()?));
        assert_eq!(report.path, TransferPath::SameDevice);
        assert_eq!((report.nodes_recorded, report.grad_bytes_copied), (1, 0));
        assert_eq!(y.node().unwrap().meta().op, "to_chunked");
        y.t()?.mul(&c)?.sum()?.backward()?; // d/dx Σ x·c = c
        assert_eq!(values(&x.grad().unwrap()), values(&c));
        Ok(())
    })
}

#[test]
fn copies_never_carry_gradients_on_the_host() {
    run(|| {
        let w = randn(Device::Cpu, &[5])?.with_grad()?;
        w.mul(&w)?.sum()?.backward()?;
        assert!(w.grad().is_some());
        for (moved, report) in [
            w.to_with(Device::Cpu, MoveOptions::default())?,
            w.to_chunked(Device::Cpu, ChunkSpec::Count(2))?,
            w.clone().into_device(Device::Cpu)?,
        ] {
            assert!(
                moved.grad().is_none(),
                "a moved leaf's copy starts without .grad"
            );
            assert_eq!(report.grad_bytes_copied, 0);
        }
        Ok(())
    })
}

#[test]
fn a_state_dict_already_on_the_target_comes_back_detached_in_order() {
    run(|| {
        let dict = vec![
            ("w".to_string(), randn(Device::Cpu, &[3, 2])?.with_grad()?),
            (
                "b".to_string(),
                randn(Device::Cpu, &[2])?.to_dtype(DType::F16)?,
            ),
        ];
        let (moved, report) = move_state_dict(&dict, Device::Cpu)?;
        assert_eq!(report.path, TransferPath::Batched { tensors: 0 });
        assert_eq!((report.bytes_moved, report.nodes_recorded), (0, 0));
        for ((name, t), (moved_name, m)) in dict.iter().zip(&moved) {
            assert_eq!(name, moved_name);
            assert!(!m.requires_grad());
            assert_eq!(bits(m), bits(t));
        }
        Ok(())
    })
}

// ---- On a GPU. ----

/// Sources of every kind: contiguous, transposed, narrowed (offset), broadcast, 0-d.
fn sources(device: Device, rows: usize, cols: usize) -> Result<Vec<Tensor>> {
    let x = randn(device, &[rows, cols])?;
    Ok(vec![
        x.clone(),
        x.t()?,
        x.narrow(0, rows / 3, rows - rows / 3)?,
        x.narrow(1, 0, cols.div_ceil(2))?,
        randn(device, &[cols])?.broadcast_to(&[rows, cols])?,
        randn(device, &[])?.sum()?,
        x.to_dtype(DType::F16)?.t()?,
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    #[ignore = "needs a CUDA device"]
    fn chunked_moves_are_bit_identical_to_plain_moves(
        rows in 1usize..700, cols in 1usize..300, n in 1usize..9, bound_rows in 1usize..64,
    ) {
        for src in sources(GPU, rows, cols).unwrap() {
            let plain = src.to(Device::Cpu).unwrap();
            let row = src.nbytes() / src.shape().first().copied().unwrap_or(1).max(1);
            let specs = [
                ChunkSpec::Count(n),
                ChunkSpec::MaxStagingBytes(
                    (2 * bound_rows * row).max(ChunkPlan::min_staging_bytes(src.shape(), src.dtype())),
                ),
            ];
            for spec in specs {
                let (down, report) = src.to_chunked(Device::Cpu, spec).unwrap();
                prop_assert_eq!(bits(&down), bits(&plain), "{:?} of {:?}", spec, src);
                let chunked = matches!(report.path, TransferPath::Chunked { .. });
                prop_assert!(chunked, "path {:?}", report.path);
                prop_assert_eq!(report.bytes_moved, src.nbytes());
                let host = src.to(Device::Cpu).unwrap();
                let (up, _) = host.to_chunked(GPU, spec).unwrap();
                prop_assert_eq!(up.device(), GPU);
                prop_assert_eq!(bits(&up), bits(&plain), "upload {:?}", spec);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_chunked_move_records_one_node_and_sends_the_gradient_home() {
    run(|| {
        let x = randn(GPU, &[33, 8])?.with_grad()?;
        let c = randn(Device::Cpu, &[33, 8])?;
        let (y, report) = x.to_chunked(Device::Cpu, ChunkSpec::Count(4))?;
        assert_eq!(report.nodes_recorded, 1);
        let plan = ChunkPlan::new(&[33, 8], DType::F32, ChunkSpec::Count(4))?;
        assert_eq!(report.path, TransferPath::Chunked { chunks: plan.len() });
        y.mul(&c)?.sum()?.backward()?;
        let grad = x.grad().unwrap();
        assert_eq!(grad.device(), GPU);
        assert_eq!(values(&grad), values(&c));
        Ok(())
    })
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_async_move_hands_out_its_tensor_only_from_wait() {
    run(|| {
        let dev = CudaDevice::get(0)?;
        let stream = dev.new_stream()?;
        for src in sources(GPU, 513, 129)? {
            let expected = bits(&src.to(Device::Cpu)?);
            let pending = src.to_async(Device::Cpu, &stream)?;
            assert_eq!(pending.shape(), src.shape());
            drop(src); // the pending move keeps the source alive
            let (host, report) = pending.wait()?;
            assert_eq!(report.path, TransferPath::DeviceToPinned);
            assert_eq!(bits(&host), expected);
        }
        // Upload too, and a move dropped unread is harmless.
        let host = randn(Device::Cpu, &[300, 70])?;
        let (up, _) = host.to_async(GPU, &stream)?.wait()?;
        assert_eq!(bits(&up), bits(&host));
        for _ in 0..8 {
            drop(randn(GPU, &[1024, 256])?.to_async(Device::Cpu, &stream)?);
        }
        let pending = randn(GPU, &[4])?.to_async(Device::Cpu, &stream)?;
        stream.synchronize()?;
        assert!(pending.is_ready());
        Ok(())
    })
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_async_move_keeps_the_gradient_path() {
    run(|| {
        let stream = CudaDevice::get(0)?.new_stream()?;
        let x = randn(GPU, &[16])?.with_grad()?;
        let (y, report) = x.to_async(Device::Cpu, &stream)?.wait()?;
        assert_eq!(report.nodes_recorded, 1);
        assert_eq!(y.node().unwrap().meta().op, "to_async");
        y.mul_scalar(3.0)?.sum()?.backward()?;
        assert!(values(&x.grad().unwrap()).iter().all(|&g| g == 3.0));
        Ok(())
    })
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_batched_state_dict_equals_per_tensor_moves() {
    run(|| {
        let mut dict = Vec::new();
        for (i, src) in sources(GPU, 65, 33)?.into_iter().enumerate() {
            dict.push((format!("t{i}"), src));
        }
        dict.push(("leaf".into(), randn(GPU, &[9, 9])?.with_grad()?));
        dict.push(("ids".into(), Tensor::arange(0.0, 40.0, DType::I64, GPU)?));
        dict.push(("mask".into(), Tensor::ones(&[3, 3], DType::U8, GPU)?));
        // Tensors of 4 MiB and more go straight into the arena, between and after packed ones:
        // contiguous, a view at an offset, and a transposed one made dense first.
        let big = randn(GPU, &[1100, 1000])?;
        dict.insert(2, ("big".into(), big.clone()));
        dict.push(("big_narrow".into(), big.narrow(0, 3, 1090)?));
        dict.push(("big_t".into(), big.t()?));
        let (moved, report) = move_state_dict(&dict, Device::Cpu)?;
        assert_eq!(
            report.path,
            TransferPath::Batched {
                tensors: dict.len()
            }
        );
        assert_eq!(report.nodes_recorded, 0);
        for ((name, t), (moved_name, m)) in dict.iter().zip(&moved) {
            assert_eq!(name, moved_name);
            assert_eq!(
                (m.device(), m.dtype(), m.shape()),
                (Device::Cpu, t.dtype(), t.shape())
            );
            assert_eq!(bits(m), bits(&t.to(Device::Cpu)?), "{name}");
        }
        // And back up, batched.
        let (up, _) = move_state_dict(&moved, GPU)?;
        for ((_, t), (_, u)) in dict.iter().zip(&up) {
            assert_eq!(u.device(), GPU);
            assert_eq!(bits(u), bits(t));
        }
        Ok(())
    })
}

#[test]
fn memory_helpers_are_errors_where_they_cannot_answer() {
    let err = ferry::cuda::memory_allocated(Device::Cpu).unwrap_err();
    assert!(err.to_string().contains("Device::Cuda(n)"), "{err}");
    if !ferry::cuda::is_available() {
        assert!(ferry::cuda::memory_allocated(GPU).is_err());
        assert!(ferry::cuda::max_memory_allocated(GPU).is_err());
        assert!(ferry::cuda::memory_reserved(GPU).is_err());
        assert!(ferry::cuda::reset_peak(GPU).is_err());
        assert!(ferry::cuda::empty_cache(GPU).is_err());
        assert!(ferry::cuda::pinned::memory_allocated().is_err());
        assert!(ferry::cuda::pinned::reset_peak().is_err());
    }
}
