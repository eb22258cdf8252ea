//! The CUDA libraries on a real GPU: kernels compiled, loaded and launched, cuBLAS products,
//! cuDNN's fused attention (in `attention`), and the ordering of device buffers across streams
//! with a kernel as the slow producer. Every test is ignored on machines without one; run them
//! with `cargo test -p ferry-cuda --test cuda -- --ignored`.
//!
//! The tests share one device and its allocator, so each holds a process-wide lock.

use std::sync::{Mutex, MutexGuard};

use ferry_cuda::{
    Blas, CudaLibError, GemmInput, GemmOutput, GemmSpec, KernelModule, Kernels, blocks_for,
};
use ferry_memory::cuda::{CudaDevice, PinnedPool};
use ferry_memory::{DType, MemoryError};

#[path = "cuda/attention.rs"]
mod attention;

static ONE_TEST_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The first GPU, with the lock that keeps other tests off it; fails with the reason otherwise.
fn gpu() -> (MutexGuard<'static, ()>, CudaDevice) {
    let guard = ONE_TEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let device = CudaDevice::get(0)
        .unwrap_or_else(|e| panic!("this test needs CUDA device 0, and getting it failed: {e}"));
    (guard, device)
}

/// Deterministic pseudo-random bytes (xorshift64*), so a failure reproduces.
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

static FILL: KernelModule = KernelModule {
    name: "test_fill",
    source: r#"
extern "C" __global__ void fill(float *out, float value, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
"#,
};

#[test]
#[ignore = "needs a CUDA device"]
fn a_compiled_kernel_fills_a_buffer() {
    let (_lock, dev) = gpu();
    let stream = dev.default_stream();
    let fill = dev.function(&FILL, "fill").unwrap();
    let compiled_for = dev.compile_time();
    let n = 1000;
    let mut out = dev.alloc_zeroed(n * 4, stream).unwrap();
    dev.launch(&fill, (blocks_for(n, 256), 1, 1), (256, 1, 1), 0, stream)
        .arg_buffer_mut(&mut out)
        .arg_f32(2.5)
        .arg_u32(n as u32)
        .run()
        .unwrap();
    let mut bytes = vec![0; n * 4];
    out.copy_to_host(&mut bytes, stream).unwrap();
    let values: &[f32] = bytemuck::cast_slice(&bytes);
    assert!(values.iter().all(|&v| v == 2.5), "{:?}", &values[..8]);

    // The second lookup is cached: no more compile time.
    dev.function(&FILL, "fill").unwrap();
    assert_eq!(dev.compile_time(), compiled_for);
    assert!(matches!(
        dev.function(&FILL, "missing"),
        Err(CudaLibError::KernelNotFound { .. })
    ));
}

static BROKEN: KernelModule = KernelModule {
    name: "test_broken",
    source: r#"extern "C" __global__ void broken(float *out) { out[0] = not_declared_anywhere; }"#,
};

#[test]
#[ignore = "needs a CUDA device"]
fn a_compile_error_returns_the_nvrtc_log() {
    let (_lock, dev) = gpu();
    match dev.function(&BROKEN, "broken") {
        Err(CudaLibError::KernelCompile { module, log, arch }) => {
            assert_eq!(module, "test_broken");
            assert!(log.contains("not_declared_anywhere"), "{log}");
            assert!(arch.starts_with("compute_"), "{arch}");
        }
        other => panic!("expected KernelCompile, got {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn gemm_f32_matches_the_hand_computed_product() {
    let (_lock, dev) = gpu();
    let stream = dev.default_stream();
    // Row-major A (2x3) = [[1, 2, 3], [4, 5, 6]], B (3x2) = [[7, 8], [9, 10], [11, 12]].
    // C = A·B = [[1*7 + 2*9 + 3*11, 1*8 + 2*10 + 3*12], [4*7 + 5*9 + 6*11, 4*8 + 5*10 + 6*12]]
    //         = [[58, 64], [139, 154]].
    let a_host = [1f32, 2., 3., 4., 5., 6.];
    let b_host = [7f32, 8., 9., 10., 11., 12.];
    let upload = |values: &[f32]| {
        let mut buffer = dev.alloc(values.len() * 4, stream).unwrap();
        buffer
            .copy_from_host(bytemuck::cast_slice(values), stream)
            .unwrap();
        buffer
    };
    let (a, b) = (upload(&a_host), upload(&b_host));
    let mut c = dev.alloc_zeroed(4 * 4, stream).unwrap();
    // Row-major trick: column-major C^T = B^T A^T, so B goes first with m = N = 2, n = M = 2, k = 3.
    let spec = GemmSpec {
        dtype: DType::F32,
        transa: false,
        transb: false,
        m: 2,
        n: 2,
        k: 3,
        alpha: 1.0,
        beta: 0.0,
        batch: 1,
    };
    let first = GemmInput {
        buffer: &b,
        offset_bytes: 0,
        ld: 2,
        stride: 0,
    };
    let second = GemmInput {
        buffer: &a,
        offset_bytes: 0,
        ld: 3,
        stride: 0,
    };
    dev.gemm_strided_batched(
        &spec,
        first,
        second,
        GemmOutput {
            buffer: &mut c,
            offset_bytes: 0,
            ld: 2,
            stride: 0,
        },
        stream,
    )
    .unwrap();
    let mut bytes = vec![0; 16];
    c.copy_to_host(&mut bytes, stream).unwrap();
    assert_eq!(
        bytemuck::cast_slice::<u8, f32>(&bytes),
        &[58., 64., 139., 154.]
    );

    // An operand that does not fit its buffer is refused before cuBLAS runs.
    let too_big = GemmSpec { k: 4, ..spec };
    let err = dev
        .gemm_strided_batched(
            &too_big,
            first,
            second,
            GemmOutput {
                buffer: &mut c,
                offset_bytes: 0,
                ld: 2,
                stride: 0,
            },
            stream,
        )
        .unwrap_err();
    assert!(
        matches!(err, CudaLibError::Memory(MemoryError::GemmArgument { .. })),
        "{err}"
    );
}

/// Every thread spins for `cycles` clock ticks, then writes `value`: a producer slow enough
/// that a copy not ordered after it reads what was there before.
static SPIN: KernelModule = KernelModule {
    name: "test_spin",
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

fn floats(bytes: &[u8]) -> &[f32] {
    bytemuck::cast_slice(bytes)
}

#[test]
#[ignore = "needs a CUDA device"]
fn copies_on_another_stream_read_what_a_slow_producer_wrote() {
    let (_lock, dev) = gpu();
    let pool = PinnedPool::global().unwrap();
    let spin = dev.function(&SPIN, "spin_then_fill").unwrap();
    let (producer, copier) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let n = 1 << 20;
    // Allocated on the producer's stream: that is the source's home.
    let mut src = dev.alloc_zeroed(n * 4, &producer).unwrap();
    dev.launch(&spin, (blocks_for(n, 256), 1, 1), (256, 1, 1), 0, &producer)
        .arg_buffer_mut(&mut src)
        .arg_f32(7.5)
        .arg_u32(n as u32)
        .arg_i64(SPIN_CYCLES)
        .run()
        .unwrap();
    // Three copies queued on the copier while the producer still spins; none may run early.
    let mut peer = dev.alloc_zeroed(n * 4, &copier).unwrap();
    let mut region = dev.alloc_zeroed(n * 4, &copier).unwrap();
    let mut pinned = pool.alloc(n * 4).unwrap();
    copier.synchronize().unwrap();
    peer.copy_from_peer(&src, &copier).unwrap();
    region.copy_region(0, &src, 0, n * 4, &copier).unwrap();
    src.copy_to_pinned_async(&mut pinned, &copier).unwrap();
    assert!(
        !producer.record().unwrap().query().unwrap(),
        "the producer finished before the copies were queued: raise SPIN_CYCLES"
    );
    for (what, buffer) in [("copy_from_peer", &peer), ("copy_region", &region)] {
        let mut back = vec![0u8; n * 4];
        buffer.copy_to_host(&mut back, &copier).unwrap();
        let wrong = floats(&back).iter().filter(|&&v| v != 7.5).count();
        assert_eq!(
            wrong, 0,
            "{what} on another stream read {wrong} values before the producer wrote them"
        );
    }
    let wrong = floats(pinned.as_bytes().unwrap())
        .iter()
        .filter(|&&v| v != 7.5)
        .count();
    assert_eq!(wrong, 0, "copy_to_pinned_async read {wrong} stale values");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_write_on_the_home_stream_waits_for_a_read_still_queued_on_another() {
    let (_lock, dev) = gpu();
    let pool = PinnedPool::global().unwrap();
    let spin = dev.function(&SPIN, "spin_then_fill").unwrap();
    let home = dev.default_stream();
    let side = dev.new_stream().unwrap();
    let data = random_bytes(16 << 20, 21);
    let mut buffer = dev.alloc(data.len(), home).unwrap();
    buffer.copy_from_host(&data, home).unwrap();
    // Hold the side stream in a slow kernel (one thread), then queue a read of `buffer` there.
    let mut scratch = dev.alloc(4, &side).unwrap();
    dev.launch(&spin, (1, 1, 1), (1, 1, 1), 0, &side)
        .arg_buffer_mut(&mut scratch)
        .arg_f32(1.0)
        .arg_u32(1)
        .arg_i64(4 * SPIN_CYCLES)
        .run()
        .unwrap();
    let mut pinned = pool.alloc(data.len()).unwrap();
    buffer.copy_to_pinned_async(&mut pinned, &side).unwrap();
    // An in-place write on the home stream: it must wait for the read queued on `side`.
    buffer.memset_zero(home).unwrap();
    assert!(
        !side.record().unwrap().query().unwrap(),
        "the side stream finished before the write was queued: raise the spin"
    );
    assert_eq!(
        pinned.as_bytes().unwrap(),
        &data[..],
        "the read queued before the write saw the write"
    );
    let mut back = vec![0xff; data.len()];
    buffer.copy_to_host(&mut back, home).unwrap();
    assert!(back.iter().all(|&b| b == 0), "the write did not happen");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_copy_after_its_producer_runs_alongside_later_work_on_the_home_stream() {
    let (_lock, dev) = gpu();
    let pool = PinnedPool::global().unwrap();
    let spin = dev.function(&SPIN, "spin_then_fill").unwrap();
    let home = dev.default_stream();
    let copier = dev.new_stream().unwrap();
    let data = random_bytes(16 << 20, 33);
    let mut buffer = dev.alloc(data.len(), home).unwrap();
    buffer.copy_from_host(&data, home).unwrap();
    // The producer's end, then slow work on the home stream queued before the copy (the op that
    // reads an activation next, in offload).
    let ready = home.record().unwrap();
    let mut scratch = dev.alloc(4, home).unwrap();
    dev.launch(&spin, (1, 1, 1), (1, 1, 1), 0, home)
        .arg_buffer_mut(&mut scratch)
        .arg_f32(1.0)
        .arg_u32(1)
        .arg_i64(4 * SPIN_CYCLES)
        .run()
        .unwrap();
    let mut pinned = pool.alloc(data.len()).unwrap();
    buffer
        .copy_to_pinned_async_after(&mut pinned, &copier, &ready)
        .unwrap();
    assert_eq!(
        pinned.as_bytes().unwrap(),
        &data[..],
        "the copy did not carry the producer's bytes"
    );
    assert!(
        !home.record().unwrap().query().unwrap(),
        "the copy waited for the home stream's later work (or the spin is too short)"
    );
    // The block is reused only after the copy: dropping the source at once is fine.
    drop(buffer);
    home.synchronize().unwrap();
    // A plain copy_to_pinned_async waits for that work: the contrast this test rests on.
    let mut again = dev.alloc(data.len(), home).unwrap();
    again.copy_from_host(&data, home).unwrap();
    dev.launch(&spin, (1, 1, 1), (1, 1, 1), 0, home)
        .arg_buffer_mut(&mut scratch)
        .arg_f32(1.0)
        .arg_u32(1)
        .arg_i64(4 * SPIN_CYCLES)
        .run()
        .unwrap();
    again.copy_to_pinned_async(&mut pinned, &copier).unwrap();
    pinned.wait().unwrap();
    assert!(home.record().unwrap().query().unwrap());
}

#[test]
#[ignore = "needs two CUDA devices"]
fn a_peer_copy_waits_for_the_producer_on_the_source_gpu() {
    let (_lock, first) = gpu();
    let Ok(second) = CudaDevice::get(1) else {
        eprintln!("skipped: a peer copy needs two CUDA devices; this machine has one");
        return;
    };
    let _ = first.enable_peer_access(&second);
    let spin = first.function(&SPIN, "spin_then_fill").unwrap();
    let n = 1 << 20;
    let mut src = first.alloc_zeroed(n * 4, first.default_stream()).unwrap();
    first
        .launch(
            &spin,
            (blocks_for(n, 256), 1, 1),
            (256, 1, 1),
            0,
            first.default_stream(),
        )
        .arg_buffer_mut(&mut src)
        .arg_f32(3.25)
        .arg_u32(n as u32)
        .arg_i64(SPIN_CYCLES)
        .run()
        .unwrap();
    // Queued on the second GPU's stream while the first still spins.
    let mut dst = second.alloc_zeroed(n * 4, second.default_stream()).unwrap();
    dst.copy_from_peer(&src, second.default_stream()).unwrap();
    assert!(
        !first.default_stream().record().unwrap().query().unwrap(),
        "the producer finished before the copy was queued: raise SPIN_CYCLES"
    );
    let mut back = vec![0u8; n * 4];
    dst.copy_to_host(&mut back, second.default_stream())
        .unwrap();
    let wrong = floats(&back).iter().filter(|&&v| v != 3.25).count();
    assert_eq!(
        wrong, 0,
        "the peer copy read {wrong} values before the source GPU wrote them"
    );
}
