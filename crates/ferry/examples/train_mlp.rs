//! A training loop as a ferry user writes it: a small MLP learns which of three noisy rings a
//! 2-D point lies on, with Adam, a leak check, and a checkpoint saved and restored.
//!
//! `cargo run --example train_mlp -p ferry [-- cuda:0]`

use ferry::checkpoint;
use ferry::debug::GraphWatch;
use ferry::nn::{self, Linear, ReLU, Sequential};
use ferry::optim::Adam;
use ferry::prelude::*;

/// `n` points on three rings of radius 1, 2, 3 (with noise), and their ring index.
fn rings(n: usize, device: Device) -> ferry::Result<(Tensor, Tensor)> {
    let u = Tensor::rand(&[n, 2], DType::F32, Device::Cpu)?.to_vec::<f32>()?;
    let (mut points, mut labels) = (Vec::new(), Vec::new());
    for (i, r) in u.chunks(2).enumerate() {
        let ring = (i % 3) as i64;
        let radius = ring as f32 + 1.0 + 0.3 * (r[1] - 0.5);
        let angle = r[0] * std::f32::consts::TAU;
        points.extend([radius * angle.cos(), radius * angle.sin()]);
        labels.push(ring);
    }
    let x = Tensor::from_vec(points, &[n, 2])?.to(device)?; // made on the host, moved once
    Ok((x, Tensor::from_vec(labels, &[n])?.to(device)?))
}

fn mlp(device: Device) -> ferry::Result<Sequential> {
    let layers = Sequential::new()
        .push(Linear::new(2, 32, device)?)
        .push(ReLU);
    Ok(layers.push(Linear::new(32, 3, device)?))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device: Device = std::env::args().nth(1).unwrap_or("cpu".into()).parse()?;
    ferry::manual_seed(0);
    let (x, y) = rings(600, device)?;
    let model = mlp(device)?;
    let mut opt = Adam::new(model.parameters(), 0.02)?;

    let params = model.parameters();
    let watch = GraphWatch::new(&params);
    for epoch in 1..=300 {
        opt.zero_grad();
        let loss = nn::cross_entropy(&model.forward(&x)?, &y)?;
        loss.backward()?;
        opt.step()?;
        if epoch % 100 == 0 {
            println!("epoch {epoch}: loss {:.4}", loss.item()?); // item(): a number, no graph
        }
    }
    watch.check()?; // every step's graph is gone

    let accuracy = |m: &Sequential| -> ferry::Result<f64> {
        let predicted = with_no_grad(|| m.forward(&x)?.argmax(1, false))?;
        predicted.eq(&y)?.to_dtype(DType::F32)?.mean()?.item()
    };
    let trained = accuracy(&model)?;
    println!("train accuracy: {trained:.4}");

    let path = std::env::temp_dir().join("ferry-example-rings.safetensors");
    checkpoint::save(&path, &model.state_dict())?;
    let mut restored = mlp(device)?;
    restored.load_state_dict(&checkpoint::load(&path)?)?;
    println!(
        "restored from {}: {:.4}",
        path.display(),
        accuracy(&restored)?
    );
    std::fs::remove_file(&path)?;
    if trained < 0.9 {
        return Err(format!("the model did not learn the rings: accuracy {trained:.4}").into());
    }
    Ok(())
}
