use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{device_test, randn, tensor, values};

fn zero_dim(device: Device) -> Result<()> {
    let s = tensor(device, &[3.0], &[])?;
    assert_eq!((s.ndim(), s.numel()), (0, 1));
    assert_eq!(s.item()?, 3.0);
    assert_eq!(values(&s.sum()?), [3.0]);
    assert_eq!(s.sum()?.shape(), [] as [usize; 0]);
    assert_eq!(values(&s.mean()?), [3.0]);
    // A 0-d tensor broadcasts against anything.
    let m = randn(device, &[2, 3])?;
    let scaled = m.mul(&s)?;
    assert_eq!(scaled.shape(), [2, 3]);
    assert_eq!(
        values(&scaled),
        values(&m).iter().map(|v| v * 3.0).collect::<Vec<_>>()
    );
    assert_eq!(s.unsqueeze(0)?.shape(), [1]);
    assert_eq!(s.reshape(&[1, 1])?.shape(), [1, 1]);
    assert_eq!(s.broadcast_to(&[2])?.shape(), [2]);
    // d/ds (s·s) = 2s, and the gradient keeps the 0-d shape.
    let leaf = s.with_grad()?;
    leaf.mul(&leaf)?.backward()?;
    let g = leaf.grad().unwrap();
    assert_eq!(g.shape(), [] as [usize; 0]);
    assert_eq!(g.item()?, 6.0);
    // d/ds Σ (m·s) = Σ m: the broadcast gradient sums back to 0-d.
    let leaf = tensor(device, &[2.0], &[])?.with_grad()?;
    m.mul(&leaf)?.sum()?.backward()?;
    assert_eq!(leaf.grad().unwrap().shape(), [] as [usize; 0]);
    assert!((leaf.grad().unwrap().item()? - values(&m).iter().sum::<f64>()).abs() < 1e-12);
    Ok(())
}
device_test!(zero_dimensional_tensors, zero_dim);

fn empty(device: Device) -> Result<()> {
    let e = Tensor::zeros(&[0, 3], DType::F64, device)?;
    assert_eq!(e.numel(), 0);
    assert_eq!(values(&e), [] as [f64; 0]);
    assert_eq!(values(&e.sum()?), [0.0]);
    assert_eq!(e.sum_axis(0, false)?.shape(), [3]);
    assert_eq!(values(&e.sum_axis(0, false)?), [0.0; 3]);
    assert_eq!(e.sum_axis(1, true)?.shape(), [0, 1]);
    assert_eq!(e.exp()?.shape(), [0, 3]);
    assert_eq!(e.add(&randn(device, &[3])?)?.shape(), [0, 3]);
    assert_eq!(e.add(&randn(device, &[1, 1])?)?.shape(), [0, 3]);
    assert_eq!(e.t()?.reshape(&[3, 0])?.shape(), [3, 0]);
    assert_eq!(e.reshape(&[usize::MAX, 0])?.shape(), [usize::MAX, 0]); // 0 elements, no overflow
    assert_eq!(e.narrow(1, 3, 0)?.shape(), [0, 0]);
    assert_eq!(e.max_axis(1, false)?.shape(), [0]); // over a non-empty axis of an empty tensor
    // Products over an empty inner dimension are zeros, like a sum of nothing.
    let (a, b) = (
        Tensor::ones(&[2, 0], DType::F64, device)?,
        Tensor::ones(&[0, 3], DType::F64, device)?,
    );
    assert_eq!(values(&a.matmul(&b)?), [0.0; 6]);
    assert_eq!(
        b.matmul(&Tensor::ones(&[3, 4], DType::F64, device)?)?
            .shape(),
        [0, 4]
    );
    // Joining with an empty part changes nothing.
    let x = randn(device, &[2, 3])?;
    let joined = Tensor::cat(&[&x, &Tensor::zeros(&[0, 3], DType::F64, device)?], 0)?;
    assert_eq!(values(&joined), values(&x));
    assert_eq!(
        Tensor::zeros(&[0], DType::F32, device)?.chunk(3, 0)?.len(),
        0
    );
    // Gradients of empty leaves are empty, in the leaf's shape.
    let leaf = e.with_grad()?;
    leaf.exp()?.sum()?.backward()?;
    assert_eq!(leaf.grad().unwrap().shape(), [0, 3]);
    Ok(())
}
device_test!(empty_tensors, empty);

fn stride_zero(device: Device) -> Result<()> {
    // [[1], [2], [3]] repeated along 4 columns, read without a copy.
    let col = tensor(device, &[1.0, 2.0, 3.0], &[3, 1])?;
    let b = col.broadcast_to(&[3, 4])?;
    assert_eq!(b.layout().strides(), [1, 0]);
    assert_eq!(values(&b.sum_axis(1, false)?), [4.0, 8.0, 12.0]);
    assert_eq!(values(&b.sum_axis(0, false)?), [6.0; 4]);
    assert_eq!(values(&b.sum()?), [24.0]);
    assert_eq!(values(&b.max_axis(0, false)?), [3.0; 4]);
    assert_eq!(b.argmax(1, false)?.to_vec::<i64>()?, [0, 0, 0]); // all tied: the first
    let soft = b.softmax(1)?;
    assert_eq!(values(&soft), [0.25; 12]);
    // A 0-d value broadcast to a matrix, then through unary and binary kernels.
    let s = tensor(device, &[2.0], &[])?.broadcast_to(&[2, 2])?;
    assert_eq!(values(&s.exp()?.log()?), [2.0; 4]);
    assert_eq!(
        values(&s.mul(&b.narrow(0, 0, 2)?.narrow(1, 0, 2)?)?),
        [2.0, 2.0, 4.0, 4.0]
    );
    // Broadcast both ways at once: an outer product by broadcasting.
    let row = tensor(device, &[1.0, 10.0], &[1, 2])?.broadcast_to(&[3, 2])?;
    let outer = col.broadcast_to(&[3, 2])?.mul(&row)?;
    assert_eq!(values(&outer), [1.0, 10.0, 2.0, 20.0, 3.0, 30.0]);
    // A broadcast view as a matmul operand: rows all equal.
    let m = b.t()?.matmul(&Tensor::ones(&[3, 1], DType::F64, device)?)?; // [4, 3] · [3, 1]
    assert_eq!(values(&m), [6.0; 4]);
    Ok(())
}
device_test!(stride_zero_inputs, stride_zero);

fn to_vec_records_nothing(device: Device) -> Result<()> {
    // Reading values from a non-contiguous tensor that requires grad must not grow the graph
    // (counts are process-wide, so here only the result is checked: no error, right values).
    let x = tensor(device, &[1.0, 2.0, 3.0, 4.0], &[2, 2])?.with_grad()?;
    assert_eq!(values(&x.t()?), [1.0, 3.0, 2.0, 4.0]);
    assert_eq!(
        format!("{:?}", x.t()?),
        format!("Tensor[[2, 2], f64, {device}, requires_grad, [1.0, 3.0, 2.0, 4.0]]")
    );
    Ok(())
}
device_test!(reading_values_of_views, to_vec_records_nothing);

/// Foreign memory one byte into an allocation, labelled f32: typed access and a tensor over it
/// are refused (ferry-tensor itself holds no unsafe code, so the memory is made here).
#[test]
fn misaligned_foreign_bytes_are_an_error_not_a_panic() {
    let backing = vec![0u8; 4 * 9].into_boxed_slice();
    let base = std::ptr::NonNull::new(backing.as_ptr() as *mut u8).unwrap();
    // SAFETY: one byte into a 36-byte allocation.
    let odd = unsafe { base.add(1) };
    // SAFETY: `backing` outlives the buffer, which is dropped before it below.
    let buffer = unsafe { ferry::memory::HostBuffer::from_external(odd, 32, Box::new(())) };
    let storage = std::sync::Arc::new(ferry_tensor::Storage::new(
        ferry_tensor::Buffer::Host(buffer),
        DType::F32,
        Device::Cpu,
    ));
    let Err(err) = storage.host::<f32>("read") else {
        panic!("misaligned bytes were read");
    };
    assert!(
        matches!(err, ferry_tensor::TensorError::Misaligned { align: 4, .. }),
        "{err}"
    );
    assert!(err.to_string().contains(".clone()"), "{err}");
    let layout = ferry_tensor::Layout::contiguous(&[8]);
    let Err(err) = Tensor::from_storage(storage.clone(), layout) else {
        panic!("a tensor was made over misaligned bytes");
    };
    assert!(
        matches!(err, ferry_tensor::TensorError::Misaligned { .. }),
        "{err}"
    );
    drop(storage);
    drop(backing);
}
