use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{assert_close, device_test, randn, strides, tensor, values};

/// Gradient of `f` summed over its output, at `x`.
fn grad_of(device: Device, x: &[f64], f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Vec<f64>> {
    let leaf = tensor(device, x, &[x.len()])?.with_grad()?;
    f(&leaf)?.sum()?.backward()?;
    Ok(values(&leaf.grad().expect("the leaf was reached")))
}

fn hand_worked_derivatives(device: Device) -> Result<()> {
    let e = std::f64::consts::E;
    // d/dx x³ = 3x²
    assert_close(
        &grad_of(device, &[2.0, -1.0], |x| x.powf(3.0))?,
        &[12.0, 3.0],
        1e-12,
    );
    // d/dx (x·x·x) = 3x², through two muls and a shared leaf
    assert_close(
        &grad_of(device, &[2.0, -1.0], |x| x.mul(x)?.mul(x))?,
        &[12.0, 3.0],
        1e-12,
    );
    // d/dx eˣ = eˣ
    assert_close(
        &grad_of(device, &[1.0, 0.0], Tensor::exp)?,
        &[e, 1.0],
        1e-12,
    );
    // d/dx ln x = 1/x
    assert_close(
        &grad_of(device, &[2.0, 0.25], Tensor::log)?,
        &[0.5, 4.0],
        1e-12,
    );
    // d/dx √x = 1/(2√x)
    assert_close(
        &grad_of(device, &[4.0, 0.25], Tensor::sqrt)?,
        &[0.25, 1.0],
        1e-12,
    );
    // d/dx σ(x) = σ(1-σ): 1/4 at 0
    assert_close(&grad_of(device, &[0.0], Tensor::sigmoid)?, &[0.25], 1e-12);
    // d/dx tanh x = 1 - tanh²x: 1 at 0, 1 - tanh²(1) at 1
    assert_close(
        &grad_of(device, &[0.0, 1.0], Tensor::tanh)?,
        &[1.0, 1.0 - 1f64.tanh().powi(2)],
        1e-12,
    );
    // d/dx relu(x) = 1 for x > 0, else 0
    assert_close(
        &grad_of(device, &[-1.0, 2.0], Tensor::relu)?,
        &[0.0, 1.0],
        0.0,
    );
    // d/dx |x| = sign(x)
    assert_close(
        &grad_of(device, &[-3.0, 0.5], Tensor::abs)?,
        &[-1.0, 1.0],
        0.0,
    );
    // d/dx (-x) = -1;  d/dx 3x = 3;  d/dx (x + 5) = 1;  d/dx x/4 = 1/4
    assert_close(&grad_of(device, &[7.0], Tensor::neg)?, &[-1.0], 0.0);
    assert_close(
        &grad_of(device, &[7.0], |x| x.mul_scalar(3.0))?,
        &[3.0],
        0.0,
    );
    assert_close(
        &grad_of(device, &[7.0], |x| x.add_scalar(5.0))?,
        &[1.0],
        0.0,
    );
    assert_close(
        &grad_of(device, &[7.0], |x| x.div_scalar(4.0))?,
        &[0.25],
        0.0,
    );
    // d/dx mean(x) = 1/n
    assert_close(
        &grad_of(device, &[1.0, 2.0, 3.0, 4.0], |x| x.mean())?,
        &[0.25; 4],
        1e-15,
    );
    // d/dx max(x) = 1 at the maximum only
    assert_close(
        &grad_of(device, &[1.0, 5.0, 3.0], |x| x.max_axis(0, false))?,
        &[0.0, 1.0, 0.0],
        0.0,
    );
    // d/dx (1/x) via div: -1/x²
    assert_close(
        &grad_of(device, &[2.0], |x| tensor(device, &[1.0], &[])?.div(x))?,
        &[-0.25],
        1e-12,
    );
    Ok(())
}
device_test!(hand_worked, hand_worked_derivatives);

/// The triple loop matmul is tested against; `a` is [batch, m, k], `b` is [batch, k, n].
fn naive_matmul(a: &[f64], b: &[f64], batch: usize, m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; batch * m * n];
    for p in 0..batch {
        for i in 0..m {
            for j in 0..n {
                out[(p * m + i) * n + j] = (0..k)
                    .map(|l| a[(p * m + i) * k + l] * b[(p * k + l) * n + j])
                    .sum();
            }
        }
    }
    out
}

fn matmul_reference(device: Device) -> Result<()> {
    // Odd sizes, and one large enough for the multi-threaded path.
    for (batch, m, k, n) in [(1, 3, 4, 5), (3, 7, 1, 2), (2, 65, 70, 66)] {
        let (a, b) = (
            randn(device, &[batch, m, k])?,
            randn(device, &[batch, k, n])?,
        );
        let expected = naive_matmul(&values(&a), &values(&b), batch, m, k, n);
        assert_close(&values(&a.matmul(&b)?), &expected, 1e-10);
        // The same product from transposed storage: read in place, same numbers.
        let (at, bt) = (
            a.transpose(1, 2)?.contiguous()?.transpose(1, 2)?,
            b.transpose(1, 2)?.contiguous()?.transpose(1, 2)?,
        );
        assert!(k == 1 || (!at.is_contiguous() && !bt.is_contiguous()));
        assert_close(&values(&at.matmul(&bt)?), &expected, 1e-10);
    }
    // A broadcast batch: [3, 4] against [2, 4, 5] multiplies the same matrix into each batch.
    let (a, b) = (randn(device, &[3, 4])?, randn(device, &[2, 4, 5])?);
    let a2 = values(&a).repeat(2);
    assert_close(
        &values(&a.matmul(&b)?),
        &naive_matmul(&a2, &values(&b), 2, 3, 4, 5),
        1e-12,
    );
    // f32 agrees with the f64 reference to f32 precision.
    let (a, b) = (randn(device, &[5, 6])?, randn(device, &[6, 4])?);
    let product32 = a.to_dtype(DType::F32)?.matmul(&b.to_dtype(DType::F32)?)?;
    assert_close(
        &values(&product32),
        &naive_matmul(&values(&a), &values(&b), 1, 5, 6, 4),
        1e-5,
    );
    Ok(())
}
device_test!(matmul_against_triple_loop, matmul_reference);

fn reductions_reference(device: Device) -> Result<()> {
    let shape = [3, 4, 5];
    let x = randn(device, &shape)?;
    let data = values(&x);
    let st = strides(&shape);
    assert_close(&[x.sum()?.item()?], &[data.iter().sum::<f64>()], 1e-12);
    assert_close(
        &[x.mean()?.item()?],
        &[data.iter().sum::<f64>() / 60.0],
        1e-12,
    );
    for axis in 0..3 {
        let mut out_shape = shape.to_vec();
        out_shape.remove(axis);
        let (mut sums, mut maxima) = (Vec::new(), Vec::new());
        for rest in ferry_tests::indices(&out_shape) {
            let at = |j: usize| {
                let mut index = rest.clone();
                index.insert(axis, j);
                data[index.iter().zip(&st).map(|(i, s)| i * s).sum::<usize>()]
            };
            sums.push((0..shape[axis]).map(at).sum::<f64>());
            maxima.push((0..shape[axis]).map(at).fold(f64::NEG_INFINITY, f64::max));
        }
        let sum = x.sum_axis(axis as isize, false)?;
        assert_eq!(sum.shape(), out_shape.as_slice());
        assert_close(&values(&sum), &sums, 1e-12);
        let means: Vec<f64> = sums.iter().map(|s| s / shape[axis] as f64).collect();
        assert_close(&values(&x.mean_axis(axis as isize, true)?), &means, 1e-12);
        assert_close(&values(&x.max_axis(axis as isize, false)?), &maxima, 0.0);
    }
    // Long rows take the parallel path and accumulate in f64.
    let long = Tensor::ones(&[3, 40_000], DType::F32, device)?.mul_scalar(0.1)?;
    assert_close(&values(&long.sum_axis(1, false)?), &[4000.0; 3], 1e-6);
    assert_close(&[long.sum()?.item()?], &[12000.0], 1e-6);
    Ok(())
}
device_test!(reductions_against_naive_sums, reductions_reference);

fn argmax_ties(device: Device) -> Result<()> {
    let x = tensor(device, &[1.0, 3.0, 3.0, 2.0], &[4])?;
    assert_eq!(x.argmax(0, false)?.to_vec::<i64>()?, [1]); // the first of the two 3s
    let m = tensor(device, &[5.0, 1.0, 7.0, 5.0, 9.0, 7.0], &[2, 3])?;
    assert_eq!(m.argmax(0, false)?.to_vec::<i64>()?, [0, 1, 0]);
    assert_eq!(m.argmax(1, true)?.to_vec::<i64>()?, [2, 1]);
    assert_eq!(m.argmax(1, true)?.shape(), [2, 1]);
    assert_eq!(
        Tensor::zeros(&[3], DType::F64, device)?
            .argmax(-1, false)?
            .to_vec::<i64>()?,
        [0]
    );
    // The gradient of max goes to the first maximum only, like argmax.
    let leaf = x.with_grad()?;
    leaf.max_axis(0, false)?.backward()?;
    assert_eq!(values(&leaf.grad().unwrap()), [0.0, 1.0, 0.0, 0.0]);
    Ok(())
}
device_test!(argmax_picks_the_first_tie, argmax_ties);

fn elementwise_large(device: Device) -> Result<()> {
    // Above the parallel threshold: every chunk must land in its place.
    let n = 100_003;
    let x = Tensor::arange(0.0, n as f64, DType::F64, device)?;
    let y = x.mul_scalar(0.5)?.add(&x)?.neg()?.abs()?;
    let expected: Vec<f64> = (0..n).map(|i| 1.5 * i as f64).collect();
    assert_close(&values(&y), &expected, 0.0);
    let halves = x.mul_scalar(1e-5)?.exp()?.log()?.to_dtype(DType::F32)?;
    assert_close(
        &values(&halves),
        &(0..n).map(|i| i as f64 * 1e-5).collect::<Vec<_>>(),
        1e-6,
    );
    Ok(())
}
device_test!(large_elementwise_matches, elementwise_large);
