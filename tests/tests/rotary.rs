//! rotary_embedding: values against a direct computation over broadcast tables, numerical
//! gradients (of the input alone, the fused path on a GPU; of the tables too, the composed path;
//! second order), strided inputs, half precision against f64, what its node keeps, the Llama's
//! two placements agreeing, and errors that name the fix.

use ferry::nn::{RopeScaling, Rotary};
use ferry_tensor::gradcheck::{GradcheckOptions, gradgradcheck};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{assert_close, check_grad, device_test, randn, seed, values};

/// The rotation of `x` (`shape`, row-major values) by `cos` and `sin` read through `table_at`
/// (the table element of each element of `x`), directly: `y1 = x1 c1 - x2 s1`, `y2 = x2 c2 +
/// x1 s2` for each pair of a row's halves.
fn reference(
    x: &[f64],
    d: usize,
    cos: &[f64],
    sin: &[f64],
    table_at: impl Fn(usize) -> usize,
) -> Vec<f64> {
    let half = d / 2;
    let mut y = vec![0.0; x.len()];
    for row in (0..x.len()).step_by(d) {
        for j in 0..half {
            let (i1, i2) = (row + j, row + j + half);
            let (t1, t2) = (table_at(i1), table_at(i2));
            y[i1] = x[i1] * cos[t1] - x[i2] * sin[t1];
            y[i2] = x[i2] * cos[t2] + x[i1] * sin[t2];
        }
    }
    y
}

fn rotary_values_and_grads(device: Device) -> Result<()> {
    // [B, T, H, D] with [T, 1, D] tables, as the Llama rotates its projections.
    let (b, t, h, d) = (2, 3, 4, 8);
    let x = randn(device, &[b, t, h, d])?;
    let (cos, sin) = (randn(device, &[t, 1, d])?, randn(device, &[t, 1, d])?);
    let y = x.rotary_embedding(&cos, &sin)?;
    assert_eq!(y.shape(), [b, t, h, d]);
    // Element i of x is at position (i / (h d)) % t, column i % d.
    let at = |i: usize| ((i / (h * d)) % t) * d + i % d;
    let want = reference(&values(&x), d, &values(&cos), &values(&sin), at);
    assert_close(&values(&y), &want, 1e-12);

    check_grad(
        "rotary_embedding of the input",
        |v| v[0].rotary_embedding(&cos, &sin),
        [x.clone()],
    )?;
    check_grad(
        "rotary_embedding of the input and both tables",
        |v| v[0].rotary_embedding(&v[1], &v[2]),
        [x.clone(), cos.clone(), sin.clone()],
    )?;

    // A strided input: the heads moved out of [B, T, H, D] as a view, rotated by [T, D] tables.
    let heads = x.permute(&[0, 2, 1, 3])?;
    let (cos2, sin2) = (cos.reshape(&[t, d])?, sin.reshape(&[t, d])?);
    let y2 = heads.rotary_embedding(&cos2, &sin2)?;
    let at2 = |i: usize| ((i / d) % t) * d + i % d;
    let want2 = reference(&values(&heads), d, &values(&cos2), &values(&sin2), at2);
    assert_close(&values(&y2), &want2, 1e-12);
    // The same rotation either way round.
    assert_close(&values(&y2.permute(&[0, 2, 1, 3])?), &values(&y), 1e-12);
    check_grad(
        "rotary_embedding of a permuted view",
        |v| v[0].permute(&[0, 2, 1, 3])?.rotary_embedding(&cos2, &sin2),
        [x.clone()],
    )?;
    Ok(())
}
device_test!(rotary, rotary_values_and_grads);

fn rotary_second_order(device: Device) -> Result<()> {
    let (cos, sin) = (randn(device, &[5, 6])?, randn(device, &[5, 6])?);
    // Squared, so the second derivative is not zero.
    let f = |v: &[Tensor]| {
        let y = v[0].rotary_embedding(&cos, &sin)?;
        y.mul(&y)
    };
    let bad = gradgradcheck(
        f,
        &[randn(device, &[2, 5, 6])?],
        GradcheckOptions::default(),
    )?;
    assert!(bad.is_empty(), "{bad:#?} (seed {})", seed());
    Ok(())
}
device_test!(rotary_gradgrad, rotary_second_order);

/// f32, bf16 and f16 against f64: values and the input's gradient.
fn rotary_in_half_precision(device: Device) -> Result<()> {
    let (b, t, h, d) = (2, 64, 4, 64);
    let x64 = randn(device, &[b, t, h, d])?;
    let g64 = randn(device, &[b, t, h, d])?;
    let rotary = Rotary::new(d, 10_000.0, RopeScaling::None)?;
    let run = |dtype: DType| -> Result<[Vec<f64>; 2]> {
        let (cos, sin) = rotary.tables(0, t, dtype, device)?;
        let (cos, sin) = (cos.reshape(&[t, 1, d])?, sin.reshape(&[t, 1, d])?);
        let x = x64.to_dtype(dtype)?.with_grad()?;
        let y = x.rotary_embedding(&cos, &sin)?;
        assert_eq!(y.dtype(), dtype);
        y.mul(&g64.to_dtype(dtype)?)?.sum()?.backward()?;
        Ok([values(&y), values(&x.grad().expect("a gradient"))])
    };
    let exact = run(DType::F64)?;
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2), (DType::F16, 2e-3)] {
        let got = run(dtype)?;
        for (what, (a, e)) in ["y", "dx"].iter().zip(got.iter().zip(&exact)) {
            let err = a.iter().zip(e).map(|(a, e)| (a - e).powi(2)).sum::<f64>();
            let norm = e.iter().map(|e| e * e).sum::<f64>();
            let rel = (err / norm).sqrt();
            assert!(rel < tol, "{dtype} {what}: relative error {rel} >= {tol}");
        }
    }
    Ok(())
}
device_test!(rotary_dtypes, rotary_in_half_precision);

/// On a GPU the node keeps the two tables and nothing of the input's size; the gradient of
/// tables that want one flows through the composed ops.
fn rotary_keeps_only_the_tables(device: Device) -> Result<()> {
    let x = Tensor::randn(&[4, 16, 8, 64], DType::F32, device)?.with_grad()?;
    let cos = Tensor::randn(&[16, 1, 64], DType::F32, device)?;
    let sin = Tensor::randn(&[16, 1, 64], DType::F32, device)?;
    let y = x.rotary_embedding(&cos, &sin)?;
    if device != Device::Cpu {
        assert_eq!(y.graph().unwrap().saved_bytes(), 2 * 16 * 64 * 4);
    }
    y.sum()?.backward()?;
    assert_eq!(x.grad().expect("a gradient").shape(), x.shape());
    let cos = cos.with_grad()?;
    x.rotary_embedding(&cos, &sin)?.sum()?.backward()?;
    assert_eq!(
        cos.grad().expect("the table's gradient").shape(),
        cos.shape()
    );
    Ok(())
}
device_test!(rotary_saved, rotary_keeps_only_the_tables);

/// The Llama's placement (rotating `[B, T, H, D]` by `[T, 1, D]` tables, then moving the heads
/// out) and the textbook one (rotating `[B, H, T, D]` by `[T, D]`) agree through `Rotary`.
fn rotary_module_placements_agree(device: Device) -> Result<()> {
    let (b, t, h, d) = (2, 7, 3, 16);
    let rotary = Rotary::new(d, 10_000.0, RopeScaling::None)?;
    let (cos, sin) = rotary.tables(0, t, DType::F64, device)?;
    let x = randn(device, &[b, t, h, d])?;
    let inside = rotary
        .apply(&x, &cos.reshape(&[t, 1, d])?, &sin.reshape(&[t, 1, d])?)?
        .permute(&[0, 2, 1, 3])?;
    let outside = rotary.apply(&x.permute(&[0, 2, 1, 3])?, &cos, &sin)?;
    assert_close(&values(&inside), &values(&outside), 1e-12);
    Ok(())
}
device_test!(rotary_placements, rotary_module_placements_agree);

fn rotary_errors(device: Device) -> Result<()> {
    let says = |r: Result<Tensor>, fix: &str| {
        let msg = r.expect_err("an error was expected").to_string();
        assert!(msg.contains(fix), "{msg:?} does not say {fix:?}");
    };
    let table = Tensor::ones(&[3, 8], DType::F32, device)?;
    let x = Tensor::ones(&[2, 3, 8], DType::F32, device)?;
    let odd = Tensor::ones(&[2, 3, 7], DType::F32, device)?;
    says(odd.rotary_embedding(&table, &table), "even");
    let scalar = Tensor::ones(&[], DType::F32, device)?;
    says(scalar.rotary_embedding(&table, &table), "even");
    let long = Tensor::ones(&[4, 8], DType::F32, device)?;
    says(x.rotary_embedding(&long, &long), "broadcasts");
    says(x.rotary_embedding(&table, &long), "one shape");
    let wide = Tensor::ones(&[3, 8], DType::F64, device)?;
    says(x.rotary_embedding(&wide, &wide), "f64");
    let ids = Tensor::ones(&[2, 3, 8], DType::I64, device)?;
    says(ids.rotary_embedding(&table, &table), "float");
    Ok(())
}
device_test!(rotary_bad_input, rotary_errors);
