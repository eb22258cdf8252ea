//! The fused ops of a training step against the same math composed in f64: linear layers (one
//! cuBLASLt product with the bias and ReLU in its epilogue on a GPU), cross-entropy's fused
//! kernels with the targets checked on the device, softmax's backward kernel, column sums,
//! Adam's vectorized pass, and the kernel profiler. Each runs on both devices.

use ferry_cuda::Profiling;
use ferry_tensor::ops::optim::AdamStep;
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{device_test, randn, values};

/// ‖a - e‖ / ‖e‖ below `tol`.
pub(crate) fn assert_rel(what: &str, a: &[f64], e: &[f64], tol: f64) {
    assert_eq!(a.len(), e.len(), "{what}: lengths differ");
    let err: f64 = a
        .iter()
        .zip(e)
        .map(|(a, e)| (a - e).powi(2))
        .sum::<f64>()
        .sqrt();
    let norm: f64 = e.iter().map(|e| e * e).sum::<f64>().sqrt().max(1e-30);
    assert!(
        err / norm < tol,
        "{what}: relative error {} >= {tol}",
        err / norm
    );
}

/// A test input: the base drawn at random, and the view of it the op is given.
type View = fn(&Tensor) -> Result<Tensor>;

/// `linear` and `linear_relu` in f32 (fused on a GPU) against f64 (composed), values and the
/// gradients of input, weight and bias: a matrix input and a 3-D one, contiguous, transposed,
/// at an offset and strided, with the weight as it is and as a transposed view.
fn linear_matches_composed(device: Device) -> Result<()> {
    let inputs: [(Vec<usize>, View); 5] = [
        (vec![37, 29], |t| Ok(t.clone())),
        (vec![3, 5, 29], |t| Ok(t.clone())),
        (vec![29, 37], |t| t.t()),
        (vec![40, 29], |t| t.narrow(0, 3, 37)),
        (vec![3, 5, 40], |t| t.narrow(2, 4, 29)),
    ];
    let weights: [(Vec<usize>, View); 2] =
        [(vec![19, 29], |t| Ok(t.clone())), (vec![29, 19], |t| t.t())];
    for ((base, view), (wbase, wview)) in inputs
        .iter()
        .flat_map(|i| weights.iter().map(move |w| (i, w)))
    {
        let x64 = randn(device, base)?;
        let w64 = randn(device, wbase)?;
        let b64 = randn(device, &[19])?;
        let shape = view(&x64)?.shape().to_vec();
        let mut out_shape = shape.clone();
        *out_shape.last_mut().unwrap() = 19;
        let g64 = randn(device, &out_shape)?;
        for relu in [false, true] {
            let run = |dtype: DType| -> Result<Vec<Vec<f64>>> {
                let x = x64.to_dtype(dtype)?.with_grad()?;
                let w = w64.to_dtype(dtype)?.with_grad()?;
                let b = b64.to_dtype(dtype)?.with_grad()?;
                let (xv, wv) = (view(&x)?, wview(&w)?);
                let y = if relu {
                    xv.linear_relu(&wv, Some(&b))?
                } else {
                    xv.linear(&wv, Some(&b))?
                };
                assert_eq!(y.shape(), &out_shape[..]);
                y.mul(&g64.to_dtype(dtype)?)?.sum()?.backward()?;
                Ok(vec![
                    values(&y),
                    values(&x.grad().unwrap()),
                    values(&w.grad().unwrap()),
                    values(&b.grad().unwrap()),
                ])
            };
            let (exact, got) = (run(DType::F64)?, run(DType::F32)?);
            for (what, (a, e)) in ["y", "dx", "dweight", "dbias"]
                .iter()
                .zip(got.iter().zip(&exact))
            {
                assert_rel(
                    &format!("{base:?} as {shape:?}, weight {wbase:?} relu={relu} {what}"),
                    a,
                    e,
                    1e-5,
                );
            }
        }
    }
    // Without a bias, and shapes that do not fit: the same errors on both paths.
    let x = randn(device, &[4, 3])?.to_dtype(DType::F32)?;
    let w = randn(device, &[2, 3])?.to_dtype(DType::F32)?;
    assert_eq!(x.linear(&w, None)?.shape(), &[4, 2]);
    let wrong = randn(device, &[2, 4])?.to_dtype(DType::F32)?;
    assert!(
        x.linear(&wrong, None)
            .unwrap_err()
            .to_string()
            .contains("in_features")
    );
    let bad_bias = randn(device, &[3])?.to_dtype(DType::F32)?;
    let err = x.linear(&w, Some(&bad_bias)).unwrap_err().to_string();
    assert!(err.contains("out_features"), "{err}");
    Ok(())
}
device_test!(linear_fused_and_composed_agree, linear_matches_composed);

/// Cross-entropy through its fused kernels: value and gradient against f64 composed by hand.
fn cross_entropy_matches_by_hand(device: Device) -> Result<()> {
    let (rows, classes) = (300, 13);
    let logits64 = randn(device, &[rows, classes])?;
    let targets: Vec<i64> = (0..rows as i64).map(|i| (i * 7) % classes as i64).collect();
    let t = ferry_tests::on(device, Tensor::from_slice(&targets, &[rows])?)?;
    let l = values(&logits64);
    let mut loss = 0.0;
    let mut grad = vec![0.0; rows * classes];
    for r in 0..rows {
        let row = &l[r * classes..(r + 1) * classes];
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        loss -= (row[targets[r] as usize] - lse) / rows as f64;
        for c in 0..classes {
            let hot = if c == targets[r] as usize { 1.0 } else { 0.0 };
            grad[r * classes + c] = ((row[c] - lse).exp() - hot) / rows as f64;
        }
    }
    let x = logits64.to_dtype(DType::F32)?.with_grad()?;
    let ce = x.cross_entropy(&t)?;
    ce.backward()?;
    assert_rel("loss", &values(&ce), &[loss], 1e-6);
    assert_rel("dlogits", &values(&x.grad().unwrap()), &grad, 1e-5);
    Ok(())
}
device_test!(
    cross_entropy_value_and_gradient,
    cross_entropy_matches_by_hand
);

/// A bad target on the GPU: the loss is NaN at once, and the error (naming the range and the
/// fix) comes from a later call, here the synchronization that reads the loss; the step itself
/// never waited. The device is usable again afterwards.
#[test]
#[ignore = "needs a CUDA device"]
fn cross_entropy_reports_a_bad_target_from_the_device() {
    ferry_tests::run_on(Device::Cuda(0), |device| {
        let logits = randn(device, &[4, 3])?.to_dtype(DType::F32)?;
        let bad = ferry_tests::on(device, Tensor::from_slice(&[0i64, 7, 1, 2], &[4])?)?;
        let loss = logits.cross_entropy(&bad)?;
        let err = loss.item().unwrap_err().to_string();
        assert!(
            err.contains("cross_entropy") && err.contains("outside 0..3"),
            "{err}"
        );
        assert!(err.contains("one is 7"), "{err}");
        let good = ferry_tests::on(device, Tensor::from_slice(&[0i64, 1, 2, 2], &[4])?)?;
        assert!(logits.cross_entropy(&good)?.item()?.is_finite());
        let nan = logits.cross_entropy(&bad)?;
        let dev = ferry::memory::cuda::CudaDevice::get(0)?;
        assert!(dev.synchronize().is_err());
        assert!(logits.cross_entropy(&good)?.item()?.is_finite());
        drop(nan);
        Ok(())
    });
}

/// A bad target found in one thread is that thread's error only: another thread working on the
/// same GPU meanwhile (and synchronizing it) sees none, and the thread that queued the check
/// still gets it from its next read.
#[test]
#[ignore = "needs a CUDA device"]
fn a_device_check_reaches_the_thread_that_queued_it() {
    ferry_tests::run_on(Device::Cuda(0), |device| {
        let logits = randn(device, &[4, 3])?.to_dtype(DType::F32)?;
        let bad = ferry_tests::on(device, Tensor::from_slice(&[0i64, 7, 1, 2], &[4])?)?;
        let loss = logits.cross_entropy(&bad)?;
        let dev = ferry::memory::cuda::CudaDevice::get(0)?;
        std::thread::scope(|scope| {
            scope
                .spawn(|| -> Result<()> {
                    dev.synchronize()?;
                    let good =
                        ferry_tests::on(device, Tensor::from_slice(&[0i64, 1, 2, 2], &[4])?)?;
                    assert!(logits.cross_entropy(&good)?.item()?.is_finite());
                    Ok(())
                })
                .join()
                .expect("the other thread ran")
        })?;
        let err = loss.item().unwrap_err().to_string();
        assert!(err.contains("outside 0..3"), "{err}");
        Ok(())
    });
}

/// Softmax's fused backward (GPU) against the composed one in f64, both forms.
fn softmax_backward_matches(device: Device) -> Result<()> {
    let x64 = randn(device, &[50, 77])?;
    let g64 = randn(device, &[50, 77])?;
    for log in [false, true] {
        let run = |dtype: DType| -> Result<Vec<f64>> {
            let x = x64.to_dtype(dtype)?.with_grad()?;
            let y = if log {
                x.log_softmax(1)?
            } else {
                x.softmax(1)?
            };
            y.mul(&g64.to_dtype(dtype)?)?.sum()?.backward()?;
            Ok(values(&x.grad().unwrap()))
        };
        assert_rel(
            &format!("log={log}"),
            &run(DType::F32)?,
            &run(DType::F64)?,
            1e-5,
        );
    }
    Ok(())
}
device_test!(softmax_backward_kernel, softmax_backward_matches);

/// Sums down columns, long and short, with leading axes: the tiled kernel against f64 by hand.
fn column_sums_match(device: Device) -> Result<()> {
    for (outer, len, inner) in [(1, 1024, 4096), (3, 40, 33), (2, 31, 5), (1, 2000, 10)] {
        let x = randn(device, &[outer, len, inner])?;
        let v = values(&x);
        let mut want = vec![0.0; outer * inner];
        for o in 0..outer {
            for j in 0..len {
                for i in 0..inner {
                    want[o * inner + i] += v[(o * len + j) * inner + i];
                }
            }
        }
        let got = values(&x.to_dtype(DType::F32)?.sum_axis(1, false)?);
        assert_rel(&format!("{outer}x{len}x{inner}"), &got, &want, 1e-6);
    }
    Ok(())
}
device_test!(column_sums, column_sums_match);

/// Adam's step on a parameter whose length is not a multiple of four (the vectorized pass and
/// its tail) and on views at odd offsets (the element-wise pass), against f64.
fn adam_step_matches(device: Device) -> Result<()> {
    let step = AdamStep {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        bias_correction1: 0.1,
        bias_correction2: 0.001,
        decoupled: 0,
        pad: 0,
    };
    let n = 4099;
    let base: Vec<Tensor> = (0..4)
        .map(|_| randn(device, &[n + 1]))
        .collect::<Result<_>>()?;
    for offset in [0, 1] {
        let run = |dtype: DType| -> Result<Vec<Vec<f64>>> {
            let t: Vec<Tensor> = base
                .iter()
                .map(|b| b.to_dtype(dtype)?.copy()?.narrow(0, offset, n))
                .collect::<Result<_>>()?;
            let (p, g, m, v) = (&t[0], &t[1], &t[2], &t[3].abs()?);
            let _no_grad = ferry_tensor::no_grad();
            p.adam_update(g, m, v, &step)?;
            Ok(vec![values(p), values(m), values(v)])
        };
        let (exact, got) = (run(DType::F64)?, run(DType::F32)?);
        for (what, (a, e)) in ["p", "m", "v"].iter().zip(got.iter().zip(&exact)) {
            assert_rel(&format!("offset {offset} {what}"), a, e, 1e-6);
        }
    }
    Ok(())
}
device_test!(adam_vectorized_and_elementwise, adam_step_matches);

/// The kernel profiler sees the products and kernels queued while it is on, by name, and
/// nothing after it is off.
#[test]
#[ignore = "needs a CUDA device"]
fn the_kernel_profiler_names_what_ran() {
    ferry_tests::run_on(Device::Cuda(0), |device| {
        let dev = ferry::memory::cuda::CudaDevice::get(0)?;
        let a = randn(device, &[64, 32])?.to_dtype(DType::F32)?;
        let b = randn(device, &[32, 16])?.to_dtype(DType::F32)?;
        dev.start_profile();
        a.matmul(&b)?.relu()?;
        let times = dev.stop_profile()?;
        a.matmul(&b)?;
        let gemm = times
            .iter()
            .find(|t| t.name.starts_with("gemm 16x64x32"))
            .expect("gemm timed");
        assert_eq!(gemm.launches, 1);
        assert!(gemm.total_ms > 0.0);
        assert!(
            times.iter().any(|t| t.name.starts_with("unary_")),
            "{times:?}"
        );
        assert!(dev.stop_profile()?.is_empty());
        Ok(())
    });
}
