//! Gradient clipping by global norm and by value, on each device: exact norms, scaled and
//! untouched gradients, non-finite norms reported (or refused), shared gradient tensors
//! scaled once, and arguments that name their fix.

use ferry::optim::{ClipOptions, clip_grad_norm, clip_grad_norm_with, clip_grad_value, grad_norm};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{assert_close, device_test, tensor, values};

/// An `f32` leaf of `p` whose gradient is `g` (also `f32`).
fn param(device: Device, p: &[f64], g: &[f64]) -> Result<Tensor> {
    let t = tensor(device, p, &[p.len()])?
        .to_dtype(DType::F32)?
        .with_grad()?;
    t.set_grad(Some(tensor(device, g, &[g.len()])?.to_dtype(DType::F32)?));
    Ok(t)
}

fn grad(p: &Tensor) -> Vec<f64> {
    values(&p.grad().expect("has a gradient"))
}

fn clips_by_the_global_norm(device: Device) -> Result<()> {
    let a = param(device, &[0.0, 0.0], &[3.0, 4.0])?;
    let b = param(device, &[0.0], &[12.0])?;
    let none = tensor(device, &[5.0], &[1])?.with_grad()?; // no gradient: skipped
    // √(9 + 16 + 144) = 13, exactly in f32.
    assert_eq!(grad_norm([&a, &b, &none])?, 13.0);
    let total = clip_grad_norm([&a, &b, &none], 6.5)?;
    assert_eq!(total, 13.0);
    let coef = 6.5 / (13.0 + 1e-6);
    assert_close(&grad(&a), &[3.0 * coef, 4.0 * coef], 1e-6);
    assert_close(&grad(&b), &[12.0 * coef], 1e-6);
    assert!(none.grad().is_none());
    assert!((grad_norm([&a, &b])? - 6.5).abs() < 1e-5);
    assert_eq!(a.grad().unwrap().dtype(), DType::F32);
    assert_eq!(a.grad().unwrap().device(), device);

    // At or below max_norm nothing changes: the very same gradient tensor stays.
    let before = a.grad().unwrap();
    let total = clip_grad_norm([&a, &b], 100.0)?;
    assert!((total - 6.5).abs() < 1e-5);
    assert!(a.grad().unwrap().shares_storage(&before));
    Ok(())
}
device_test!(clips_by_the_global_norm, clips_by_the_global_norm);

fn mixed_dtypes_and_empty_sets(device: Device) -> Result<()> {
    // An f64 gradient beside an f32 one: summed in f64.
    let a = param(device, &[0.0], &[1.0])?;
    let b = tensor(device, &[0.0, 0.0], &[2])?.with_grad()?;
    b.set_grad(Some(tensor(device, &[2.0, 2.0], &[2])?));
    assert_eq!(grad_norm([&a, &b])?, 3.0);
    // bf16 gradients are squared and summed in f32.
    let c = tensor(device, &[0.0, 0.0], &[2])?
        .to_dtype(DType::BF16)?
        .with_grad()?;
    c.set_grad(Some(
        tensor(device, &[6.0, 8.0], &[2])?.to_dtype(DType::BF16)?,
    ));
    assert_eq!(grad_norm([&c])?, 10.0);
    let total = clip_grad_norm([&c], 5.0)?;
    assert_eq!(total, 10.0);
    assert_eq!(c.grad().unwrap().dtype(), DType::BF16);
    assert_close(&grad(&c), &[3.0, 4.0], 0.02);
    // Nothing at all: a norm of 0 and nothing to do.
    assert_eq!(clip_grad_norm(Vec::<Tensor>::new(), 1.0)?, 0.0);
    Ok(())
}
device_test!(mixed_dtypes_and_empty_sets, mixed_dtypes_and_empty_sets);

fn non_finite_norms_are_reported_and_leave_the_gradients(device: Device) -> Result<()> {
    for bad in [f64::INFINITY, f64::NAN] {
        let a = param(device, &[0.0, 0.0], &[bad, 1.0])?;
        let b = param(device, &[0.0], &[2.0])?;
        let total = clip_grad_norm([&a, &b], 1.0)?;
        assert!(!total.is_finite(), "norm with {bad}: {total}");
        assert_eq!(grad(&b), [2.0], "left as it was");
        let err = clip_grad_norm_with(
            [&a, &b],
            1.0,
            ClipOptions {
                error_if_nonfinite: true,
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("infinity or a NaN") && err.contains("skip this step"),
            "{err}"
        );
        assert_eq!(grad(&b), [2.0]);
    }
    Ok(())
}
device_test!(
    non_finite_norms_are_reported_and_leave_the_gradients,
    non_finite_norms_are_reported_and_leave_the_gradients
);

/// The gradient of `a + b` may reach both leaves as one tensor; each must be scaled once.
fn a_gradient_shared_by_two_leaves_is_scaled_once(device: Device) -> Result<()> {
    let a = param(device, &[1.0, 2.0], &[0.0, 0.0])?;
    let b = param(device, &[3.0, 4.0], &[0.0, 0.0])?;
    a.set_grad(None);
    b.set_grad(None);
    a.add(&b)?.mul_scalar(2.0)?.sum()?.backward()?;
    assert_eq!((grad(&a), grad(&b)), (vec![2.0, 2.0], vec![2.0, 2.0]));
    let total = clip_grad_norm([&a, &b], 2.0)?;
    assert_eq!(total, 4.0);
    let coef = 2.0 / (4.0 + 1e-6);
    assert_close(&grad(&a), &[2.0 * coef, 2.0 * coef], 1e-6);
    assert_close(&grad(&b), &[2.0 * coef, 2.0 * coef], 1e-6);
    Ok(())
}
device_test!(
    a_gradient_shared_by_two_leaves_is_scaled_once,
    a_gradient_shared_by_two_leaves_is_scaled_once
);

fn clips_by_value_exactly(device: Device) -> Result<()> {
    let inf = f64::INFINITY;
    let a = param(device, &[0.0; 7], &[-3.0, -0.5, 0.25, 2.0, inf, -inf, 1.0])?;
    let b = param(device, &[0.0], &[0.75])?;
    clip_grad_value([&a, &b], 1.0)?;
    assert_eq!(grad(&a), [-1.0, -0.5, 0.25, 1.0, 1.0, -1.0, 1.0]);
    assert_eq!(grad(&b), [0.75]);
    assert_eq!(a.grad().unwrap().shape(), &[7]);
    assert_eq!(a.grad().unwrap().dtype(), DType::F32);
    // A 2-D, 0-dimensional and a bound of 0.
    let m = tensor(device, &[0.0; 4], &[2, 2])?.with_grad()?;
    m.set_grad(Some(tensor(device, &[5.0, -5.0, 0.1, -0.1], &[2, 2])?));
    let s = ferry_tests::on(device, Tensor::scalar(0.0f64))?.with_grad()?;
    s.set_grad(Some(ferry_tests::on(device, Tensor::scalar(-7.0f64))?));
    clip_grad_value([&m, &s], 0.0)?;
    assert_eq!(grad(&m), [0.0, 0.0, 0.0, 0.0]);
    assert_eq!(grad(&s), [0.0]);
    assert_eq!(m.grad().unwrap().shape(), &[2, 2]);
    Ok(())
}
device_test!(clips_by_value_exactly, clips_by_value_exactly);

#[test]
fn bad_bounds_name_the_fix() -> Result<()> {
    let a = param(Device::Cpu, &[0.0], &[1.0])?;
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let err = clip_grad_norm([&a], bad).unwrap_err().to_string();
        assert!(err.contains("finite number above 0"), "{err}");
    }
    for bad in [-1.0, f64::NAN] {
        let err = clip_grad_value([&a], bad).unwrap_err().to_string();
        assert!(err.contains("at least 0"), "{err}");
    }
    assert_eq!(grad(&a), [1.0], "errors change nothing");
    Ok(())
}
