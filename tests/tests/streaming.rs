//! Streaming to the host (`stream_to`): chunks in order, detached, within the plan's staging,
//! and overlapped with the caller's work.

use std::time::{Duration, Instant};

use ferry::memory::cuda::CudaDevice;
use ferry::{ChunkPlan, ChunkSpec, DeviceMove, TensorError, TransferPath};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{device_test, randn};

/// Rows of 4096 bytes (1024 f32): a staging bound of two such blocks gives one row per chunk.
const ROW: usize = 1024;
const ONE_ROW_EACH: ChunkSpec = ChunkSpec::MaxStagingBytes(2 * 4096);

fn f32s(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_vec::<f32>()?.iter().map(|v| v.to_bits()).collect())
}

/// Streams `x` to the host, keeping every chunk, and checks order, rows, shapes and that the
/// chunks together are `x` bit for bit.
fn stream_and_compare(x: &Tensor, spec: ChunkSpec) -> Result<()> {
    let expected = f32s(x)?;
    let plan = ChunkPlan::new(x.shape(), x.dtype(), spec)?;
    let stream = x.stream_to(Device::Cpu, spec)?;
    assert_eq!(stream.chunks(), plan.len());
    assert_eq!(stream.size_hint(), (plan.len(), Some(plan.len())));
    let chunks = stream.collect::<Result<Vec<_>>>()?;
    assert_eq!(chunks.len(), plan.len());
    let mut next_row = 0;
    let mut got = Vec::new();
    for (i, chunk) in chunks.iter().enumerate() {
        assert_eq!(chunk.index(), i);
        assert_eq!(chunk.rows(), plan.pieces()[i]);
        assert_eq!(chunk.rows().start, next_row, "chunks in order, no gap");
        next_row = chunk.rows().end;
        let t = chunk.tensor();
        assert_eq!(t.device(), Device::Cpu);
        assert_eq!(t.shape()[0], chunk.rows().len());
        assert_eq!(&t.shape()[1..], &x.shape()[1..]);
        // Read after every chunk was taken: kept chunks are not overwritten by later copies.
        got.extend(f32s(t)?);
    }
    assert_eq!(next_row, x.shape()[0]);
    assert!(got == expected, "the chunks differ from the source");
    Ok(())
}

fn chunks_cover_the_rows_in_order_bit_for_bit(device: Device) -> Result<()> {
    let x = Tensor::randn(&[50, ROW], DType::F32, device)?;
    stream_and_compare(&x, ONE_ROW_EACH)?;
    // Uneven pieces: 50 rows, three per chunk at most.
    stream_and_compare(&x, ChunkSpec::MaxStagingBytes(2 * 3 * 4096))?;
    stream_and_compare(&x, ChunkSpec::Count(1))?;
    // Non-contiguous: rows of the transpose are columns of the storage.
    let xt = Tensor::randn(&[ROW, 50], DType::F32, device)?.t()?;
    assert!(!xt.is_contiguous());
    stream_and_compare(&xt, ONE_ROW_EACH)
}
device_test!(chunks_in_order, chunks_cover_the_rows_in_order_bit_for_bit);

fn chunks_are_detached_and_the_stream_records_nothing(device: Device) -> Result<()> {
    let x = randn(device, &[8, 512])?.with_grad()?;
    let mut stream = x.stream_to(Device::Cpu, ONE_ROW_EACH)?;
    let chunk = stream.next().expect("8 rows, 8 chunks")?;
    assert!(!chunk.tensor().requires_grad());
    assert!(chunk.tensor().node().is_none());
    let report = stream.report();
    assert_eq!((report.nodes_recorded, report.grad_bytes_copied), (0, 0));
    match device {
        Device::Cpu => assert_eq!(report.path, TransferPath::SameDevice),
        Device::Cuda(_) => {
            assert_eq!(report.path, TransferPath::Chunked { chunks: 8 });
            assert_eq!(report.bytes_moved, 512 * 8, "one f64 row handed out so far");
        }
    }
    Ok(())
}
device_test!(
    chunks_are_detached,
    chunks_are_detached_and_the_stream_records_nothing
);

fn zero_dim_and_empty_sources(device: Device) -> Result<()> {
    let scalar = Tensor::from_vec(vec![2.5f32], &[])?.to(device)?;
    let chunks = scalar
        .stream_to(Device::Cpu, ChunkSpec::Count(4))?
        .collect::<Result<Vec<_>>>()?;
    assert_eq!(chunks.len(), 1);
    assert_eq!(
        (chunks[0].rows(), chunks[0].tensor().shape()),
        (0..1, &[][..])
    );
    assert_eq!(chunks[0].tensor().to_vec::<f32>()?, [2.5]);
    let empty = Tensor::zeros(&[0, 7], DType::F32, device)?;
    assert_eq!(
        empty.stream_to(Device::Cpu, ChunkSpec::Count(3))?.count(),
        0
    );
    Ok(())
}
device_test!(zero_dim_and_empty, zero_dim_and_empty_sources);

fn dropping_early_leaves_the_source_and_later_streams_intact(device: Device) -> Result<()> {
    let x = Tensor::randn(&[40, ROW], DType::F32, device)?;
    let mut stream = x.stream_to(Device::Cpu, ONE_ROW_EACH)?;
    let first = stream.next().expect("40 chunks")?;
    let _second = stream.next().expect("40 chunks")?;
    drop(stream); // copies still in flight: waited for, staging returned
    assert_eq!(f32s(first.tensor())?, f32s(&x.narrow(0, 0, 1)?)?);
    stream_and_compare(&x, ONE_ROW_EACH)
}
device_test!(
    dropping_early,
    dropping_early_leaves_the_source_and_later_streams_intact
);

fn writing_the_source_while_it_streams_is_an_error(device: Device) -> Result<()> {
    let x = Tensor::randn(&[6, ROW], DType::F32, device)?;
    let mut stream = x.stream_to(Device::Cpu, ONE_ROW_EACH)?;
    let _first = stream.next().expect("6 chunks")?;
    x.assign(&Tensor::zeros(x.shape(), DType::F32, device)?)?;
    let err = stream.next().expect("an error, not the end").unwrap_err();
    assert!(
        matches!(&err, TensorError::InvalidArgument { op: "stream_to", message } if message.contains("x.copy()")),
        "{err}"
    );
    assert!(stream.next().is_none(), "the stream ends after an error");
    Ok(())
}
device_test!(
    writing_the_source,
    writing_the_source_while_it_streams_is_an_error
);

#[test]
fn bad_targets_and_specs_name_the_fix() {
    let x = Tensor::zeros(&[10, ROW], DType::F32, Device::Cpu).unwrap();
    let err = x
        .stream_to(Device::Cuda(0), ChunkSpec::Count(2))
        .unwrap_err();
    assert!(err.to_string().contains("Device::Cpu"), "{err}");
    assert!(err.to_string().contains("to_chunked"), "{err}");
    let err = x.stream_to(Device::Cpu, ChunkSpec::Count(0)).unwrap_err();
    assert!(
        matches!(&err, TensorError::InvalidArgument { op: "stream_to", message } if message.contains("Count(1)")),
        "{err}"
    );
    let err = x
        .stream_to(Device::Cpu, ChunkSpec::MaxStagingBytes(100))
        .unwrap_err();
    assert!(err.to_string().contains("MaxStagingBytes(4096)"), "{err}");
}

#[test]
fn a_host_source_streams_views_of_its_rows() {
    let x = Tensor::randn(&[12, 64], DType::F32, Device::Cpu).unwrap();
    for chunk in x.stream_to(Device::Cpu, ChunkSpec::Count(4)).unwrap() {
        let chunk = chunk.unwrap();
        assert!(chunk.tensor().shares_storage(&x), "no copy on the host");
    }
}

// ---- GPU only: staging bound, zero copy, ordering, overlap. ----

const GPU: Device = Device::Cuda(0);

#[test]
#[ignore = "needs a CUDA device"]
fn the_ring_stays_within_the_plan_even_when_chunks_are_kept() {
    // Timed against a spin and reading pool peaks: alone, behind the binary's lock.
    let _serial = super::serial_lock();
    ferry_tests::run_on(GPU, |_| {
        let x = Tensor::randn(&[64, 64 * ROW], DType::F32, GPU)?; // 16 MiB, rows of 256 KiB
        let spec = ChunkSpec::MaxStagingBytes(4 << 20);
        let plan = ChunkPlan::new(x.shape(), x.dtype(), spec)?;
        assert!(plan.len() >= 8 && plan.staging_buffers() == 2, "{plan:?}");
        // Dropping each chunk: the ring's two blocks serve every chunk.
        let mut stream = x.stream_to(Device::Cpu, spec)?;
        for chunk in stream.by_ref() {
            let chunk = chunk?;
            assert!(matches!(
                &*chunk.tensor().storage().read(),
                ferry::tensor::Buffer::Pinned(_)
            ));
        }
        assert_eq!(stream.report().staging_peak_bytes, plan.staging_bytes());
        // Keeping every chunk: each leaves the ring, which takes a new block; the ring itself
        // still never holds more than the plan.
        let mut stream = x.stream_to(Device::Cpu, spec)?;
        let kept = stream.by_ref().collect::<Result<Vec<_>>>()?;
        assert_eq!(stream.report().staging_peak_bytes, plan.staging_bytes());
        assert_eq!(kept.len(), plan.len());
        let mut got = Vec::new();
        for chunk in &kept {
            got.extend(f32s(chunk.tensor())?);
        }
        assert!(got == f32s(&x)?);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_chunks_hold_what_a_slow_producer_wrote() {
    // Timed against a spin and reading pool peaks: alone, behind the binary's lock.
    let _serial = super::serial_lock();
    ferry_tests::run_on(GPU, |_| {
        let dev = CudaDevice::get(0)?;
        let y = Tensor::randn(&[32, ROW], DType::F32, GPU)?;
        let expected: Vec<u32> = y
            .to_vec::<f32>()?
            .iter()
            .map(|v| (v + 1.0).to_bits())
            .collect();
        // Makes the copy stream (the device's first second stream synchronizes the device) and
        // caches staging blocks before the spin.
        let warm = Tensor::zeros(&[2, ROW], DType::F32, GPU)?;
        assert_eq!(warm.stream_to(Device::Cpu, ONE_ROW_EACH)?.count(), 2);
        // The producer runs behind a 200 ms spin on the default stream; the copies are queued
        // on the copy stream right after it.
        let _held = super::hold(dev.default_stream())?;
        let x = y.add_scalar(1.0)?;
        let started = Instant::now();
        let stream = x.stream_to(Device::Cpu, ONE_ROW_EACH)?;
        assert!(
            started.elapsed() < Duration::from_millis(100),
            "stream_to waited for the producer on the host"
        );
        let mut got = Vec::new();
        for chunk in stream {
            got.extend(f32s(chunk?.tensor())?);
        }
        assert!(
            started.elapsed() > Duration::from_millis(100),
            "the spin finished before the copies were queued: lengthen it"
        );
        assert!(
            got == expected,
            "a chunk was copied before its producer ran"
        );
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_next_chunk_travels_while_the_caller_works() {
    // Timed against a spin and reading pool peaks: alone, behind the binary's lock.
    let _serial = super::serial_lock();
    ferry_tests::run_on(GPU, |_| {
        // 16 chunks of 128 MiB; first, how long one chunk's copy takes on its own.
        let x = Tensor::zeros(&[16, 32 << 20], DType::F32, GPU)?;
        let row = Tensor::zeros(&[1, 32 << 20], DType::F32, GPU)?; // dense: no copy first
        let _warm = row.to(Device::Cpu)?;
        let started = Instant::now();
        let _alone = row.to(Device::Cpu)?;
        let one_copy = started.elapsed();
        // The caller works longer on each chunk than a copy takes.
        let work = (4 * one_copy).max(Duration::from_millis(20));
        let spec = ChunkSpec::MaxStagingBytes(2 * (128 << 20));
        let mut stream = x.stream_to(Device::Cpu, spec)?;
        assert_eq!(stream.chunks(), 16);
        for chunk in stream.by_ref() {
            let _chunk = chunk?;
            std::thread::sleep(work);
        }
        // Without overlap every chunk's copy would be waited for (16 copies); with it, about
        // the first one only.
        let waited = stream.waited();
        assert!(
            waited < 4 * one_copy,
            "waited {waited:?} for 16 chunks, one copy takes {one_copy:?}: the copies did not \
             overlap the caller's work"
        );
        Ok(())
    });
}
