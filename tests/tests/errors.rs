use std::sync::Arc;

use ferry_memory::{HostBuffer, MemoryError};
use ferry_tensor::gradcheck::{GradcheckOptions, gradcheck};
use ferry_tensor::{Buffer, DType, Device, Layout, Storage, Tensor, TensorError};

/// Asserts `result` failed with a variant `matches` accepts, and that its message holds every
/// one of `says` (the fix it names).
#[track_caller]
fn expect_err<T: std::fmt::Debug>(
    result: ferry_tensor::Result<T>,
    matches: fn(&TensorError) -> bool,
    says: &[&str],
) {
    let err = result.expect_err("bad input must be an error");
    assert!(matches(&err), "unexpected variant: {err:?}");
    let message = err.to_string();
    for s in says {
        assert!(
            message.contains(s),
            "message {message:?} should contain {s:?}"
        );
    }
}

fn f32s(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape, DType::F32, Device::Cpu).unwrap()
}

#[test]
fn shape_mismatch() {
    let is = |e: &TensorError| matches!(e, TensorError::ShapeMismatch { .. });
    expect_err(
        f32s(&[2, 3]).add(&f32s(&[4])),
        is,
        &["add", "[2, 3]", "[4]", "broadcast"],
    );
    expect_err(
        f32s(&[2, 3]).matmul(&f32s(&[2, 3])),
        is,
        &["matmul", "[.., k, n]"],
    );
    expect_err(f32s(&[2, 3, 4]).matmul(&f32s(&[3, 4, 5])), is, &["matmul"]);
    expect_err(
        f32s(&[3]).matmul(&f32s(&[3])),
        is,
        &["reshape vectors to matrices"],
    );
    expect_err(
        Tensor::cat(&[&f32s(&[2, 3]), &f32s(&[3, 3])], 1),
        is,
        &["cat", "every dimension but the joined one"],
    );
    expect_err(Tensor::cat(&[&f32s(&[2, 3]), &f32s(&[6])], 0), is, &["cat"]);
    expect_err(
        f32s(&[2, 3]).broadcast_to(&[3, 3]),
        is,
        &["broadcast_to", "equal the target or be 1"],
    );
    expect_err(
        f32s(&[2, 3]).cross_entropy(&Tensor::zeros(&[3], DType::I64, Device::Cpu).unwrap()),
        is,
        &["targets [n]"],
    );
    let y = f32s(&[3]).with_grad().unwrap().mul_scalar(2.0).unwrap();
    expect_err(
        y.backward_with(f32s(&[4]), Default::default()),
        is,
        &["the output's shape"],
    );
}

#[test]
fn dtype_mismatch() {
    let is = |e: &TensorError| matches!(e, TensorError::DTypeMismatch { .. });
    let f64s = Tensor::zeros(&[2], DType::F64, Device::Cpu).unwrap();
    expect_err(
        f32s(&[2]).add(&f64s),
        is,
        &["add", "f32", "f64", "to_dtype(DType::F64)"],
    );
    expect_err(
        f32s(&[2, 2]).matmul(&f64s.reshape(&[2, 1]).unwrap()),
        is,
        &["to_dtype"],
    );
    expect_err(Tensor::cat(&[&f32s(&[2]), &f64s], 0), is, &["cat"]);
    expect_err(f32s(&[2]).to_vec::<f64>(), is, &["f32", "f64"]);
    let targets = Tensor::zeros(&[2], DType::F32, Device::Cpu).unwrap();
    expect_err(f32s(&[2, 3]).cross_entropy(&targets), is, &["DType::I64"]);
    let y = f32s(&[2]).with_grad().unwrap().sum().unwrap();
    expect_err(
        y.backward_with(
            Tensor::ones(&[], DType::F64, Device::Cpu).unwrap(),
            Default::default(),
        ),
        is,
        &["backward"],
    );
}

/// A tensor that says it is on `cuda:0`. No CUDA tensor can be made on this machine yet, but
/// `Storage` is public and this is the only way to reach the device checks from a CPU.
fn labelled_cuda(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let storage = Storage::new(
        Buffer::Host(HostBuffer::zeroed(n * 4).unwrap()),
        DType::F32,
        Device::Cuda(0),
    );
    Tensor::from_storage(Arc::new(storage), Layout::contiguous(shape)).unwrap()
}

#[test]
fn device_mismatch() {
    let is = |e: &TensorError| matches!(e, TensorError::DeviceMismatch { .. });
    let gpu = labelled_cuda(&[2]);
    expect_err(
        f32s(&[2]).add(&gpu),
        is,
        &["add", "cpu", "cuda:0", ".to(Device::"],
    );
    expect_err(
        gpu.mul(&f32s(&[2])),
        is,
        &["mul", "ferry never moves data implicitly"],
    );
    expect_err(Tensor::cat(&[&f32s(&[2]), &gpu], 0), is, &["cat"]);
    expect_err(
        f32s(&[2, 2]).matmul(&labelled_cuda(&[2, 2])),
        is,
        &["matmul"],
    );
}

#[test]
fn cuda_without_a_gpu_is_an_error_value() {
    // Creating on a GPU where there is none is an error value that says to use the CPU, never a
    // panic. Where a GPU is present, creation works and only mislabelled storage is refused.
    let gpu_here = ferry::memory::cuda::CudaDevice::get(0).is_ok();
    let created = [
        Tensor::zeros(&[2], DType::F32, Device::Cuda(0)),
        Tensor::randn(&[2], DType::F32, Device::Cuda(0)),
        Tensor::arange(0.0, 3.0, DType::F32, Device::Cuda(0)),
    ];
    for result in created {
        match result {
            Ok(t) => assert!(gpu_here && t.device() == Device::Cuda(0)),
            Err(err) => {
                assert!(!gpu_here, "{err}");
                assert!(
                    matches!(
                        err,
                        TensorError::Memory(
                            MemoryError::NoDriver | MemoryError::NoSuchDevice { .. }
                        )
                    ),
                    "{err:?}"
                );
                assert!(err.to_string().contains("Device::Cpu"), "{err}");
            }
        }
    }
    // Host bytes that claim to be on a GPU: no kernel may read them.
    for result in [labelled_cuda(&[2]).exp(), labelled_cuda(&[2]).sum()] {
        let err = result.expect_err("mislabelled storage is refused");
        let ok = matches!(
            err,
            TensorError::UnsupportedDevice {
                device: Device::Cuda(0),
                ..
            }
        ) || matches!(
            err,
            TensorError::Memory(MemoryError::NoDriver | MemoryError::NoSuchDevice { .. })
        );
        assert!(ok, "{err:?}");
        assert!(err.to_string().contains("Device::Cpu"), "{err}");
    }
}

#[test]
fn unsupported_dtype() {
    let is = |e: &TensorError| matches!(e, TensorError::UnsupportedDType { .. });
    let ints = Tensor::from_slice(&[1i64, 2], &[2]).unwrap();
    expect_err(ints.exp(), is, &["exp", "i64", "to_dtype(DType::F32)"]);
    expect_err(ints.add(&ints), is, &["add", "i64"]);
    expect_err(ints.sum(), is, &["sum"]);
    let bytes = Tensor::zeros(&[2, 2], DType::U8, Device::Cpu).unwrap();
    expect_err(bytes.matmul(&bytes), is, &["matmul", "float dtype"]);
    expect_err(Tensor::rand(&[2], DType::I64, Device::Cpu), is, &["rand"]);
    let not_f64 = [f32s(&[2])];
    expect_err(
        gradcheck(|x| x[0].sum(), &not_f64, GradcheckOptions::default()),
        is,
        &["gradcheck", "DType::F64"],
    );
}

#[test]
fn axis_out_of_range() {
    let is = |e: &TensorError| matches!(e, TensorError::AxisOutOfRange { .. });
    let x = f32s(&[2, 3]);
    expect_err(
        x.sum_axis(2, false),
        is,
        &["sum", "axis 2", "2 dimension(s)", "-1 for the last"],
    );
    expect_err(x.sum_axis(-3, false), is, &["axis -3"]);
    expect_err(x.mean_axis(5, true), is, &["mean"]);
    expect_err(x.max_axis(2, false), is, &["max"]);
    expect_err(x.argmax(9, false), is, &["argmax"]);
    expect_err(x.transpose(0, 2), is, &["transpose"]);
    expect_err(x.narrow(2, 0, 1), is, &["narrow"]);
    expect_err(x.chunk(2, 4), is, &["chunk"]);
    expect_err(x.unsqueeze(4), is, &["unsqueeze"]);
    expect_err(x.squeeze(-3), is, &["squeeze"]);
    expect_err(x.softmax(2), is, &["axis 2"]);
    expect_err(Tensor::cat(&[&x, &x], 2), is, &["cat"]);
    expect_err(
        Tensor::scalar(1.0f32).sum_axis(0, false),
        is,
        &["0 dimension(s)"],
    );
}

#[test]
fn range_out_of_bounds() {
    let is = |e: &TensorError| matches!(e, TensorError::RangeOutOfBounds { .. });
    let x = f32s(&[4, 3]);
    expect_err(x.narrow(0, 2, 5), is, &["narrow", "2..7", "length 4"]);
    expect_err(x.narrow(1, 4, 0), is, &["4..4", "length 3"]);
    expect_err(x.narrow(0, usize::MAX, 2), is, &["narrow"]); // no overflow panic
}

#[test]
fn bad_reshape() {
    let is = |e: &TensorError| matches!(e, TensorError::BadReshape { .. });
    expect_err(
        f32s(&[2, 3]).reshape(&[4]),
        is,
        &["[2, 3]", "6 elements", "[4]", "element counts must match"],
    );
    expect_err(
        f32s(&[2, 3]).t().unwrap().reshape(&[7]),
        is,
        &["7 elements"],
    );
}

#[test]
fn length_mismatch() {
    let is = |e: &TensorError| matches!(e, TensorError::LengthMismatch { .. });
    expect_err(
        Tensor::from_slice(&[1.0f32; 5], &[2, 3]),
        is,
        &["from_slice", "5 values", "[2, 3]", "6 elements"],
    );
    expect_err(Tensor::from_vec(vec![1u8; 2], &[]), is, &["2 values"]);
    let buffer = HostBuffer::zeroed(12).unwrap();
    expect_err(
        Tensor::from_host_buffer(buffer, DType::F64, &[2]),
        is,
        &["from_host_buffer"],
    );
}

#[test]
fn invalid_argument() {
    let is = |e: &TensorError| matches!(e, TensorError::InvalidArgument { .. });
    let x = f32s(&[2, 3]);
    expect_err(x.chunk(0, 1), is, &["chunk", "at least 1"]);
    expect_err(x.item(), is, &["item", "6 elements", ".sum()"]);
    expect_err(f32s(&[0]).item(), is, &["0 elements"]);
    expect_err(Tensor::cat(&[], 0), is, &["cat", "at least one"]);
    expect_err(f32s(&[3]).t(), is, &["t", "2 dimensions"]);
    expect_err(x.squeeze(0), is, &["squeeze", "not 1"]);
    expect_err(
        Tensor::arange(3.0, 1.0, DType::F32, Device::Cpu),
        is,
        &["arange", "start <= end"],
    );
    expect_err(
        Tensor::arange(0.0, f64::NAN, DType::F32, Device::Cpu),
        is,
        &["arange"],
    );
    let targets = Tensor::from_slice(&[0i64, 3], &[2]).unwrap();
    expect_err(
        x.cross_entropy(&targets),
        is,
        &["cross_entropy", "outside 0..3"],
    );
    let negative = Tensor::from_slice(&[-1i64, 0], &[2]).unwrap();
    expect_err(x.cross_entropy(&negative), is, &["outside 0..3"]);
    expect_err(f32s(&[2, 0]).max_axis(1, false), is, &["max", "empty"]);
    expect_err(f32s(&[0]).argmax(0, false), is, &["argmax", "empty"]);
}

#[test]
fn too_large() {
    // Shapes whose bytes overflow are refused before anything is allocated, naming the op,
    // the shape and the dtype (tests/tests/sizes.rs covers every allocating path on both
    // devices).
    let is = |e: &TensorError| matches!(e, TensorError::TooLarge { .. });
    let huge = [usize::MAX, 2];
    expect_err(
        Tensor::zeros(&huge, DType::F32, Device::Cpu),
        is,
        &[
            "zeros",
            "[18446744073709551615, 2]",
            "f32",
            "overflows",
            "isize::MAX",
        ],
    );
    expect_err(
        Tensor::randn(&huge, DType::F32, Device::Cpu),
        is,
        &["randn"],
    );
    expect_err(f32s(&[1]).broadcast_to(&huge), is, &["broadcast_to"]);
    expect_err(f32s(&[2]).reshape(&huge), is, &["reshape"]);
    expect_err(Tensor::from_slice::<f32>(&[], &huge), is, &["from_slice"]);
    // Counting works, bytes do not: 2^62 elements of 8 bytes.
    expect_err(
        Tensor::zeros(&[1 << 62], DType::F64, Device::Cpu),
        is,
        &["[4611686018427387904]", "f64", "8 bytes"],
    );
    expect_err(
        Tensor::arange(0.0, 1e300, DType::F64, Device::Cpu),
        is,
        &["arange"],
    );
    let message = Tensor::zeros(&[(1 << 61) + 1], DType::F64, Device::Cpu)
        .unwrap_err()
        .to_string();
    for misleading in [
        "could not allocate",
        "free some memory",
        "18446744073709551615",
    ] {
        assert!(!message.contains(misleading), "{message}");
    }
}

#[test]
fn bad_layout() {
    let is = |e: &TensorError| matches!(e, TensorError::BadLayout { .. });
    let storage = Arc::new(Storage::new(
        Buffer::Host(HostBuffer::zeroed(40).unwrap()),
        DType::F64,
        Device::Cpu,
    )); // 5 elements
    let layout = |shape: &[usize], strides: &[usize], offset| {
        Layout::new(shape.into(), strides.into(), offset).unwrap()
    };
    // One element too many: [2, 3] contiguous needs 6.
    expect_err(
        Tensor::from_storage(storage.clone(), Layout::contiguous(&[2, 3])),
        is,
        &[
            "from_storage",
            "[2, 3]",
            "needs 48 bytes",
            "holds 40 bytes (5 elements)",
        ],
    );
    // An offset that pushes a fitting shape past the end, and strides that do.
    expect_err(
        Tensor::from_storage(storage.clone(), layout(&[2], &[1], 4)),
        is,
        &["offset 4"],
    );
    expect_err(
        Tensor::from_storage(storage.clone(), layout(&[2, 2], &[3, 2], 0)),
        is,
        &["strides [3, 2]"],
    );
    // An empty view may start at the end, not beyond it.
    assert!(Tensor::from_storage(storage.clone(), layout(&[0], &[1], 5)).is_ok());
    expect_err(
        Tensor::from_storage(storage.clone(), layout(&[0], &[1], 6)),
        is,
        &["offset 6"],
    );
    // Stride 0 fits (a broadcast view), and so does a transposed one.
    let view = Tensor::from_storage(storage.clone(), layout(&[3, 2], &[0, 2], 0)).unwrap();
    assert_eq!(view.shape(), [3, 2]);
    assert!(Tensor::from_storage(storage.clone(), layout(&[2, 2], &[1, 3], 0)).is_ok());
    // A stride-0 view whose elements could not be addressed: too large, not a bad layout.
    expect_err(
        Tensor::from_storage(storage.clone(), layout(&[1 << 61], &[0], 0)),
        |e| matches!(e, TensorError::TooLarge { .. }),
        &["from_storage", "[2305843009213693952]"],
    );
    // Layout::new refuses what no storage could hold: mismatched ranks, overflowing reach.
    expect_err(
        Layout::new([2, 2].as_slice().into(), [1].as_slice().into(), 0),
        is,
        &["Layout::new", "2 dimension(s) but 1 stride(s)"],
    );
    expect_err(
        Layout::new([3].as_slice().into(), [usize::MAX].as_slice().into(), 0),
        is,
        &["past usize::MAX"],
    );
    expect_err(
        Layout::new([2].as_slice().into(), [1].as_slice().into(), usize::MAX),
        is,
        &["past usize::MAX"],
    );
    // The storage is untouched and still usable.
    let ok = Tensor::from_storage(storage, Layout::contiguous(&[5])).unwrap();
    assert_eq!(ok.to_vec::<f64>().unwrap(), [0.0; 5]);
}

#[test]
fn non_scalar_backward() {
    let y = f32s(&[3]).with_grad().unwrap().exp().unwrap();
    let is = |e: &TensorError| matches!(e, TensorError::NonScalarBackward { .. });
    expect_err(y.backward(), is, &["[3]", ".sum()", "backward_with"]);
}

#[test]
fn no_graph() {
    let is = |e: &TensorError| matches!(e, TensorError::NoGraph);
    expect_err(
        f32s(&[3]).sum().unwrap().backward(),
        is,
        &[".with_grad()", "no_grad"],
    );
    let under_no_grad = {
        let x = f32s(&[3]).with_grad().unwrap();
        let _guard = ferry_tensor::no_grad();
        x.sum().unwrap()
    };
    expect_err(under_no_grad.backward(), is, &["with_grad"]);
}

#[test]
fn not_differentiable() {
    let is = |e: &TensorError| matches!(e, TensorError::NotDifferentiable { .. });
    expect_err(
        Tensor::zeros(&[2], DType::U8, Device::Cpu)
            .unwrap()
            .with_grad(),
        is,
        &["u8", "to_dtype(DType::F32)"],
    );
    expect_err(
        Tensor::zeros(&[2], DType::I64, Device::Cpu)
            .unwrap()
            .with_grad(),
        is,
        &["i64"],
    );
    expect_err(
        f32s(&[2]).with_grad().unwrap().to_dtype(DType::I64),
        is,
        &["i64"],
    );
}

#[test]
fn memory_errors_pass_through() {
    // More bytes than any host has: the allocator's refusal arrives as a value.
    let is =
        |e: &TensorError| matches!(e, TensorError::Memory(MemoryError::HostOutOfMemory { .. }));
    expect_err(
        Tensor::zeros(&[1 << 60], DType::U8, Device::Cpu),
        is,
        &["host memory"],
    );
}

#[test]
fn graph_errors_pass_through() {
    // exp saves its output, which the first backward frees (mul_scalar and sum save nothing,
    // so a second backward through them alone would work).
    let y = f32s(&[2])
        .with_grad()
        .unwrap()
        .exp()
        .unwrap()
        .sum()
        .unwrap();
    y.backward().unwrap();
    let is = |e: &TensorError| matches!(e, TensorError::Graph(_));
    expect_err(y.backward(), is, &["retain_graph: true"]);
}
