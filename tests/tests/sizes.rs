//! Shapes too large to address: every allocating path refuses them before asking for memory,
//! with an error that names the op, the shape and the dtype (not an out-of-memory message for
//! a wrapped byte count), and the process goes on working after each refusal.

use ferry_tensor::{DType, Device, Result, Tensor, TensorError};
use ferry_tests::{device_test, tensor, values};

/// 2^61 + 1 elements of f64: 2^64 + 8 bytes, which wraps to 8 in unchecked arithmetic (and
/// allocated 8 bytes on a GPU, which the fill kernel then overran).
const WRAPS_TO_8: usize = (1 << 61) + 1;

/// Asserts `result` is [`TensorError::TooLarge`] from `op` naming `shape`, says why and what
/// the limit is, and does not pose as an out-of-memory error; then shows the device still
/// allocates and computes.
#[track_caller]
fn refused<T: std::fmt::Debug>(
    device: Device,
    result: Result<T>,
    op: &str,
    shape: &[usize],
) -> Result<()> {
    let err = result.expect_err("a shape too large to address must be an error");
    assert!(
        matches!(&err, TensorError::TooLarge { op: o, shape: s, .. } if *o == op && s.as_slice() == shape),
        "expected TooLarge from {op} for {shape:?}, got {err:?}"
    );
    let message = err.to_string();
    for needle in [op, &format!("{shape:?}"), "overflows", "isize::MAX"] {
        assert!(
            message.contains(needle),
            "`{needle}` missing from: {message}"
        );
    }
    for misleading in ["could not allocate", "free some memory", "out of memory"] {
        assert!(!message.contains(misleading), "misleading: {message}");
    }
    still_works(device)
}

/// Allocates and computes something ordinary, checking the values.
fn still_works(device: Device) -> Result<()> {
    let x = tensor(device, &[1.0, 2.0, 3.0], &[3])?;
    let y = x.mul(&x)?.add(&Tensor::ones(&[3], DType::F64, device)?)?;
    assert_eq!(values(&y), [2.0, 5.0, 10.0]);
    Ok(())
}

/// A stride-0 view of one element with `numel` elements: huge shapes that cost nothing.
fn broadcast(device: Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
    Tensor::ones(&[], dtype, device)?.broadcast_to(shape)
}

fn creation(device: Device) -> Result<()> {
    let shape = [WRAPS_TO_8];
    refused(
        device,
        Tensor::zeros(&shape, DType::F64, device),
        "zeros",
        &shape,
    )?;
    refused(
        device,
        Tensor::ones(&shape, DType::F64, device),
        "ones",
        &shape,
    )?;
    refused(
        device,
        Tensor::full(&shape, 2.0, DType::F64, device),
        "full",
        &shape,
    )?;
    refused(
        device,
        Tensor::rand(&shape, DType::F64, device),
        "rand",
        &shape,
    )?;
    refused(
        device,
        Tensor::randn(&shape, DType::F32, device),
        "randn",
        &shape,
    )?;
    // The element count itself overflows.
    let count = [1 << 40, 1 << 40];
    refused(
        device,
        Tensor::zeros(&count, DType::U8, device),
        "zeros",
        &count,
    )?;
    // arange's length saturates, then the size check refuses it.
    refused(
        device,
        Tensor::arange(0.0, 1e300, DType::F64, device),
        "arange",
        &[usize::MAX],
    )?;
    // Zero elements are fine however large the other dimensions.
    let empty = Tensor::zeros(&[usize::MAX, 0, usize::MAX], DType::F64, device)?;
    assert_eq!(empty.numel(), 0);
    Ok(())
}
device_test!(creating_too_large, creation);

fn host_data(device: Device) -> Result<()> {
    let shape = [usize::MAX, 2];
    refused(
        device,
        Tensor::from_slice::<f32>(&[], &shape),
        "from_slice",
        &shape,
    )?;
    refused(
        device,
        Tensor::from_vec::<u8>(vec![], &shape),
        "from_slice",
        &shape,
    )?;
    let buffer = ferry_memory::HostBuffer::zeroed(8)?;
    refused(
        device,
        Tensor::from_host_buffer(buffer, DType::F64, &[WRAPS_TO_8]),
        "from_host_buffer",
        &[WRAPS_TO_8],
    )
}
device_test!(host_data_too_large, host_data);

fn views_and_results(device: Device) -> Result<()> {
    // A view is refused when its elements could not be addressed.
    let one = Tensor::ones(&[1], DType::F64, device)?;
    refused(
        device,
        one.broadcast_to(&[WRAPS_TO_8]),
        "broadcast_to",
        &[WRAPS_TO_8],
    )?;
    refused(
        device,
        one.reshape(&[usize::MAX, 2]),
        "reshape",
        &[usize::MAX, 2],
    )?;
    // Two views that are fine alone whose broadcast result is not: 2^80 elements.
    let (col, row) = (
        broadcast(device, &[1 << 40, 1], DType::F32)?,
        broadcast(device, &[1, 1 << 40], DType::F32)?,
    );
    refused(device, col.add(&row), "add", &[1 << 40, 1 << 40])?;
    refused(device, col.lt(&row), "lt", &[1 << 40, 1 << 40])?;
    // A batch that broadcasts to 2^64 output elements.
    let (a, b) = (
        broadcast(device, &[1 << 32, 1 << 16, 1], DType::F32)?,
        broadcast(device, &[1, 1 << 16], DType::F32)?,
    );
    refused(device, a.matmul(&b), "matmul", &[1 << 32, 1 << 16, 1 << 16])?;
    // 2^62 bytes each, 2^63 joined: one past isize::MAX.
    let half = broadcast(device, &[1 << 62], DType::U8)?;
    refused(device, Tensor::cat(&[&half, &half], 0), "cat", &[1 << 63])?;
    refused(device, half.to_dtype(DType::F32), "to_dtype", &[1 << 62])?;
    let packed = Tensor::pack(&[&half, &half], 64).map(|(t, _)| t);
    refused(device, packed, "pack", &[1 << 63])?;
    Ok(())
}
device_test!(views_and_results_too_large, views_and_results);
