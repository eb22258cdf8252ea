//! Mixed precision: the autocast scope (PyTorch's policy: products, linear layers, convolutions
//! and attention in bf16/f16 and answering in it, softmax, losses and norms in f32, mixed binary
//! ops widened to f32, f32 master weights; scopes that nest and stay on their thread) and the GradScaler (overflowing steps skipped
//! with the scale backed off, growth after the interval, exact unscaling, state dicts).

use ferry::amp::{GradScaler, autocast, autocast_dtype, is_autocast_enabled, without_autocast};
use ferry::graph::NodeHandle;
use ferry::nn::{Conv2d, Linear, Module};
use ferry::optim::{Optimizer, Sgd};
use ferry_tensor::{Conv2dOptions, DType, Device, Result, Tensor};
use ferry_tests::{assert_close, device_test, on, tensor, values};

/// The first `matmul` node reachable from `t`'s node, walking inputs.
fn find_matmul(node: &NodeHandle<Tensor>) -> Option<NodeHandle<Tensor>> {
    if node.meta().op == "matmul" {
        return Some(node.clone());
    }
    node.inputs().flatten().find_map(find_matmul)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    values(a)
        .iter()
        .zip(values(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// A Linear under bf16 autocast: f32 in, bf16 out (the product and the bias in bf16: the node and
/// the bytes it saves say so), f32 weights and gradients close to an f32 run.
fn linear_under_bf16_autocast(device: Device) -> Result<()> {
    let mut layer = Linear::new(16, 8, Device::Cpu)?;
    layer.to(device)?;
    let x = on(device, Tensor::randn(&[4, 16], DType::F32, Device::Cpu)?)?;
    let graph = layer.weight().graph().expect("a leaf has a graph");
    let base = graph.saved_bytes();

    let reference = layer.forward(&x)?;
    let saved_f32 = graph.saved_bytes() - base;
    reference.sum()?.backward()?;
    let ref_grad = layer.weight().grad().unwrap();
    layer.weight().set_grad(None);
    layer.bias().unwrap().set_grad(None);

    let y = autocast(DType::BF16, || layer.forward(&x))?;
    let saved_bf16 = graph.saved_bytes() - base;
    assert_eq!(y.dtype(), DType::BF16, "the layer answers in bf16");
    let node = y.node().expect("recorded");
    let product = find_op(node, "linear")
        .or_else(|| find_matmul(node))
        .expect("a product node");
    assert_eq!(product.meta().dtype, "bf16", "the product ran in bf16");
    // The product saves its input x for the weight's gradient: in bf16, half the bytes.
    assert_eq!(saved_f32, 4 * 16 * 4);
    assert_eq!(saved_bf16 * 2, saved_f32);
    // bf16 keeps 8 bits of mantissa: 16 products of |x| ~ 1, |w| < 0.62 are off by ~1e-2.
    let diff = max_abs_diff(&y, &reference);
    assert!(diff < 0.05, "bf16 product off by {diff}");

    y.to_dtype(DType::F32)?.sum()?.backward()?;
    let (w, b) = (layer.weight(), layer.bias().unwrap());
    assert_eq!(
        (w.dtype(), b.dtype()),
        (DType::F32, DType::F32),
        "master weights"
    );
    assert_eq!(w.grad().unwrap().dtype(), DType::F32);
    assert_eq!(b.grad().unwrap().dtype(), DType::F32);
    // Four rows of ones, summed in bf16 and cast back: exact.
    assert_eq!(values(&b.grad().unwrap()), [4.0; 8]);
    let diff = max_abs_diff(&w.grad().unwrap(), &ref_grad);
    assert!(diff < 0.05, "bf16 weight gradient off by {diff}");
    Ok(())
}
device_test!(linear_under_bf16_autocast, linear_under_bf16_autocast);

/// A Conv2d under bf16 autocast: f32 in, bf16 out (the convolution and its bias in bf16), f32
/// gradients close to an f32 run.
fn conv2d_under_bf16_autocast(device: Device) -> Result<()> {
    let options = Conv2dOptions::default().padding(1);
    let mut conv = Conv2d::with_options(3, 4, [3, 3], options, Device::Cpu)?;
    conv.to(device)?;
    let x = on(
        device,
        Tensor::randn(&[2, 3, 6, 5], DType::F32, Device::Cpu)?,
    )?;
    let reference = conv.forward(&x)?;
    reference.sum()?.backward()?;
    let ref_grad = conv.weight().grad().unwrap();
    conv.weight().set_grad(None);
    conv.bias().unwrap().set_grad(None);

    let y = autocast(DType::BF16, || conv.forward(&x))?;
    assert_eq!(y.dtype(), DType::BF16, "the convolution answers in bf16");
    // 27 products of |x| ~ 1 and |w| < 0.2 per output, with 8 bits of mantissa.
    let diff = max_abs_diff(&y, &reference);
    assert!(diff < 0.05, "bf16 convolution off by {diff}");
    assert!(diff > 0.0, "the convolution did not run in bf16");
    y.to_dtype(DType::F32)?.sum()?.backward()?;
    let (w, b) = (conv.weight(), conv.bias().unwrap());
    assert_eq!(w.grad().unwrap().dtype(), DType::F32);
    // Each bias entry sums its channel's 2 x 6 x 5 ones: 60 is exact in bf16 too.
    assert_eq!(b.grad().unwrap().dtype(), DType::F32);
    assert_eq!(values(&b.grad().unwrap()), [60.0; 4]);
    let diff = max_abs_diff(&w.grad().unwrap(), &ref_grad);
    let scale = values(&ref_grad).iter().fold(1.0f64, |m, v| m.max(v.abs()));
    assert!(
        diff < 2e-2 * scale,
        "bf16 weight gradient off by {diff} (scale {scale})"
    );
    Ok(())
}
device_test!(conv2d_under_bf16_autocast, conv2d_under_bf16_autocast);

/// The attention node reachable from `t`'s node, walking inputs.
fn find_op(node: &NodeHandle<Tensor>, op: &str) -> Option<NodeHandle<Tensor>> {
    if node.meta().op == op {
        return Some(node.clone());
    }
    node.inputs().flatten().find_map(|n| find_op(n, op))
}

/// Attention under bf16 autocast, as PyTorch runs `scaled_dot_product_attention`: f32 (and
/// mixed f32 / bf16) query, key and value attend in bf16 (on CUDA through the fused kernel,
/// which takes no f32) and answer in bf16, and the f32 inputs get f32 gradients close to an f32
/// run.
fn attention_under_bf16_autocast(device: Device) -> Result<()> {
    use ferry_tensor::AttentionOptions;
    let make = |shape: &[usize]| -> Result<Tensor> {
        on(device, Tensor::randn(shape, DType::F32, Device::Cpu)?)?.with_grad()
    };
    // Grouped-query: 4 query heads share 2 key/value heads.
    let (q, k, v) = (
        make(&[2, 4, 16, 32])?,
        make(&[2, 2, 16, 32])?,
        make(&[2, 2, 16, 32])?,
    );
    let causal = AttentionOptions {
        causal: true,
        ..AttentionOptions::default()
    };
    let reference = q.scaled_dot_product_attention(&k, &v, causal)?;
    let grads = |out: &Tensor| -> Result<Vec<Tensor>> {
        out.to_dtype(DType::F32)?.sum()?.backward()?;
        let grads = [&q, &k, &v].map(|t| t.grad().expect("a gradient"));
        for t in [&q, &k, &v] {
            t.set_grad(None);
        }
        Ok(grads.to_vec())
    };
    let ref_grads = grads(&reference)?;

    let y = autocast(DType::BF16, || {
        q.scaled_dot_product_attention(&k, &v, causal)
    })?;
    assert_eq!(y.dtype(), DType::BF16, "the attention answers in bf16");
    let node = find_op(y.node().expect("recorded"), "scaled_dot_product_attention")
        .expect("an attention node");
    assert_eq!(node.meta().dtype, "bf16", "the attention ran in bf16");
    // Weighted means of values ~ N(0, 1) with 8 bits of mantissa.
    let diff = max_abs_diff(&y, &reference);
    assert!(diff < 0.05, "bf16 attention off by {diff}");
    assert!(diff > 0.0, "the attention did not run in bf16");
    for (grad, reference) in grads(&y)?.iter().zip(&ref_grads) {
        assert_eq!(grad.dtype(), DType::F32);
        let scale = values(reference).iter().fold(1.0f64, |m, x| m.max(x.abs()));
        let diff = max_abs_diff(grad, reference);
        assert!(
            diff < 3e-2 * scale,
            "bf16 gradient off by {diff} (scale {scale})"
        );
    }

    // A bf16 value beside f32 query and key is taken as it is; outside a scope the dtypes
    // must agree.
    let v16 = v.detach().to_dtype(DType::BF16)?;
    let mixed = autocast(DType::BF16, || {
        q.scaled_dot_product_attention(&k, &v16, causal)
    })?;
    assert_eq!(mixed.dtype(), DType::BF16);
    assert!(max_abs_diff(&mixed, &reference) < 0.05);
    assert!(q.scaled_dot_product_attention(&k, &v16, causal).is_err());
    Ok(())
}
device_test!(attention_under_bf16_autocast, attention_under_bf16_autocast);

/// f16 scopes, backward inside a scope, operands already in the low precision, and what
/// stays untouched (f64 products, products outside any scope).
fn what_autocast_casts(device: Device) -> Result<()> {
    let a = on(device, Tensor::randn(&[3, 5], DType::F32, Device::Cpu)?)?.with_grad()?;
    let b = on(device, Tensor::randn(&[5, 2], DType::F32, Device::Cpu)?)?.with_grad()?;
    let half = autocast(DType::F16, || {
        let y = a.matmul(&b)?;
        let mm = find_matmul(y.node().unwrap()).unwrap();
        assert_eq!(mm.meta().dtype, "f16");
        // Backward inside the scope: the rules run as the forward left the dtypes.
        y.to_dtype(DType::F32)?.sum()?.backward()?;
        Ok(y)
    })?;
    assert_eq!(half.dtype(), DType::F16);
    assert_eq!(a.grad().unwrap().dtype(), DType::F32);
    assert_eq!(b.grad().unwrap().dtype(), DType::F32);
    // One operand already bf16: the other is cast to match, the product answers in bf16.
    let b16 = b.detach().to_dtype(DType::BF16)?;
    let mixed = autocast(DType::BF16, || a.matmul(&b16))?;
    assert_eq!(mixed.dtype(), DType::BF16);
    // Both bf16: nothing to cast, the product stays bf16.
    let a16 = a.detach().to_dtype(DType::BF16)?;
    assert_eq!(
        autocast(DType::BF16, || a16.matmul(&b16))?.dtype(),
        DType::BF16
    );
    // f64 is left alone.
    let a64 = a.detach().to_dtype(DType::F64)?;
    let b64 = b.detach().to_dtype(DType::F64)?;
    let y64 = autocast(DType::BF16, || a64.matmul(&b64))?;
    assert_eq!(y64.dtype(), DType::F64);
    // Outside a scope an f32 × bf16 product is still the usual dtype error.
    assert!(a.matmul(&b16).is_err());
    // Values: the f16 product is within f16 rounding of the f32 one.
    let exact = a.detach().matmul(&b.detach())?;
    assert!(max_abs_diff(&half, &exact) < 0.02);
    Ok(())
}
device_test!(what_autocast_casts, what_autocast_casts);

/// The rest of the policy: softmax, log-softmax, cross-entropy and the norms take a bf16 input
/// in f32 (a norm's bf16 weight too) and answer in f32; a binary op of f32 and bf16 widens to
/// f32 (outside a scope, the dtype error); gradients come back in each leaf's own dtype.
fn autocast_keeps_reductions_in_f32_and_widens_mixed_ops(device: Device) -> Result<()> {
    let x16 = on(device, Tensor::randn(&[4, 6], DType::F32, Device::Cpu)?)?
        .to_dtype(DType::BF16)?
        .with_grad()?;
    let residual = on(device, Tensor::randn(&[4, 6], DType::F32, Device::Cpu)?)?.with_grad()?;
    let w16 = on(device, Tensor::ones(&[6], DType::F32, Device::Cpu)?)?
        .to_dtype(DType::BF16)?
        .with_grad()?;
    let targets = on(device, Tensor::zeros(&[4], DType::I64, Device::Cpu)?)?;
    let outs = autocast(DType::BF16, || {
        Ok([
            x16.softmax(-1)?,
            x16.log_softmax(-1)?,
            x16.cross_entropy(&targets)?,
            x16.layer_norm(&[6], Some(&w16), None, 1e-5)?,
            x16.rms_norm(Some(&w16), 1e-6)?,
            residual.add(&x16)?,
            x16.mul(&residual)?,
        ])
    })?;
    for out in &outs {
        assert_eq!(out.dtype(), DType::F32);
    }
    // The f32 result equals the op on the f32 copy.
    let x32 = x16.detach().to_dtype(DType::F32)?;
    assert_close(&values(&outs[0]), &values(&x32.softmax(-1)?), 1e-6);
    assert_close(
        &values(&outs[5]),
        &values(&residual.detach().add(&x32)?),
        1e-6,
    );
    assert!(
        residual.add(&x16).is_err(),
        "outside a scope, mixing is an error"
    );
    let mut total = outs[0].sum()?;
    for out in &outs[1..] {
        total = total.add(&out.sum()?)?;
    }
    total.backward()?;
    assert_eq!(x16.grad().unwrap().dtype(), DType::BF16);
    assert_eq!(w16.grad().unwrap().dtype(), DType::BF16);
    assert_eq!(residual.grad().unwrap().dtype(), DType::F32);
    Ok(())
}
device_test!(
    autocast_keeps_reductions_in_f32_and_widens_mixed_ops,
    autocast_keeps_reductions_in_f32_and_widens_mixed_ops
);

#[test]
fn scopes_nest_restore_and_stay_on_their_thread() -> Result<()> {
    assert_eq!(autocast_dtype(), None);
    autocast(DType::BF16, || {
        assert_eq!(autocast_dtype(), Some(DType::BF16));
        autocast(DType::F16, || {
            assert_eq!(autocast_dtype(), Some(DType::F16));
            Ok(())
        })?;
        assert_eq!(autocast_dtype(), Some(DType::BF16), "restored");
        without_autocast(|| {
            assert!(!is_autocast_enabled());
            let x = Tensor::ones(&[2, 2], DType::F32, Device::Cpu)?.with_grad()?;
            let y = x.matmul(&x)?;
            assert_eq!(find_matmul(y.node().unwrap()).unwrap().meta().dtype, "f32");
            Ok(())
        })?;
        std::thread::spawn(|| assert_eq!(autocast_dtype(), None, "per thread"))
            .join()
            .unwrap();
        // An error inside the scope still ends it.
        let failed: Result<()> = autocast(DType::F16, || {
            Tensor::ones(&[2, 3], DType::F32, Device::Cpu)?.matmul(&Tensor::ones(
                &[2, 3],
                DType::F32,
                Device::Cpu,
            )?)?;
            Ok(())
        });
        assert!(failed.is_err());
        assert_eq!(autocast_dtype(), Some(DType::BF16));
        Ok(())
    })?;
    assert_eq!(autocast_dtype(), None);
    let err = autocast(DType::F64, || Ok(())).unwrap_err().to_string();
    assert!(
        err.contains("bf16 or f16") && err.contains("DType::BF16"),
        "{err}"
    );
    assert_eq!(autocast_dtype(), None);
    Ok(())
}

/// A parameter `[1, 2]` (f32) and an SGD of rate 1 over it.
fn sgd_param(device: Device) -> Result<(Tensor, Sgd)> {
    let p = tensor(device, &[1.0, 2.0], &[2])?
        .to_dtype(DType::F32)?
        .with_grad()?;
    let opt = Sgd::new([p.clone()], 1.0)?;
    Ok((p, opt))
}

fn set_grad(p: &Tensor, g: &[f64]) -> Result<()> {
    p.set_grad(Some(
        tensor(p.device(), g, &[g.len()])?.to_dtype(p.dtype())?,
    ));
    Ok(())
}

fn an_overflow_skips_the_step_and_backs_off(device: Device) -> Result<()> {
    for bad in [f64::INFINITY, f64::NEG_INFINITY, f64::NAN] {
        let (p, mut opt) = sgd_param(device)?;
        let mut scaler = GradScaler::new().init_scale(1024.0)?;
        set_grad(&p, &[bad, 1.0])?;
        assert!(!scaler.step(&mut opt)?, "a step with {bad} must be skipped");
        assert_eq!(scaler.found_inf(), Some(true));
        assert_eq!(values(&p), [1.0, 2.0], "parameters untouched");
        assert_eq!(opt.steps(), 0, "the optimizer did not step");
        scaler.update()?;
        assert_eq!(scaler.scale_factor(), 512.0, "halved");
        assert_eq!(scaler.growth_tracker(), 0);
        assert_eq!(scaler.found_inf(), None, "a new iteration");
    }
    Ok(())
}
device_test!(
    an_overflow_skips_the_step_and_backs_off,
    an_overflow_skips_the_step_and_backs_off
);

fn clean_steps_unscale_exactly_and_grow_after_the_interval(device: Device) -> Result<()> {
    let (p, mut opt) = sgd_param(device)?;
    let mut scaler = GradScaler::new().init_scale(8.0)?.growth_interval(3)?;
    let mut want = [1.0, 2.0];
    let mut scales = Vec::new();
    for i in 0..7 {
        let s = scaler.scale_factor();
        if i == 4 {
            set_grad(&p, &[f64::NAN, 0.0])?; // one overflow in the middle
        } else {
            set_grad(&p, &[0.5 * s, 0.25 * s])?; // as a backward of the scaled loss gives
        }
        let stepped = scaler.step(&mut opt)?;
        assert_eq!(stepped, i != 4);
        if stepped {
            assert_eq!(values(&p.grad().unwrap()), [0.5, 0.25], "unscaled exactly");
            want = [want[0] - 0.5, want[1] - 0.25];
        }
        assert_eq!(values(&p), want);
        scaler.update()?;
        scales.push((scaler.scale_factor(), scaler.growth_tracker()));
    }
    // Three clean steps double the scale; the overflow halves it and restarts the count.
    assert_eq!(
        scales,
        [
            (8.0, 1),
            (8.0, 2),
            (16.0, 0),
            (16.0, 1),
            (8.0, 0),
            (8.0, 1),
            (8.0, 2)
        ]
    );
    assert_eq!(opt.steps(), 6);
    Ok(())
}
device_test!(
    clean_steps_unscale_exactly_and_grow_after_the_interval,
    clean_steps_unscale_exactly_and_grow_after_the_interval
);

/// The whole loop: an f16 autocast forward, the scaled loss's backward, unscale, step.
fn f16_training_with_loss_scaling(device: Device) -> Result<()> {
    let mut layer = Linear::new(4, 1, Device::Cpu)?;
    layer.to(device)?;
    let mut opt = Sgd::new(layer.parameters(), 0.05)?;
    let mut scaler = GradScaler::new();
    let x = on(device, Tensor::randn(&[32, 4], DType::F32, Device::Cpu)?)?;
    let target = x.sum_axis(-1, true)?; // y = Σ x, reachable with w = 1, b = 0
    let (mut losses, mut skipped) = (Vec::new(), 0u64);
    for _ in 0..30 {
        opt.zero_grad();
        let loss = autocast(DType::F16, || {
            layer.forward(&x)?.sub(&target)?.powf(2.0)?.mean()
        })?;
        assert_eq!(loss.dtype(), DType::F32);
        let scaled = scaler.scale(&loss)?;
        assert_eq!(scaled.item()?, loss.item()? * scaler.scale_factor());
        scaled.backward()?;
        if !scaler.step(&mut opt)? {
            skipped += 1;
        }
        scaler.update()?;
        losses.push(loss.item()?);
    }
    assert_eq!(layer.weight().grad().unwrap().dtype(), DType::F32);
    // The first f16 weight gradients, 2^16 times too large, can overflow f16 (max 65504):
    // those steps are skipped and each halves the scale (no growth in 30 steps).
    assert_eq!(opt.steps() + skipped, 30);
    assert!(opt.steps() >= 20, "{skipped} of 30 steps skipped");
    assert_eq!(scaler.scale_factor(), 65536.0 * 0.5f64.powi(skipped as i32));
    assert!(
        losses[29] < losses[0] * 0.5,
        "the loss fell from {} to {}",
        losses[0],
        losses[29]
    );
    Ok(())
}
device_test!(
    f16_training_with_loss_scaling,
    f16_training_with_loss_scaling
);

#[test]
fn misuse_and_bad_settings_name_the_fix() -> Result<()> {
    let (p, mut opt) = sgd_param(Device::Cpu)?;
    let mut scaler = GradScaler::new();
    let err = scaler.update().unwrap_err().to_string();
    assert!(err.contains("call step(optimizer)"), "{err}");
    set_grad(&p, &[1.0, 1.0])?;
    scaler.unscale(&opt)?;
    let err = scaler.unscale(&opt).unwrap_err().to_string();
    assert!(err.contains("already unscaled"), "{err}");
    assert!(scaler.step(&mut opt)?);
    let err = scaler.step(&mut opt).unwrap_err().to_string();
    assert!(err.contains("call update()"), "{err}");
    assert_eq!(opt.steps(), 1);
    scaler.update()?;

    assert!(GradScaler::new().init_scale(0.0).is_err());
    assert!(GradScaler::new().init_scale(f64::INFINITY).is_err());
    assert!(GradScaler::new().growth_factor(1.0).is_err());
    assert!(GradScaler::new().backoff_factor(1.0).is_err());
    assert!(GradScaler::new().backoff_factor(0.0).is_err());
    let err = GradScaler::new()
        .growth_interval(0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("at least 1"), "{err}");
    Ok(())
}

#[test]
fn state_dicts_round_trip() -> Result<()> {
    let (p, mut opt) = sgd_param(Device::Cpu)?;
    let mut scaler = GradScaler::new().init_scale(256.0)?;
    set_grad(&p, &[1.0, 1.0])?;
    scaler.step(&mut opt)?;
    scaler.update()?;
    let state = scaler.state_dict();
    let mut other = GradScaler::new();
    other.load_state_dict(&state).expect("a GradScaler's state");
    assert_eq!((other.scale_factor(), other.growth_tracker()), (256.0, 1));
    let bad = vec![("scale".to_string(), Tensor::scalar(256.0f64))];
    assert!(
        other.load_state_dict(&bad).is_err(),
        "growth_tracker missing"
    );
    let negative = vec![
        ("scale".to_string(), Tensor::scalar(-1.0f64)),
        ("growth_tracker".to_string(), Tensor::scalar(0i64)),
    ];
    assert!(other.load_state_dict(&negative).is_err());
    assert_eq!(other.scale_factor(), 256.0, "unchanged after errors");
    assert_close(&[scaler.scale_factor()], &[256.0], 0.0);
    Ok(())
}
