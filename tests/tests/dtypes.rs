use ferry_memory::{bf16, f16};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{assert_close, device_test, randn, tensor, values};

/// Relative precision each half type keeps: 11 and 8 significant bits.
const HALF: [(DType, f64); 2] = [(DType::F16, 1e-3), (DType::BF16, 1e-2)];

fn round_trips(device: Device) -> Result<()> {
    // Values spread over several binades, inside f16's normal range.
    let x = randn(device, &[1000])?
        .mul_scalar(30.0)?
        .to_dtype(DType::F32)?;
    let original = values(&x);
    for (dtype, tol) in HALF {
        let half = x.to_dtype(dtype)?;
        assert_eq!(half.dtype(), dtype);
        assert_eq!(half.nbytes(), 2000);
        let back = half.to_dtype(DType::F32)?;
        for (a, e) in values(&back).iter().zip(&original) {
            assert!(
                (a - e).abs() <= tol * e.abs() + 1e-6,
                "{dtype}: {e} came back as {a}"
            );
        }
        // Converting again changes nothing: the values are now representable.
        assert_eq!(
            values(&back.to_dtype(dtype)?.to_dtype(DType::F32)?),
            values(&back)
        );
        // f64 goes through the generic path and rounds the same way.
        assert_eq!(
            values(&x.to_dtype(DType::F64)?.to_dtype(dtype)?),
            values(&half)
        );
    }
    Ok(())
}
device_test!(f32_half_round_trips_within_precision, round_trips);

fn exact_values(device: Device) -> Result<()> {
    // Representable in both half types: small integers, powers of two, their sums.
    let exact = [0.0, 1.0, -2.0, 0.5, 0.375, 1024.0, -96.0, 0.0078125, 3.0];
    let x = tensor(device, &exact, &[exact.len()])?.to_dtype(DType::F32)?;
    for (dtype, _) in HALF {
        assert_eq!(values(&x.to_dtype(dtype)?), exact, "{dtype}");
        assert_eq!(
            values(&x.to_dtype(dtype)?.to_dtype(DType::F32)?),
            exact,
            "{dtype}"
        );
    }
    // The host element types agree with the tensor's bits.
    let h = Tensor::from_slice(&[f16::from_f32(0.333), f16::from_f32(-7.5)], &[2])?;
    assert_eq!(
        h.to_vec::<f16>()?,
        [f16::from_f32(0.333), f16::from_f32(-7.5)]
    );
    let b = Tensor::from_slice(&[bf16::from_f32(1.0e30)], &[1])?;
    assert_eq!(
        b.to_dtype(DType::F32)?.to_vec::<f32>()?,
        [bf16::from_f32(1.0e30).to_f32()]
    );
    // Just above a tie, the deciding bits sit far below bf16's precision: they must still count.
    let above_tie = f32::from_bits((-31.5625f32).to_bits() + 1); // bf16 neighbours: -31.5, -31.625
    let t = Tensor::from_slice(&[above_tie], &[1])?;
    assert_eq!(values(&t.to_dtype(DType::BF16)?), [-31.625]);
    assert_eq!(
        values(&t.to_dtype(DType::F64)?.to_dtype(DType::BF16)?),
        [-31.625]
    );
    let wide = Tensor::from_slice(
        &[1.0 + 2f64.powi(-8) + 2f64.powi(-40), 1.0 + 2f64.powi(-8)],
        &[2],
    )?;
    assert_eq!(values(&wide.to_dtype(DType::BF16)?), [1.0078125, 1.0]); // above the tie; on it, to even
    // Beyond f16's range: infinity, as IEEE rounding says; bf16 keeps f32's range.
    let big = tensor(device, &[1.0e5], &[1])?.to_dtype(DType::F32)?;
    assert_eq!(values(&big.to_dtype(DType::F16)?), [f64::INFINITY]);
    assert_close(&values(&big.to_dtype(DType::BF16)?), &[1.0e5], 1e-2);
    Ok(())
}
device_test!(half_casts_exact_on_representable_values, exact_values);

fn ops_in_half(device: Device) -> Result<()> {
    let (a, b) = (
        randn(device, &[8, 16])?.to_dtype(DType::F32)?,
        randn(device, &[16, 4])?.to_dtype(DType::F32)?,
    );
    let c = randn(device, &[8, 16])?.to_dtype(DType::F32)?;
    for (dtype, tol) in HALF {
        // Inputs rounded once, so only the op's own rounding is measured against f32.
        let (ah, bh, ch) = (a.to_dtype(dtype)?, b.to_dtype(dtype)?, c.to_dtype(dtype)?);
        let (a32, b32, c32) = (
            ah.to_dtype(DType::F32)?,
            bh.to_dtype(DType::F32)?,
            ch.to_dtype(DType::F32)?,
        );
        let close = |half: &Tensor, full: &Tensor, tol: f64| {
            assert_eq!(half.dtype(), dtype);
            for (h, f) in values(half).iter().zip(values(full)) {
                assert!(
                    (h - f).abs() <= tol * (1.0 + f.abs()),
                    "{dtype}: {h} vs f32 {f}"
                );
            }
        };
        close(&ah.add(&ch)?, &a32.add(&c32)?, tol);
        close(&ah.mul(&ch)?, &a32.mul(&c32)?, tol);
        close(&ah.exp()?, &a32.exp()?, tol);
        // A 16-term dot product accumulates a few roundings.
        close(&ah.matmul(&bh)?, &a32.matmul(&b32)?, 8.0 * tol);
        close(
            &ah.t()?.t()?.matmul(&bh.t()?.contiguous()?.t()?)?,
            &a32.matmul(&b32)?,
            8.0 * tol,
        );
        close(&ah.sum_axis(1, false)?, &a32.sum_axis(1, false)?, 4.0 * tol);
        close(&ah.softmax(1)?, &a32.softmax(1)?, 4.0 * tol); // max, exp, sum, div: a few roundings
    }
    Ok(())
}
device_test!(half_ops_match_f32, ops_in_half);

fn half_gradients(device: Device) -> Result<()> {
    // Gradients flow in half precision: d/dx Σ x² = 2x, exact for these values.
    for (dtype, _) in HALF {
        let x = tensor(device, &[1.0, -2.5, 4.0], &[3])?
            .to_dtype(dtype)?
            .with_grad()?;
        x.mul(&x)?.sum()?.backward()?;
        let g = x.grad().unwrap();
        assert_eq!(g.dtype(), dtype);
        assert_eq!(values(&g), [2.0, -5.0, 8.0]);
    }
    Ok(())
}
device_test!(half_precision_gradients, half_gradients);

fn integer_casts(device: Device) -> Result<()> {
    let x = tensor(device, &[-1.7, 0.2, 2.9, 300.0], &[4])?;
    assert_eq!(x.to_dtype(DType::I64)?.to_vec::<i64>()?, [-1, 0, 2, 300]); // truncates toward 0
    assert_eq!(x.to_dtype(DType::U8)?.to_vec::<u8>()?, [0, 0, 2, 255]); // saturates
    assert_eq!(
        values(&x.to_dtype(DType::I64)?.to_dtype(DType::F32)?),
        [-1.0, 0.0, 2.0, 300.0]
    );
    let mask = x.gt(&tensor(device, &[0.0], &[])?)?;
    assert_eq!(mask.to_vec::<u8>()?, [0, 1, 1, 1]);
    assert_eq!(values(&mask.to_dtype(DType::F32)?.mean()?), [0.75]); // accuracy-style use
    Ok(())
}
device_test!(integer_and_mask_casts, integer_casts);
