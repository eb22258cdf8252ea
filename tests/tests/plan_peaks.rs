//! A memory plan's peaks predicted from a measured step ([`PlannedChain::measure_peaks`]) against
//! what each choice then takes, read from the allocator (ferry's host statistics on the CPU).
//! Both are process-wide, so these take the binary's lock.

use ferry::autograd::{Choice, MemoryPlan, StepCost};
use ferry::nn::{Activation, Dense, Module, PlannedChain};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::device_test;

use Choice::{Keep as K, Recompute as R, Selective as S};

fn serial() -> std::sync::MutexGuard<'static, ()> {
    super::LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Six blocks of two layers, each keeping its 256-wide hidden activation for backward.
fn chain(device: Device) -> Result<PlannedChain<PlannedChain<Dense>>> {
    let block = || -> Result<PlannedChain<Dense>> {
        Ok(PlannedChain::new(vec![
            Dense::new(64, 256, Activation::Tanh, device)?,
            Dense::new(256, 64, Activation::Identity, device)?,
        ]))
    };
    Ok(PlannedChain::new(
        (0..6).map(|_| block()).collect::<Result<Vec<_>>>()?,
    ))
}

/// A head after the chain: a 1024-wide product and its activation, as a model's logits.
fn loss_and_backward(y: &Tensor, head: &Tensor) -> Result<()> {
    y.matmul(head)?.tanh()?.mean()?.backward()?;
    Ok(())
}

/// The most allocated above the start while `step` runs.
fn peak_of(device: Device, step: impl FnOnce() -> Result<()>) -> Result<u64> {
    let base = ferry::allocated::current(device)?;
    ferry::allocated::reset_peak(device)?;
    step()?;
    Ok(ferry::allocated::peak(device)?.saturating_sub(base) as u64)
}

/// The peak of one step of `chain` (its gradients cleared first).
fn step_peak(chain: &PlannedChain<PlannedChain<Dense>>, x: &Tensor, head: &Tensor) -> Result<u64> {
    for p in chain.parameters().iter().chain([head]) {
        p.set_grad(None);
    }
    peak_of(x.device(), || loss_and_backward(&chain.forward(x)?, head))
}

fn predicted_peaks_are_the_measured_ones(device: Device) -> Result<()> {
    let _serial = serial();
    let mut chain = chain(device)?;
    let x = Tensor::randn(&[512, 64], DType::F32, device)?.with_grad()?;
    let head = Tensor::randn(&[64, 1024], DType::F32, device)?.with_grad()?;
    let costs = chain.profile_blocks(&x)?;
    step_peak(&chain, &x, &head)?; // a warm step: caches and workspaces taken
    for p in chain.parameters().iter().chain([&head]) {
        p.set_grad(None);
    }
    let measured = chain.measure_peaks(&x, |y| loss_and_backward(y, &head))?;
    let mut step = StepCost::new(&costs, None);
    step.measured = Some(measured.clone());
    let plain = step_peak(&chain, &x, &head)?;
    let profiled = MemoryPlan::with_choices(&step, &[K; 6])?.peak_bytes();
    assert!(
        profiled.abs_diff(plain) <= plain / 50,
        "profiled plain peak {profiled} against a plain step's {plain} ({measured:?})"
    );
    for choices in [
        [R, R, R, R, R, K],
        [R, R, R, R, R, R],
        [K, K, K, R, R, R],
        [S, S, S, S, S, S],
        [R, S, R, S, R, K],
    ] {
        let predicted = MemoryPlan::with_choices(&step, &choices)?.peak_bytes();
        chain.set_plan(&choices)?;
        let took = step_peak(&chain, &x, &head)?;
        chain.set_plan(&[K; 6])?;
        assert!(
            predicted.abs_diff(took) <= plain / 20,
            "{choices:?}: predicted {predicted}, took {took}, plain {plain} ({measured:?})"
        );
    }
    Ok(())
}
device_test!(
    the_peaks_predicted_from_a_measured_step_are_the_measured_ones,
    predicted_peaks_are_the_measured_ones
);

/// The same for ferry's GPT: its embedding and head inside the measured step.
fn gpt_peaks_are_the_measured_ones(device: Device) -> Result<()> {
    use ferry::models::{Gpt, GptConfig};
    let _serial = serial();
    let config = GptConfig {
        vocab: 128,
        context: 64,
        width: 64,
        layers: 4,
        heads: 4,
    };
    let mut gpt = Gpt::new(config, device)?;
    let ids = Tensor::rand(&[4 * 64], DType::F32, device)?
        .mul_scalar(128.0)?
        .to_dtype(DType::I64)?;
    let targets = ids.clone();
    let ids = ids.reshape(&[4, 64])?;
    let backward = |logits: &Tensor| -> Result<()> {
        let flat = logits.reshape(&[4 * 64, 128])?;
        ferry::nn::cross_entropy(&flat, &targets)?.backward()?;
        Ok(())
    };
    let clear = |gpt: &Gpt| {
        for p in gpt.parameters() {
            p.set_grad(None);
        }
    };
    let step = |gpt: &Gpt| -> Result<u64> {
        clear(gpt);
        peak_of(device, || backward(&gpt.forward(&ids)?))
    };
    let costs = gpt.profile_blocks(&ids)?;
    step(&gpt)?; // a warm step
    clear(&gpt);
    let mut cost = StepCost::new(&costs, None);
    cost.measured = Some(gpt.measure_peaks(&ids, backward)?);
    let plain = step(&gpt)?;
    let profiled = MemoryPlan::with_choices(&cost, &[K; 4])?.peak_bytes();
    assert!(
        profiled.abs_diff(plain) <= plain / 50,
        "profiled {profiled}, plain step {plain}"
    );
    for choices in [[R, R, R, K], [R, R, R, R], [K, K, R, R], [S, S, S, S]] {
        let predicted = MemoryPlan::with_choices(&cost, &choices)?.peak_bytes();
        gpt.set_plan(&choices)?;
        let took = step(&gpt)?;
        gpt.set_plan(&[K; 4])?;
        assert!(
            predicted.abs_diff(took) <= plain / 20,
            "{choices:?}: predicted {predicted}, took {took}, plain {plain}"
        );
    }
    Ok(())
}
device_test!(
    a_gpts_predicted_peaks_are_the_measured_ones,
    gpt_peaks_are_the_measured_ones
);
