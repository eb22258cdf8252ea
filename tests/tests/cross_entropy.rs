//! Cross-entropy as one op: values and gradients against a direct f64 computation with and
//! without an ignored class, rows longer than a block of threads, bf16 logits, every row
//! ignored, and what one node keeps (never a second `[rows, classes]` tensor).

use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{device_test, randn, values};

use crate::fused::assert_rel;

/// The mean loss and the logits' gradient of `[rows, classes]` logits `l`, in f64, skipping
/// rows whose target is `ignore`.
fn reference(l: &[f64], targets: &[i64], classes: usize, ignore: Option<i64>) -> (f64, Vec<f64>) {
    let counted = targets.iter().filter(|&&t| Some(t) != ignore).count() as f64;
    let (mut loss, mut grad) = (0.0, vec![0.0; l.len()]);
    for (r, &t) in targets.iter().enumerate() {
        if Some(t) == ignore {
            continue;
        }
        let row = &l[r * classes..(r + 1) * classes];
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        loss += (lse - row[t as usize]) / counted;
        for c in 0..classes {
            // d/dx_c of lse - x_t = softmax_c - [c == t], over the rows counted.
            let hot = if c as i64 == t { 1.0 } else { 0.0 };
            grad[r * classes + c] = ((row[c] - lse).exp() - hot) / counted;
        }
    }
    (loss, grad)
}

/// f32 and f64 logits, short rows and rows longer than a block (3000 classes), with no ignored
/// class, an ignored class outside the range (PyTorch's -100) and one inside it.
fn values_and_gradients(device: Device) -> Result<()> {
    for (rows, classes) in [(37, 7), (9, 3000)] {
        let targets: Vec<i64> = (0..rows as i64)
            .map(|i| match i % 4 {
                0 => -100,
                _ => (i * 5) % classes as i64,
            })
            .collect();
        let plain: Vec<i64> = targets.iter().map(|&t| t.max(0)).collect();
        let logits = randn(device, &[rows, classes])?.mul_scalar(3.0)?;
        let l = values(&logits);
        for (name, t, ignore) in [
            ("no ignored class", &plain, None),
            ("ignoring -100", &targets, Some(-100)),
            ("ignoring class 0", &plain, Some(0)),
        ] {
            let (loss, grad) = reference(&l, t, classes, ignore);
            let tt = ferry_tests::on(device, Tensor::from_slice(t, &[rows])?)?;
            for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
                let x = logits.to_dtype(dtype)?.with_grad()?;
                let ce = x.cross_entropy_with(&tt, ignore)?;
                assert_eq!(ce.dtype(), dtype);
                ce.backward()?;
                let what = format!("{rows}x{classes} {dtype} {name}");
                assert_rel(&format!("{what}: loss"), &values(&ce), &[loss], tol);
                assert_rel(
                    &format!("{what}: dlogits"),
                    &values(&x.grad().unwrap()),
                    &grad,
                    tol,
                );
            }
        }
    }
    Ok(())
}
device_test!(cross_entropy_values_and_gradients, values_and_gradients);

/// bf16 logits give a bf16 loss and gradient, accumulated in f32: within bf16's rounding of
/// the f64 values (8 bits of mantissa).
fn bf16_logits(device: Device) -> Result<()> {
    let (rows, classes) = (64, 500);
    let logits = randn(device, &[rows, classes])?.to_dtype(DType::BF16)?;
    let l = values(&logits);
    let t: Vec<i64> = (0..rows as i64)
        .map(|i| (i * 11) % classes as i64)
        .collect();
    let (loss, grad) = reference(&l, &t, classes, None);
    let x = logits.with_grad()?;
    let ce = x.cross_entropy(&ferry_tests::on(device, Tensor::from_slice(&t, &[rows])?)?)?;
    ce.backward()?;
    assert_eq!(
        (ce.dtype(), x.grad().unwrap().dtype()),
        (DType::BF16, DType::BF16)
    );
    assert_rel("bf16 loss", &values(&ce), &[loss], 1e-2);
    assert_rel("bf16 dlogits", &values(&x.grad().unwrap()), &grad, 1e-2);
    Ok(())
}
device_test!(cross_entropy_of_bf16_logits, bf16_logits);

/// Every row ignored: 0 / 0, NaN, as PyTorch gives; the gradient is zero.
fn every_row_ignored(device: Device) -> Result<()> {
    let x = randn(device, &[3, 4])?.to_dtype(DType::F32)?.with_grad()?;
    let t = ferry_tests::on(device, Tensor::from_slice(&[-100i64; 3], &[3])?)?;
    let ce = x.cross_entropy_with(&t, Some(-100))?;
    assert!(ce.item()?.is_nan());
    ce.backward()?;
    assert!(values(&x.grad().unwrap()).iter().all(|&g| g == 0.0));
    Ok(())
}
device_test!(cross_entropy_with_every_row_ignored, every_row_ignored);

/// The node keeps the logits, the targets and one f32 per row: for 256 x 1000 logits, 1 MB of
/// logits (which the caller holds anyway), 2 KiB of targets and 1 KiB of log-sum-exp, where
/// the log-softmax it used to keep took another 1 MB.
fn keeps_no_second_logits(device: Device) -> Result<()> {
    let (rows, classes) = (256, 1000);
    let x = randn(device, &[rows, classes])?
        .to_dtype(DType::F32)?
        .with_grad()?;
    let t: Vec<i64> = (0..rows as i64).map(|i| i % classes as i64).collect();
    let t = ferry_tests::on(device, Tensor::from_slice(&t, &[rows])?)?;
    let ce = x.cross_entropy(&t)?;
    let graph = ce.graph().expect("the loss is recorded");
    assert_eq!(
        graph.saved_bytes(),
        rows * classes * 4 + rows * 8 + rows * 4
    );
    Ok(())
}
device_test!(cross_entropy_keeps_no_second_logits, keeps_no_second_logits);

/// A target outside the classes is an error even beside an ignored class; the ignored class
/// itself may lie outside them.
#[test]
fn an_unignored_bad_target_is_still_an_error() -> Result<()> {
    let x = Tensor::randn(&[3, 4], DType::F32, Device::Cpu)?;
    let t = Tensor::from_slice(&[-100i64, 9, 1], &[3])?;
    let err = x
        .cross_entropy_with(&t, Some(-100))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("outside 0..4") && err.contains("one is 9"),
        "{err}"
    );
    let ok = Tensor::from_slice(&[-100i64, 3, 1], &[3])?;
    assert!(x.cross_entropy_with(&ok, Some(-100))?.item()?.is_finite());
    Ok(())
}
