//! conv2d, max_pool2d and avg_pool2d: values against naive direct loops, numerical gradients
//! (first and second order), what their nodes save, errors that name the fix, and the Conv2d /
//! MaxPool2d / AvgPool2d / Flatten modules.

use ferry::nn::{AvgPool2d, Conv2d, Flatten, MaxPool2d, Module};
use ferry_tensor::gradcheck::{GradcheckOptions, gradgradcheck};
use ferry_tensor::{Conv2dOptions, DType, Device, Result, Tensor};
use ferry_tests::{assert_close, check_grad, device_test, distinct, on, randn, seed, values};

/// Direct convolution of `x` `[n, c, h, w]` with `w` `[o, c/g, kh, kw]`, in f64.
fn naive_conv(
    x: &[f64],
    [n, c, h, wd]: [usize; 4],
    w: &[f64],
    [o, cg, kh, kw]: [usize; 4],
    bias: Option<&[f64]>,
    opt: Conv2dOptions,
) -> (Vec<f64>, [usize; 4]) {
    let [sh, sw] = opt.stride;
    let [ph, pw] = opt.padding;
    let [dh, dw] = opt.dilation;
    let oh = (h + 2 * ph - dh * (kh - 1) - 1) / sh + 1;
    let ow = (wd + 2 * pw - dw * (kw - 1) - 1) / sw + 1;
    let og = o / opt.groups;
    let mut out = vec![0.0; n * o * oh * ow];
    for b in 0..n {
        for oc in 0..o {
            let grp = oc / og;
            for y in 0..oh {
                for xx in 0..ow {
                    let mut s = bias.map_or(0.0, |bs| bs[oc]);
                    for ci in 0..cg {
                        let ic = grp * cg + ci;
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (y * sh + ky * dh) as isize - ph as isize;
                                let ix = (xx * sw + kx * dw) as isize - pw as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                let xv = x[((b * c + ic) * h + iy as usize) * wd + ix as usize];
                                s += xv * w[((oc * cg + ci) * kh + ky) * kw + kx];
                            }
                        }
                    }
                    out[((b * o + oc) * oh + y) * ow + xx] = s;
                }
            }
        }
    }
    (out, [n, o, oh, ow])
}

/// Direct pooling (max or mean with padding counted), in f64.
fn naive_pool(
    x: &[f64],
    [n, c, h, w]: [usize; 4],
    k: [usize; 2],
    s: [usize; 2],
    p: [usize; 2],
    max: bool,
) -> (Vec<f64>, [usize; 4]) {
    let oh = (h + 2 * p[0] - k[0]) / s[0] + 1;
    let ow = (w + 2 * p[1] - k[1]) / s[1] + 1;
    let mut out = Vec::new();
    for plane in 0..n * c {
        for y in 0..oh {
            for xx in 0..ow {
                let mut acc = if max { f64::NEG_INFINITY } else { 0.0 };
                for ky in 0..k[0] {
                    for kx in 0..k[1] {
                        let iy = (y * s[0] + ky) as isize - p[0] as isize;
                        let ix = (xx * s[1] + kx) as isize - p[1] as isize;
                        if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                            continue;
                        }
                        let v = x[plane * h * w + iy as usize * w + ix as usize];
                        acc = if max { acc.max(v) } else { acc + v };
                    }
                }
                out.push(if max { acc } else { acc / (k[0] * k[1]) as f64 });
            }
        }
    }
    (out, [n, c, oh, ow])
}

/// The option sets every conv test walks: plain, strided, padded, dilated, grouped, all at once.
fn option_cases() -> Vec<Conv2dOptions> {
    let d = Conv2dOptions::default();
    vec![
        d,
        d.stride(2),
        d.padding(1),
        d.dilation(2),
        d.groups(2),
        d.stride(2).padding(1).dilation(2).groups(2),
        Conv2dOptions {
            stride: [1, 2],
            padding: [2, 0],
            dilation: [1, 3],
            groups: 1,
        },
    ]
}

fn conv2d_matches_direct_convolution(device: Device) -> Result<()> {
    for opt in option_cases() {
        let (xs, ws) = ([2, 4, 7, 8], [6, 4 / opt.groups, 3, 2]);
        let x = randn(device, &xs)?;
        let w = randn(device, &ws)?;
        let b = randn(device, &[6])?;
        for bias in [None, Some(&b)] {
            let y = x.conv2d(&w, bias, opt)?;
            let bv = bias.map(values);
            let (want, shape) = naive_conv(&values(&x), xs, &values(&w), ws, bv.as_deref(), opt);
            assert_eq!(y.shape(), shape.as_slice(), "{opt:?}");
            assert_close(&values(&y), &want, 1e-12);
        }
        // f32 agrees with the f64 reference within f32 rounding.
        let y32 = x.to_dtype(DType::F32)?.conv2d(
            &w.to_dtype(DType::F32)?,
            Some(&b.to_dtype(DType::F32)?),
            opt,
        )?;
        let (want, _) = naive_conv(&values(&x), xs, &values(&w), ws, Some(&values(&b)), opt);
        assert_close(&values(&y32), &want, 1e-4);
    }
    // A transposed (non-contiguous) input reads the same as its contiguous copy.
    let xt = randn(device, &[1, 3, 6, 5])?.transpose(2, 3)?;
    let w = randn(device, &[2, 3, 2, 2])?;
    let a = xt.conv2d(&w, None, Conv2dOptions::default())?;
    let b = xt
        .contiguous()?
        .conv2d(&w, None, Conv2dOptions::default())?;
    assert_close(&values(&a), &values(&b), 0.0);
    Ok(())
}
device_test!(conv2d_values, conv2d_matches_direct_convolution);

fn conv2d_gradients(device: Device) -> Result<()> {
    for opt in option_cases() {
        let x = randn(device, &[2, 4, 6, 7])?;
        let w = randn(device, &[4, 4 / opt.groups, 2, 3])?;
        let b = randn(device, &[4])?;
        check_grad(
            &format!("conv2d {opt:?}"),
            |t| t[0].conv2d(&t[1], Some(&t[2]), opt),
            [x.clone(), w.clone(), b],
        )?;
        check_grad(
            &format!("conv2d without bias {opt:?}"),
            |t| t[0].conv2d(&t[1], None, opt),
            [x, w],
        )?;
    }
    Ok(())
}
device_test!(conv2d_grads, conv2d_gradients);

/// On a GPU with cuDNN, the convolution and both of its gradients are cuDNN's passes: they
/// agree with the CPU's im2col path (f32 within rounding, bf16 within its 8-bit mantissa over
/// the sums) and two runs give the same bits (the algorithms chosen are deterministic).
#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_passes_match_the_cpu_and_repeat_bitwise() -> Result<()> {
    assert!(
        ferry_cuda::cudnn_present(),
        "libcudnn did not load on this GPU machine: {:?}",
        ferry_cuda::cudnn_version()
    );
    let gpu = Device::Cuda(0);
    for opt in option_cases() {
        let x = randn(Device::Cpu, &[3, 4, 9, 8])?.to_dtype(DType::F32)?;
        let w = randn(Device::Cpu, &[6, 4 / opt.groups, 3, 2])?.to_dtype(DType::F32)?;
        let run = |device: Device, dtype: DType| -> Result<[Vec<f64>; 3]> {
            let xd = on(device, x.to_dtype(dtype)?)?.with_grad()?;
            let wd = on(device, w.to_dtype(dtype)?)?.with_grad()?;
            let y = xd.conv2d(&wd, None, opt)?;
            // A weighted sum, so every output position sends a different gradient back.
            let weights = Tensor::arange(0.0, y.numel() as f64, DType::F32, device)?
                .reshape(y.shape())?
                .div_scalar(y.numel() as f64)?
                .to_dtype(dtype)?;
            y.mul(&weights)?.sum()?.backward()?;
            let grad = |t: &Tensor| t.grad().map(|g| values(&g)).expect("a gradient");
            Ok([values(&y), grad(&xd), grad(&wd)])
        };
        let cpu = run(Device::Cpu, DType::F32)?;
        let first = run(gpu, DType::F32)?;
        let again = run(gpu, DType::F32)?;
        for (name, (c, g)) in ["y", "dx", "dw"].iter().zip(cpu.iter().zip(&first)) {
            let scale = c.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            for (a, b) in c.iter().zip(g) {
                assert!((a - b).abs() <= 1e-5 * scale, "{name} {opt:?}: {a} vs {b}");
            }
        }
        assert_eq!(first, again, "two f32 runs differ for {opt:?}");
        let bf16 = run(gpu, DType::BF16)?;
        for (name, (c, g)) in ["y", "dx", "dw"].iter().zip(cpu.iter().zip(&bf16)) {
            let scale = c.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            for (a, b) in c.iter().zip(g) {
                assert!(
                    (a - b).abs() <= 3e-2 * scale,
                    "bf16 {name} {opt:?}: {a} vs {b}"
                );
            }
        }
    }
    Ok(())
}

fn conv2d_second_order(device: Device) -> Result<()> {
    let options = GradcheckOptions::default();
    let opt = Conv2dOptions::default()
        .stride(2)
        .padding(1)
        .dilation(2)
        .groups(2);
    // Squared, so that the second derivative in x and w is not zero.
    let f = |t: &[Tensor]| {
        let y = t[0].conv2d(&t[1], Some(&t[2]), opt)?;
        y.mul(&y)
    };
    let inputs = [
        randn(device, &[1, 2, 5, 5])?,
        randn(device, &[2, 1, 2, 2])?,
        randn(device, &[2])?,
    ];
    let bad = gradgradcheck(f, &inputs, options)?;
    assert!(bad.is_empty(), "conv2d: {bad:#?} (seed {})", seed());
    let f = |t: &[Tensor]| {
        let y = t[0].avg_pool2d([2, 2], [1, 1], [1, 1])?;
        y.mul(&y)
    };
    let bad = gradgradcheck(f, &[randn(device, &[1, 2, 3, 4])?], options)?;
    assert!(bad.is_empty(), "avg_pool2d: {bad:#?} (seed {})", seed());
    Ok(())
}
device_test!(conv2d_grad_grad, conv2d_second_order);

fn pooling_values_and_gradients(device: Device) -> Result<()> {
    let shape = [2, 3, 7, 6];
    for (k, s, p) in [
        ([2, 2], [2, 2], [0, 0]),
        ([3, 3], [2, 2], [1, 1]),
        ([3, 2], [1, 2], [1, 0]),
        ([1, 1], [1, 1], [0, 0]),
    ] {
        // Distinct values: a finite-difference step never switches a window's maximum.
        let x = distinct(device, &shape)?;
        let xs = values(&x);
        let y = x.max_pool2d(k, s, p)?;
        let (want, out) = naive_pool(&xs, shape, k, s, p, true);
        assert_eq!(y.shape(), out.as_slice());
        assert_close(&values(&y), &want, 0.0);
        let y = x.avg_pool2d(k, s, p)?;
        let (want, out) = naive_pool(&xs, shape, k, s, p, false);
        assert_eq!(y.shape(), out.as_slice());
        assert_close(&values(&y), &want, 1e-12);
        check_grad(
            &format!("max_pool2d {k:?} {s:?} {p:?}"),
            |t| t[0].max_pool2d(k, s, p),
            [x.clone()],
        )?;
        check_grad(
            &format!("avg_pool2d {k:?} {s:?} {p:?}"),
            |t| t[0].avg_pool2d(k, s, p),
            [x],
        )?;
    }
    // Overlapping windows sharing one maximum: its gradient adds up (here 4 windows).
    let x = Tensor::from_slice(
        &[0.0f64, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 0.0],
        &[1, 1, 3, 3],
    )?;
    let x = ferry_tests::on(device, x)?.with_grad()?;
    x.max_pool2d([2, 2], [1, 1], [0, 0])?.sum()?.backward()?;
    let g = values(&x.grad().unwrap());
    assert_close(&g, &[0.0, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0], 0.0);
    // NaN wins its window.
    let x = ferry_tests::tensor(device, &[1.0, f64::NAN, 3.0, 2.0], &[1, 1, 2, 2])?;
    assert!(values(&x.max_pool2d([2, 2], [2, 2], [0, 0])?)[0].is_nan());
    // f32 too.
    let x32 = distinct(device, &shape)?.to_dtype(DType::F32)?;
    let (want, _) = naive_pool(&values(&x32), shape, [2, 2], [2, 2], [0, 0], true);
    assert_close(
        &values(&x32.max_pool2d([2, 2], [2, 2], [0, 0])?),
        &want,
        0.0,
    );
    Ok(())
}
device_test!(pooling, pooling_values_and_gradients);

fn conv_and_pool_saved_state(device: Device) -> Result<()> {
    let x = Tensor::randn(&[2, 3, 5, 5], DType::F32, device)?.with_grad()?;
    let w = Tensor::randn(&[4, 3, 3, 3], DType::F32, device)?.with_grad()?;
    let b = Tensor::randn(&[4], DType::F32, device)?.with_grad()?;
    let y = x.conv2d(&w, Some(&b), Conv2dOptions::default().padding(1))?;
    // The input (600 bytes) and the weight (432), not the 27-times-larger columns.
    assert_eq!(y.graph().unwrap().saved_bytes(), 600 + 432);
    drop(y);
    // Only the weight wants a gradient: the input alone is kept.
    let data = Tensor::randn(&[2, 3, 5, 5], DType::F32, device)?;
    let y = data.conv2d(&w, None, Conv2dOptions::default())?;
    assert_eq!(y.graph().unwrap().saved_bytes(), 600);
    drop(y);
    // Max pooling keeps one i64 index per output: 2·3·2·2 outputs, 8 bytes each.
    let p = x.max_pool2d([2, 2], [2, 2], [0, 0])?;
    assert_eq!(p.graph().unwrap().saved_bytes(), 2 * 3 * 2 * 2 * 8);
    drop(p);
    // Average pooling keeps nothing.
    let p = x.avg_pool2d([2, 2], [2, 2], [0, 0])?;
    assert_eq!(p.graph().unwrap().saved_bytes(), 0);
    Ok(())
}
device_test!(conv_saved_state, conv_and_pool_saved_state);

fn errors_name_the_fix(device: Device) -> Result<()> {
    let x = randn(device, &[1, 4, 5, 5])?;
    let w = randn(device, &[2, 4, 3, 3])?;
    let err = |r: Result<Tensor>| r.expect_err("an error was expected").to_string();
    let e = err(randn(device, &[4, 5, 5])?.conv2d(&w, None, Conv2dOptions::default()));
    assert!(e.contains("unsqueeze(0)"), "{e}");
    let e = err(x.conv2d(&w, None, Conv2dOptions::default().groups(3)));
    assert!(e.contains("groups = 3"), "{e}");
    let e = err(x.conv2d(
        &randn(device, &[2, 3, 3, 3])?,
        None,
        Conv2dOptions::default(),
    ));
    assert!(e.contains("in_channels / groups"), "{e}");
    let e = err(x.conv2d(&w, Some(&randn(device, &[3])?), Conv2dOptions::default()));
    assert!(e.contains("[out_channels]"), "{e}");
    let e = err(x.conv2d(
        &randn(device, &[2, 4, 7, 7])?,
        None,
        Conv2dOptions::default(),
    ));
    assert!(e.contains("more padding"), "{e}");
    let e = err(x.conv2d(&w, None, Conv2dOptions::default().stride(0)));
    assert!(e.contains(">= 1"), "{e}");
    let e = err(x.max_pool2d([2, 2], [2, 2], [2, 2]));
    assert!(e.contains("at most half the kernel"), "{e}");
    let e = err(x.to_dtype(DType::I64)?.avg_pool2d([2, 2], [2, 2], [0, 0]));
    assert!(e.contains("to_dtype"), "{e}");
    Ok(())
}
device_test!(conv_errors, errors_name_the_fix);

fn modules_train_a_small_cnn(device: Device) -> Result<()> {
    ferry::manual_seed(seed());
    let mut conv = Conv2d::with_options(1, 4, [3, 3], Conv2dOptions::default().padding(1), device)?;
    assert_eq!(
        Conv2d::new(2, 6, 5, device)?.weight().shape(),
        &[6, 2, 5, 5]
    );
    assert_eq!(conv.weight().shape(), &[4, 1, 3, 3]);
    let names: Vec<String> = conv
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["weight", "bias"]);
    let x = Tensor::randn(&[2, 1, 6, 6], DType::F32, device)?;
    let y = conv.forward(&x)?;
    assert_eq!(y.shape(), &[2, 4, 6, 6]);
    let m = MaxPool2d::new(2).forward(&y)?;
    assert_eq!(m.shape(), &[2, 4, 3, 3]);
    let a = AvgPool2d::new(3).forward(&m)?;
    assert_eq!(a.shape(), &[2, 4, 1, 1]);
    let f = Flatten.forward(&a)?;
    assert_eq!(f.shape(), &[2, 4]);
    f.sum()?.backward()?;
    assert!(conv.parameters().iter().all(|p| p.grad().is_some()));
    conv.to(device)?;
    // A bad channel count names the layer's expectation.
    let e = conv
        .forward(&Tensor::randn(&[1, 2, 6, 6], DType::F32, device)?)
        .expect_err("wrong channels")
        .to_string();
    assert!(e.contains("channels"), "{e}");
    Ok(())
}
device_test!(conv_modules, modules_train_a_small_cnn);
