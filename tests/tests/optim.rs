use ferry::CheckpointError;
use ferry::nn::{Linear, Module};
use ferry::optim::{Adam, AdamW, Optimizer, Sgd};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{assert_close, device_test, randn, tensor, values};

/// A leaf `p` with gradient `g` set directly (no backward needed for hand-worked updates).
fn param_with_grad(device: Device, p: &[f64], g: &[f64]) -> Result<Tensor> {
    let t = tensor(device, p, &[p.len()])?.with_grad()?;
    t.set_grad(Some(tensor(device, g, &[g.len()])?));
    Ok(t)
}

fn sgd_momentum_and_weight_decay(device: Device) -> Result<()> {
    let p = param_with_grad(device, &[1.0, -2.0], &[0.5, 1.0])?;
    let mut opt = Sgd::new([p.clone()], 0.1)?.momentum(0.9).weight_decay(0.1);
    opt.step()?;
    // g' = g + 0.1·p = [0.6, 0.8]; b = g'; p = p - 0.1·b = [0.94, -2.08]
    assert_close(&values(&p), &[0.94, -2.08], 1e-12);
    p.set_grad(Some(tensor(device, &[0.5, 1.0], &[2])?));
    opt.step()?;
    // g' = [0.5 + 0.094, 1 - 0.208] = [0.594, 0.792]; b = 0.9·[0.6, 0.8] + g' = [1.134, 1.512]
    // p = [0.94 - 0.1134, -2.08 - 0.1512]
    assert_close(&values(&p), &[0.8266, -2.2312], 1e-12);
    assert!(p.is_leaf() && p.requires_grad(), "the step kept the leaf");
    assert_eq!(p.device(), device);
    Ok(())
}
device_test!(sgd_momentum_and_weight_decay, sgd_momentum_and_weight_decay);

/// Adam against the textbook update written out in f64 scalars.
fn adam_matches_the_reference_update(device: Device) -> Result<()> {
    let (lr, b1, b2, eps) = (0.01, 0.9, 0.999, 1e-8);
    let p0 = [0.3, -1.2, 2.0];
    let grads = [[0.1, -0.4, 2.0], [-0.3, 0.2, 1.0], [0.05, 0.05, -0.5]];
    let p = tensor(device, &p0, &[3])?.with_grad()?;
    let mut opt = Adam::new([p.clone()], lr)?;
    let (mut want, mut m, mut v) = (p0.to_vec(), [0.0; 3], [0.0; 3]);
    for (t, g) in grads.iter().enumerate() {
        p.set_grad(Some(tensor(device, g, &[3])?));
        opt.step()?;
        let t = t as i32 + 1;
        for i in 0..3 {
            m[i] = b1 * m[i] + (1.0 - b1) * g[i];
            v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
            let (mh, vh) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
            want[i] -= lr * mh / (vh.sqrt() + eps);
        }
        assert_close(&values(&p), &want, 1e-10);
    }
    assert_eq!(opt.steps(), 3);
    Ok(())
}
device_test!(
    adam_matches_the_reference_update,
    adam_matches_the_reference_update
);

#[test]
fn adamw_decays_the_weights_apart_from_the_gradient() -> Result<()> {
    // A zero gradient moves Adam by 0/(0 + eps) = 0: only the decoupled decay remains.
    let p = param_with_grad(Device::Cpu, &[2.0, -4.0], &[0.0, 0.0])?;
    let mut opt = AdamW::new([p.clone()], 0.1)?.weight_decay(0.5);
    opt.step()?;
    assert_close(&values(&p), &[2.0 * 0.95, -4.0 * 0.95], 1e-12);
    // Adam's weight decay is an L2 term in the gradient instead: g = 0.5·p moves p by ~lr.
    let q = param_with_grad(Device::Cpu, &[2.0, -4.0], &[0.0, 0.0])?;
    let mut adam = Adam::new([q.clone()], 0.1)?.weight_decay(0.5);
    adam.step()?;
    assert_close(&values(&q), &[1.9, -3.9], 1e-6);
    Ok(())
}

#[test]
fn zero_grad_sets_gradients_to_none() -> Result<()> {
    let layer = Linear::new(3, 2, Device::Cpu)?;
    let opt = Sgd::new(layer.parameters(), 0.1)?;
    let x = Tensor::rand(&[4, 3], DType::F32, Device::Cpu)?;
    layer.forward(&x)?.sum()?.backward()?;
    assert!(layer.parameters().iter().all(|p| p.grad().is_some()));
    opt.zero_grad();
    assert!(layer.parameters().iter().all(|p| p.grad().is_none()));
    layer.forward(&x)?.sum()?.backward()?;
    opt.zero_grad_with(false)?;
    for p in layer.parameters() {
        assert!(values(&p.grad().unwrap()).iter().all(|&g| g == 0.0));
    }
    Ok(())
}

#[test]
fn optimizers_refuse_parameters_that_would_never_get_a_gradient() -> Result<()> {
    let w = Tensor::ones(&[2], DType::F32, Device::Cpu)?.with_grad()?;
    // A result of an op (what a recorded device move also is) is not a leaf.
    let not_leaf = w.mul_scalar(2.0)?;
    let err = Adam::new([not_leaf], 0.1).unwrap_err().to_string();
    assert!(
        err.contains("parameter 0") && err.contains("not a leaf"),
        "{err}"
    );
    let plain = Tensor::ones(&[2], DType::F32, Device::Cpu)?;
    assert!(
        Sgd::new([w, plain], 0.1)
            .unwrap_err()
            .to_string()
            .contains("parameter 1")
    );
    Ok(())
}

/// Three steps, save the state, restore it into a copy: the next step is identical.
fn optimizer_state_round_trips(device: Device) -> Result<()> {
    let layer = Linear::with_init(4, 3, ferry::nn::Init::XavierUniform, DType::F64, device)?;
    let x = randn(device, &[6, 4])?;
    let mut opt = Adam::new(layer.parameters(), 0.05)?;
    for _ in 0..3 {
        opt.zero_grad();
        layer.forward(&x)?.powf(2.0)?.mean()?.backward()?;
        opt.step()?;
    }
    let saved = opt.state_dict();
    assert!(saved.iter().any(|(k, _)| k == "1.exp_avg_sq"), "{saved:?}");

    let twin = Linear::from_tensors(
        layer.weight().detach().copy()?,
        Some(layer.bias().unwrap().detach().copy()?),
    )?;
    let mut twin_opt = Adam::new(twin.parameters(), 0.001)?;
    twin_opt.load_state_dict(&saved).unwrap();
    assert_eq!((twin_opt.steps(), twin_opt.learning_rate()), (3, 0.05));
    for (l, o) in [(&layer, &mut opt), (&twin, &mut twin_opt)] {
        o.zero_grad();
        l.forward(&x)?.powf(2.0)?.mean()?.backward()?;
        o.step()?;
    }
    assert_close(&values(layer.weight()), &values(twin.weight()), 1e-12);
    Ok(())
}
device_test!(optimizer_state_round_trips, optimizer_state_round_trips);

#[test]
fn a_bad_optimizer_state_is_refused_and_changes_nothing() -> Result<()> {
    let layer = Linear::new(4, 3, Device::Cpu)?;
    let mut opt = Adam::new(layer.parameters(), 0.01)?;
    layer
        .forward(&Tensor::rand(&[2, 4], DType::F32, Device::Cpu)?)?
        .sum()?
        .backward()?;
    opt.step()?;
    let good = opt.state_dict();
    let mut bad = good.clone();
    let (_, t) = bad.iter_mut().find(|(k, _)| k == "0.exp_avg").unwrap();
    *t = Tensor::zeros(&[3, 5], DType::F32, Device::Cpu)?;
    bad.retain(|(k, _)| k != "1.exp_avg_sq");
    let err = opt.load_state_dict(&bad).unwrap_err();
    let CheckpointError::Mismatch { what, problems } = &err else {
        panic!("{err}")
    };
    assert_eq!(*what, "optimizer");
    let keys: Vec<&str> = problems.iter().map(|p| p.key()).collect();
    assert_eq!(keys, ["0.exp_avg", "1.exp_avg_sq"], "{err}");
    assert!(err.to_string().contains("[3, 5]"), "{err}");
    assert_eq!(opt.steps(), 1);
    let now = opt.state_dict();
    for ((k, a), (_, b)) in good.iter().zip(&now) {
        assert_eq!(values(a), values(b), "{k} changed");
    }
    Ok(())
}
