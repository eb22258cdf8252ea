//! Training with a gradient penalty, as WGAN-GP regularises its critic: the objective is
//! `loss + λ‖∂loss/∂x‖²`. The penalty is a function of a gradient, so training on it takes the
//! gradient of a gradient: `∂loss/∂x` is computed with `create_graph`, and the objective's
//! backward runs through that backward. The weights' gradient is checked once against central
//! differences of the objective, then a few SGD steps show the penalty shrink.
//!
//! `cargo run -p ferry --example gradient_penalty [-- cuda:0]`

use ferry::autograd::{GradOptions, grad};
use ferry::nn::mse;
use ferry::optim::{Optimizer, Sgd};
use ferry::prelude::*;

/// Weight of the penalty.
const LAMBDA: f64 = 50.0;

/// A two-layer network `tanh(x·w1 + b1)·w2`, and its mean squared error on `(x, y)`.
fn loss(params: &[Tensor], x: &Tensor, y: &Tensor) -> ferry::Result<Tensor> {
    let hidden = x.matmul(&params[0])?.add(&params[1])?.tanh()?;
    mse(&hidden.matmul(&params[2])?, y)
}

/// `(loss + λ‖∂loss/∂x‖², λ‖∂loss/∂x‖²)`.
fn objective(params: &[Tensor], x: &Tensor, y: &Tensor) -> ferry::Result<(Tensor, Tensor)> {
    let x = x.detach().with_grad()?; // differentiated, not trained
    let loss = loss(params, &x, y)?;
    let create = GradOptions {
        create_graph: true,
        ..GradOptions::default()
    };
    let dx = grad(&[&loss], &[&x], create)?
        .remove(0)
        .expect("the loss reads x");
    let penalty = dx.mul(&dx)?.sum()?.mul_scalar(LAMBDA)?;
    Ok((loss.add(&penalty)?, penalty))
}

/// `t` with `delta` added at flat index `at`.
fn bumped(t: &Tensor, at: usize, delta: f64) -> ferry::Result<Tensor> {
    let mut bump = vec![0.0f64; t.numel()];
    bump[at] = delta;
    t.detach()
        .add(&Tensor::from_vec(bump, t.shape())?.to(t.device())?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device: Device = std::env::args().nth(1).unwrap_or("cpu".into()).parse()?;
    ferry::manual_seed(0);
    let x = Tensor::randn(&[32, 2], DType::F64, device)?;
    // y = tanh(3·x₀)·x₁, a target steep in x.
    let (x0, x1) = (x.narrow(1, 0, 1)?, x.narrow(1, 1, 1)?);
    let y = x0.mul_scalar(3.0)?.tanh()?.mul(&x1)?;
    let params = [
        Tensor::randn(&[2, 16], DType::F64, device)?.with_grad()?,
        Tensor::zeros(&[16], DType::F64, device)?.with_grad()?,
        Tensor::randn(&[16, 1], DType::F64, device)?
            .mul_scalar(0.25)?
            .with_grad()?,
    ];

    // The weights' gradient, through the double backward, against central differences.
    let (total, _) = objective(&params, &x, &y)?;
    total.backward()?;
    let eps = 1e-6;
    let mut worst = 0.0f64;
    for (i, p) in params.iter().enumerate() {
        let analytical = p.grad().expect("every weight is used").to_vec::<f64>()?;
        for at in [0, p.numel() / 2, p.numel() - 1] {
            let at_shift = |delta: f64| -> ferry::Result<f64> {
                let mut shifted: Vec<Tensor> = params.iter().map(Tensor::detach).collect();
                shifted[i] = bumped(p, at, delta)?;
                objective(&shifted, &x, &y)?.0.item()
            };
            let numerical = (at_shift(eps)? - at_shift(-eps)?) / (2.0 * eps);
            let error = (analytical[at] - numerical).abs() / numerical.abs().max(1e-3);
            println!(
                "d objective / d param{i}[{at}]: backward {:+.8}, finite difference {numerical:+.8}",
                analytical[at]
            );
            worst = worst.max(error);
        }
    }
    println!("largest relative error {worst:.2e}");
    if worst > 1e-5 {
        return Err(format!("the weights' gradient disagrees: relative error {worst:.2e}").into());
    }

    let mut sgd = Sgd::new(params.clone(), 0.05)?;
    let mut penalties = Vec::new();
    for step in 0..=60 {
        sgd.zero_grad();
        let (total, penalty) = objective(&params, &x, &y)?;
        total.backward()?;
        sgd.step()?;
        penalties.push(penalty.item()?);
        if step % 10 == 0 {
            let loss = total.item()? - penalty.item()?;
            println!(
                "step {step:2}: loss {loss:.5}  penalty {:.5}",
                penalty.item()?
            );
        }
    }
    let (first, last) = (penalties[0], penalties[penalties.len() - 1]);
    if last > 0.5 * first {
        return Err(format!("the penalty did not shrink: {first:.5} -> {last:.5}").into());
    }
    println!("penalty {first:.5} -> {last:.5}");
    Ok(())
}
