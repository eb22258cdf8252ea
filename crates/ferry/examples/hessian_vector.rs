//! A Hessian-vector product by double backward: `Hv = ∇ₓ⟨∇ₓf(x), v⟩`, where the inner gradient
//! is taken with `create_graph` so that it can be differentiated again. The Hessian itself is
//! never formed. f is the Rosenbrock function; the product is checked against central
//! differences of the gradient, `(∇f(x + εv) − ∇f(x − εv)) / 2ε`.
//!
//! `cargo run -p ferry --example hessian_vector [-- cuda:0]`

use ferry::autograd::{GradOptions, grad};
use ferry::prelude::*;

/// `Σᵢ 100 (xᵢ₊₁ − xᵢ²)² + (1 − xᵢ)²`.
fn rosenbrock(x: &Tensor) -> ferry::Result<Tensor> {
    let n = x.shape()[0];
    let (head, tail) = (x.narrow(0, 0, n - 1)?, x.narrow(0, 1, n - 1)?);
    let valley = tail.sub(&head.mul(&head)?)?;
    let offset = head.neg()?.add_scalar(1.0)?;
    valley
        .mul(&valley)?
        .mul_scalar(100.0)?
        .add(&offset.mul(&offset)?)?
        .sum()
}

/// ∇f at `x`, with history when `create_graph` (so it can be differentiated again).
fn gradient(x: &Tensor, create_graph: bool) -> ferry::Result<Tensor> {
    let options = GradOptions {
        create_graph,
        ..GradOptions::default()
    };
    let f = rosenbrock(x)?;
    Ok(grad(&[&f], &[x], options)?
        .remove(0)
        .expect("f depends on x"))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device: Device = std::env::args().nth(1).unwrap_or("cpu".into()).parse()?;
    let at = Tensor::from_slice(&[-1.2f64, 1.0, 0.5, 2.0, -0.3], &[5])?.to(device)?;
    let v = Tensor::from_slice(&[1.0f64, -0.5, 0.25, 2.0, -1.0], &[5])?.to(device)?;

    let x = at.with_grad()?;
    let g = gradient(&x, true)?;
    let hv = grad(&[&g.mul(&v)?.sum()?], &[&x], GradOptions::default())?
        .remove(0)
        .expect("∇f depends on x");

    let eps = 1e-5;
    let shifted = |sign: f64| gradient(&at.add(&v.mul_scalar(sign * eps)?)?.with_grad()?, false);
    let finite = shifted(1.0)?.sub(&shifted(-1.0)?)?.div_scalar(2.0 * eps)?;

    println!("x               {:?}", at.to_vec::<f64>()?);
    println!("v               {:?}", v.to_vec::<f64>()?);
    println!("f(x)            {:.6}", rosenbrock(&at)?.item()?);
    println!("grad f(x)       {:?}", g.to_vec::<f64>()?);
    println!("Hv (backward)   {:?}", hv.to_vec::<f64>()?);
    println!("Hv (finite diff) {:?}", finite.to_vec::<f64>()?);

    let error = hv.sub(&finite)?.norm()? / hv.norm()?;
    println!("relative error  {error:.2e}");
    if error > 1e-6 {
        return Err(
            format!("Hv disagrees with finite differences: relative error {error:.2e}").into(),
        );
    }
    Ok(())
}
