use ferry_memory::bf16;
use ferry_tensor::{DType, Device, Tensor, manual_seed};

use super::*;
use crate::nn::{Linear, Module, ReLU, Sequential};
use crate::optim::AdamW;
use crate::optim::Optimizer;
use ferry_transfer::StateDict;

fn mlp(device: Device, dtype: DType) -> Result<Sequential> {
    manual_seed(7);
    let mut model = Sequential::new()
        .push(Linear::new(48, 64, Device::Cpu)?)
        .push(ReLU)
        .push(Linear::new(64, 5, Device::Cpu)?);
    model.to(device)?;
    if dtype != DType::F32 {
        model.visit_parameters_mut("", &mut |_, p| {
            *p = ferry_tensor::with_no_grad(|| p.detach().to_dtype(dtype))?.with_grad()?;
            Ok(())
        })?;
    }
    Ok(model)
}

fn batch(device: Device, seed: u64) -> Result<Tensor> {
    manual_seed(seed);
    Tensor::randn(&[16, 48], DType::F32, device)
}

fn loss(model: &Sequential, x: &Tensor) -> Result<Tensor> {
    let x = x.to_dtype(model.parameters()[0].dtype())?;
    model.forward(&x)?.to_dtype(DType::F32)?.powf(2.0)?.mean()
}

/// Five steps with the state on the host follow five steps of AdamW on the GPU: the same
/// losses and weights, to the few roundings the CPU and GPU updates differ by.
#[test]
#[ignore = "needs a CUDA device"]
fn offloaded_steps_follow_adamw_on_the_gpu() {
    let gpu = Device::Cuda(0);
    let (reference, offloaded) = (mlp(gpu, DType::F32).unwrap(), mlp(gpu, DType::F32).unwrap());
    let mut adamw = AdamW::new(reference.parameters(), 1e-2).unwrap();
    let mut offload = OffloadAdamW::new(offloaded.parameters(), 1e-2).unwrap();
    for step in 0..5 {
        let x = batch(gpu, 100 + step).unwrap();
        let (a, b) = (loss(&reference, &x).unwrap(), loss(&offloaded, &x).unwrap());
        let (la, lb) = (a.item().unwrap(), b.item().unwrap());
        assert!(
            (la - lb).abs() <= 1e-5 * la.abs(),
            "step {step}: loss {la} against {lb}"
        );
        adamw.zero_grad();
        a.backward().unwrap();
        adamw.step().unwrap();
        b.backward().unwrap();
        // Backward already sent every gradient down and freed it on the GPU.
        assert!(offloaded.parameters().iter().all(|p| p.grad().is_none()));
        offload.step().unwrap();
    }
    for (p, q) in reference.parameters().iter().zip(offloaded.parameters()) {
        let (p, q) = (p.to_vec::<f32>().unwrap(), q.to_vec::<f32>().unwrap());
        for (a, b) in p.iter().zip(&q) {
            assert!((a - b).abs() <= 1e-5 * (a.abs() + 1e-2), "{a} against {b}");
        }
    }
    assert_eq!(offload.steps(), 5);
    // The last step's timeline: sent before landed, stepped before step() returned.
    let t = offload.last_timeline();
    let ((sent, _), (landed, _)) = (t.sent.unwrap(), t.landed.unwrap());
    assert!(
        sent <= landed && t.stepped.unwrap() <= t.returned.unwrap(),
        "{t:?}"
    );
    assert!(t.busy > std::time::Duration::ZERO);
    assert!(
        offload.pinned_bytes()
            >= 2 * offloaded
                .parameters()
                .iter()
                .map(Tensor::nbytes)
                .sum::<usize>()
    );
}

/// bf16 parameters: bf16 gradients land, fp32 master weights step, and the weights uploaded are
/// the master weights rounded to bf16; the loss falls.
#[test]
#[ignore = "needs a CUDA device"]
fn bf16_parameters_get_their_rounded_master_weights() {
    let gpu = Device::Cuda(0);
    let model = mlp(gpu, DType::BF16).unwrap();
    let mut offload = OffloadAdamW::new(model.parameters(), 1e-2).unwrap();
    let x = batch(gpu, 3).unwrap();
    let first = loss(&model, &x).unwrap().item().unwrap();
    for _ in 0..20 {
        loss(&model, &x).unwrap().backward().unwrap();
        offload.step().unwrap();
    }
    let last = loss(&model, &x).unwrap().item().unwrap();
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    let state = offload.state_dict();
    for (i, p) in model.parameters().iter().enumerate() {
        let master = &state
            .iter()
            .find(|(k, _)| *k == format!("{i}.master"))
            .unwrap()
            .1;
        let rounded: Vec<u16> = master
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|m| bf16::from_f32(*m).to_bits())
            .collect();
        let on_gpu: Vec<u16> = p
            .to_vec::<bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(on_gpu, rounded, "parameter {i}");
    }
}

/// A state dict taken after some steps and loaded into a fresh optimizer continues as the
/// original does.
#[test]
#[ignore = "needs a CUDA device"]
fn a_loaded_state_dict_continues_the_run() {
    let gpu = Device::Cuda(0);
    let (a, b) = (mlp(gpu, DType::F32).unwrap(), mlp(gpu, DType::F32).unwrap());
    let mut first = OffloadAdamW::new(a.parameters(), 1e-2).unwrap();
    let x = batch(gpu, 5).unwrap();
    for _ in 0..3 {
        loss(&a, &x).unwrap().backward().unwrap();
        first.step().unwrap();
    }
    // b gets a's weights and a's optimizer state.
    ferry_tensor::with_no_grad(|| {
        for (p, q) in a.parameters().iter().zip(b.parameters()) {
            q.assign(p)?;
        }
        Ok::<_, TensorError>(())
    })
    .unwrap();
    let mut second = OffloadAdamW::new(b.parameters(), 1e-2).unwrap();
    second.load_state_dict(&first.state_dict()).unwrap();
    assert_eq!(second.steps(), 3);
    for (model, opt) in [(&a, &mut first), (&b, &mut second)] {
        loss(model, &x).unwrap().backward().unwrap();
        opt.step().unwrap();
    }
    for (p, q) in a.parameters().iter().zip(b.parameters()) {
        assert_eq!(p.to_vec::<f32>().unwrap(), q.to_vec::<f32>().unwrap());
    }
}

/// Parameters on the CPU are refused with the fix named.
#[test]
fn parameters_on_the_cpu_are_refused_naming_the_fix() {
    let model = mlp(Device::Cpu, DType::F32).unwrap();
    let err = OffloadAdamW::new(model.parameters(), 1e-3)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("move the model to a GPU") && err.contains("AdamW"),
        "{err}"
    );
    let err = OffloadAdamW::new(Vec::new(), 1e-3)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no parameters"), "{err}");
}

/// The path another runtime's parameters take (ferry-py's, for torch): no hooks, the caller
/// copies each gradient into its landing tensor on the gradient stream and hands over the
/// hyperparameters with it; the steps equal AdamW's on the GPU with those hyperparameters.
#[test]
#[ignore = "needs a CUDA device"]
fn a_fed_optimizer_steps_the_gradients_copied_into_its_landing_tensors() {
    let gpu = Device::Cuda(0);
    let reference = mlp(gpu, DType::F32).unwrap();
    let mut adamw = AdamW::new(reference.parameters(), 1e-2)
        .unwrap()
        .weight_decay(0.1);
    // Device tensors over other memory, as DLPack imports are: no grad, no hooks.
    let params: Vec<Tensor> = reference
        .parameters()
        .iter()
        .map(|p| p.detach().copy().unwrap())
        .collect();
    let mut fed = OffloadAdamW::fed(params.clone(), 1.0).unwrap();
    let adam = AdamHyper {
        lr: 1e-2,
        weight_decay: 0.1,
        ..fed.hyper()
    };
    for step in 0..3 {
        let x = batch(gpu, 200 + step).unwrap();
        adamw.zero_grad();
        loss(&reference, &x).unwrap().backward().unwrap();
        for (i, p) in reference.parameters().iter().enumerate() {
            let grad = p.grad().unwrap();
            let landing = fed.landing(i).unwrap();
            let guard = grad.storage().read();
            let Buffer::Cuda(from) = &*guard else {
                panic!("a GPU gradient")
            };
            {
                let mut to = landing.storage().write();
                let Buffer::Pinned(to) = &mut *to else {
                    panic!("a pinned landing tensor")
                };
                from.copy_to_pinned_async_at(0, to, fed.gradient_stream())
                    .unwrap();
            }
            fed.gradient_queued(i, adam).unwrap();
        }
        adamw.step().unwrap();
        fed.step().unwrap();
        // The caller's next reads wait for the uploads on the device.
        ferry_memory::cuda::CudaDevice::get(0)
            .unwrap()
            .default_stream()
            .wait_event(&fed.upload_stream().record().unwrap())
            .unwrap();
    }
    for (p, q) in reference.parameters().iter().zip(&params) {
        let (p, q) = (p.to_vec::<f32>().unwrap(), q.to_vec::<f32>().unwrap());
        for (a, b) in p.iter().zip(&q) {
            assert!((a - b).abs() <= 1e-5 * (a.abs() + 1e-2), "{a} against {b}");
        }
    }
    assert_eq!(fed.steps(), 3);
    assert!(fed.landing(params.len()).is_none());
    let err = fed.gradient_queued(params.len(), adam).unwrap_err();
    assert!(err.to_string().contains("does not exist"), "{err}");
}

fn weights(model: &Sequential) -> Vec<Vec<f32>> {
    model
        .parameters()
        .iter()
        .map(|p| p.to_vec::<f32>().unwrap())
        .collect()
}

fn assert_near(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    for (p, q) in a.iter().zip(b) {
        for (x, y) in p.iter().zip(q) {
            assert!(
                (x - y).abs() <= 1e-5 * (x.abs() + 1e-2),
                "{what}: {x} against {y}"
            );
        }
    }
}

/// The delayed update: step k's forward and backward see the weights of step k - 1 (the
/// first two see the initial ones), each gradient is applied as AdamW would apply it, and
/// `flush` brings the parameters up to date.
#[test]
#[ignore = "needs a CUDA device"]
fn the_delayed_update_steps_gradients_of_weights_one_step_behind() {
    delayed_steps(None);
}

/// The same with held gradients clipped: each step's norm is that of the gradient taken at
/// the stale weights, and the steps follow AdamW's over those gradients clipped on the GPU.
#[test]
#[ignore = "needs a CUDA device"]
fn the_delayed_update_over_held_gradients_clips_as_on_the_gpu() {
    delayed_steps(Some(0.01));
}

fn delayed_steps(max_norm: Option<f64>) {
    let gpu = Device::Cuda(0);
    let (reference, offloaded) = (mlp(gpu, DType::F32).unwrap(), mlp(gpu, DType::F32).unwrap());
    let mut scratch = mlp(gpu, DType::F32).unwrap();
    let mut adamw = AdamW::new(reference.parameters(), 1e-2).unwrap();
    let mut offload = OffloadAdamW::new(offloaded.parameters(), 1e-2)
        .unwrap()
        .hold_gradients(max_norm.is_some())
        .delayed_update(true);
    let mut clipped = 0;
    // history[k]: the weights after k steps.
    let mut history = vec![weights(&reference)];
    for step in 0..5u64 {
        let behind = &history[step.saturating_sub(1) as usize];
        assert_near(
            behind,
            &weights(&offloaded),
            &format!("step {step}'s weights"),
        );
        let x = batch(gpu, 300 + step).unwrap();
        // The gradient the offloaded run computes, at its stale weights, applied by AdamW.
        scratch.load_state_dict(&offloaded.state_dict()).unwrap();
        for p in scratch.parameters() {
            p.set_grad(None);
        }
        loss(&scratch, &x).unwrap().backward().unwrap();
        for (p, q) in reference.parameters().iter().zip(scratch.parameters()) {
            p.set_grad(q.grad());
        }
        loss(&offloaded, &x).unwrap().backward().unwrap();
        if let Some(max_norm) = max_norm {
            let a = crate::optim::clip_grad_norm(reference.parameters(), max_norm).unwrap();
            let b = offload.clip_grad_norm(max_norm).unwrap();
            assert!(
                (a - b).abs() <= 1e-5 * a,
                "step {step}: norm {a} against {b}"
            );
            clipped += usize::from(a > max_norm);
        }
        adamw.step().unwrap();
        history.push(weights(&reference));
        offload.step().unwrap();
    }
    offload.flush(None).unwrap();
    assert_near(&history[5], &weights(&offloaded), "after flush");
    if max_norm.is_some() {
        assert!(
            clipped > 0,
            "no step clipped: the test would not show clipping"
        );
    }
    assert_eq!(offload.steps(), 5);
    // The state is whole once the passes are done: five steps' masters.
    let state = offload.state_dict();
    let master = &state.iter().find(|(k, _)| k == "0.master").unwrap().1;
    assert_near(
        &history[5][..1],
        &[master.to_vec::<f32>().unwrap()],
        "master weights",
    );
}

/// A wide model at a tiny batch: the CPU's passes take longer than forward and backward, so
/// with the delayed update the step thread runs a step behind, and backward's next gradient
/// for a parameter comes while the last one still waits in its landing buffer. Run back to
/// back, the steps must still apply each gradient once, as AdamW does: the hook holds the new
/// gradient until the last one has been read (the timeline counts the time held).
#[test]
#[ignore = "needs a CUDA device"]
fn the_delayed_update_never_lands_a_gradient_on_one_not_yet_stepped() {
    let gpu = Device::Cuda(0);
    let wide = || -> Result<Sequential> {
        manual_seed(11);
        let mut model = Sequential::new()
            .push(Linear::new(1024, 2048, Device::Cpu)?)
            .push(ReLU)
            .push(Linear::new(2048, 2048, Device::Cpu)?)
            .push(ReLU)
            .push(Linear::new(2048, 8, Device::Cpu)?);
        model.to(gpu)?;
        Ok(model)
    };
    let input = |step: u64| {
        manual_seed(400 + step);
        Tensor::randn(&[4, 1024], DType::F32, gpu).unwrap()
    };
    const STEPS: u64 = 6;
    let offloaded = wide().unwrap();
    let mut offload = OffloadAdamW::new(offloaded.parameters(), 1e-3)
        .unwrap()
        .delayed_update(true);
    let mut held = Duration::ZERO;
    for step in 0..STEPS {
        loss(&offloaded, &input(step)).unwrap().backward().unwrap();
        offload.step().unwrap();
        held += offload.last_timeline().held;
    }
    offload.flush(None).unwrap();
    // Whether the race this guards against came up in this run (it depends on the host's cores).
    eprintln!("backward's hooks were held {held:?} over {STEPS} steps");

    // AdamW applying, at step k, the gradient at the weights of step k - 1.
    let (reference, mut scratch) = (wide().unwrap(), wide().unwrap());
    let mut adamw = AdamW::new(reference.parameters(), 1e-3).unwrap();
    // The weights after each step, copied (a state dict shares the parameters' storage).
    let snapshot = |model: &Sequential| -> StateDict {
        let state = model.state_dict().into_iter();
        state.map(|(k, t)| (k, t.copy().unwrap())).collect()
    };
    let mut history = vec![snapshot(&reference)];
    for step in 0..STEPS {
        scratch
            .load_state_dict(&history[step.saturating_sub(1) as usize])
            .unwrap();
        for p in scratch.parameters() {
            p.set_grad(None);
        }
        loss(&scratch, &input(step)).unwrap().backward().unwrap();
        for (p, q) in reference.parameters().iter().zip(scratch.parameters()) {
            p.set_grad(q.grad());
        }
        adamw.step().unwrap();
        history.push(snapshot(&reference));
    }
    assert_near(
        &weights(&reference),
        &weights(&offloaded),
        &format!("after {STEPS} steps run back to back (hooks held {held:?})"),
    );
}

/// Two copies of the MLP on `gpu`: one with AdamW, one with a held-gradient OffloadAdamW.
/// Two models alike, AdamW on the first and an OffloadAdamW holding gradients on the second
/// (within `pinned_limit` when given).
fn held_pair(
    gpu: Device,
    pinned_limit: Option<usize>,
) -> (Sequential, Sequential, AdamW, OffloadAdamW) {
    let (reference, offloaded) = (mlp(gpu, DType::F32).unwrap(), mlp(gpu, DType::F32).unwrap());
    let adamw = AdamW::new(reference.parameters(), 1e-2).unwrap();
    let offload = match pinned_limit {
        Some(limit) => OffloadAdamW::new_within(offloaded.parameters(), 1e-2, limit),
        None => OffloadAdamW::new(offloaded.parameters(), 1e-2),
    };
    let offload = offload.unwrap().hold_gradients(true);
    (reference, offloaded, adamw, offload)
}

/// Held gradients: two backward passes a step add up on the host, `clip_grad_norm` sees their
/// global norm and scales them as [`crate::optim::clip_grad_norm`] scales the GPU's, and the
/// steps follow AdamW's on the GPU.
#[test]
#[ignore = "needs a CUDA device"]
fn held_gradients_accumulate_over_backward_passes_and_clip_as_on_the_gpu() {
    accumulate_and_clip(None);
}

fn accumulate_and_clip(pinned_limit: Option<usize>) {
    let gpu = Device::Cuda(0);
    let (reference, offloaded, mut adamw, mut offload) = held_pair(gpu, pinned_limit);
    let mut clipped = 0;
    for step in 0..4u64 {
        adamw.zero_grad();
        offload.zero_grad();
        for pass in 0..2 {
            let x = batch(gpu, 500 + 2 * step + pass).unwrap();
            loss(&reference, &x).unwrap().backward().unwrap();
            loss(&offloaded, &x).unwrap().backward().unwrap();
        }
        // Small enough that some steps clip.
        let max_norm = 0.05;
        let a = crate::optim::clip_grad_norm(reference.parameters(), max_norm).unwrap();
        let b = offload.clip_grad_norm(max_norm).unwrap();
        assert!(
            (a - b).abs() <= 1e-5 * a,
            "step {step}: norm {a} against {b}"
        );
        clipped += usize::from(a > max_norm);
        adamw.step().unwrap();
        offload.step().unwrap();
        assert_near(
            &weights(&reference),
            &weights(&offloaded),
            &format!("after step {step}"),
        );
        if let Some(limit) = pinned_limit {
            assert!(offload.pinned_bytes() <= limit);
        }
    }
    assert!(
        clipped > 0,
        "no step clipped: the test would not show clipping"
    );
    assert_eq!(offload.steps(), 4);
    assert_eq!(offload.staging().is_some(), pinned_limit.is_some());
}

/// The least pinned limit staging takes for `params`: the largest parameter's landing and
/// upload buffers, which is less than a pair per parameter.
fn least_pinned_limit(params: &[Tensor]) -> usize {
    let blocks: Vec<usize> = params
        .iter()
        .map(|p| ferry_memory::cuda::PinnedPool::block_size(p.nbytes()))
        .collect();
    let least = 2 * blocks.iter().max().unwrap();
    assert!(least < 2 * blocks.iter().sum::<usize>(), "{blocks:?}");
    least
}

/// Staged buffers, at the least limit staging takes (each half holds no more than the largest
/// parameter's buffer, so gradients wait for the step thread to give landing buffers back):
/// the pinned bytes held stay within it, the steps
/// are those of buffers per parameter, held gradients accumulate and clip as on the GPU, the
/// delayed update is refused with the reason, and a limit below the least names it.
#[test]
#[ignore = "needs a CUDA device"]
fn staged_buffers_stay_within_the_pinned_limit_and_step_as_buffers_per_parameter_do() {
    let gpu = Device::Cuda(0);
    let (a, b) = (mlp(gpu, DType::F32).unwrap(), mlp(gpu, DType::F32).unwrap());
    let limit = least_pinned_limit(&b.parameters());
    let mut per_parameter = OffloadAdamW::new(a.parameters(), 1e-2).unwrap();
    let mut staged = OffloadAdamW::new_within(b.parameters(), 1e-2, limit).unwrap();
    assert!(per_parameter.staging().is_none());
    for step in 0..4 {
        let x = batch(gpu, 700 + step).unwrap();
        loss(&a, &x).unwrap().backward().unwrap();
        per_parameter.step().unwrap();
        loss(&b, &x).unwrap().backward().unwrap();
        staged.step().unwrap();
        assert!(staged.pinned_bytes() <= limit);
    }
    assert_near(&weights(&a), &weights(&b), "after 4 steps");
    let report = staged.staging().unwrap();
    assert_eq!(report.limit, limit);
    assert!(report.peak > 0 && report.peak <= limit, "{report:?}");
    assert!(report.per_parameter > limit, "{report:?}");
    assert!(report.to_string().contains("staged"), "{report}");

    accumulate_and_clip(Some(limit));

    let c = mlp(gpu, DType::F32).unwrap();
    let mut delayed = OffloadAdamW::new_within(c.parameters(), 1e-2, limit)
        .unwrap()
        .delayed_update(true);
    loss(&c, &batch(gpu, 7).unwrap())
        .unwrap()
        .backward()
        .unwrap();
    let err = delayed.step().unwrap_err().to_string();
    assert!(
        err.contains("delayed update") && err.contains("raise the limit"),
        "{err}"
    );

    let err = OffloadAdamW::new_within(c.parameters(), 1e-2, limit - 1)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("at least"), "{err}");
}

/// A GradScaler over held gradients: it unscales them on the host, finds the overflow of a
/// step whose loss was made infinite, and that step is skipped (state and weights untouched)
/// as it is with AdamW on the GPU; the next `zero_grad` drops the held gradients. Without
/// held gradients, clipping and unscaling are errors that name the fix.
#[test]
#[ignore = "needs a CUDA device"]
fn a_grad_scaler_over_held_gradients_skips_an_overflow_as_on_the_gpu() {
    use crate::amp::GradScaler;
    let gpu = Device::Cuda(0);
    let (reference, offloaded, mut adamw, mut offload) = held_pair(gpu, None);
    let scaler = || GradScaler::new().init_scale(1024.0).unwrap();
    let (mut sa, mut sb) = (scaler(), scaler());
    for step in 0..4u64 {
        adamw.zero_grad();
        offload.zero_grad();
        let x = batch(gpu, 600 + step).unwrap();
        let overflow = if step == 1 { f64::INFINITY } else { 1.0 };
        let la = loss(&reference, &x).unwrap().mul_scalar(overflow).unwrap();
        let lb = loss(&offloaded, &x).unwrap().mul_scalar(overflow).unwrap();
        sa.scale(&la).unwrap().backward().unwrap();
        sb.scale(&lb).unwrap().backward().unwrap();
        let (stepped_a, stepped_b) = (sa.step(&mut adamw).unwrap(), sb.step(&mut offload).unwrap());
        assert_eq!(stepped_a, step != 1, "step {step}");
        assert_eq!(stepped_b, stepped_a, "step {step}");
        sa.update().unwrap();
        sb.update().unwrap();
        assert_eq!(sa.scale_factor(), sb.scale_factor());
        assert_near(
            &weights(&reference),
            &weights(&offloaded),
            &format!("after step {step}"),
        );
    }
    assert_eq!((adamw.steps(), offload.steps()), (3, 3));

    let streaming = OffloadAdamW::new(mlp(gpu, DType::F32).unwrap().parameters(), 1e-2).unwrap();
    for err in [
        streaming.clip_grad_norm(1.0).unwrap_err(),
        streaming.scale_grads(0.5).unwrap_err(),
    ] {
        assert!(err.to_string().contains("hold_gradients(true)"), "{err}");
    }
}
