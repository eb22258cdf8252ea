//! ferry's CPU AdamW over host slices (`ferry::optim::host`) against the tensor step
//! `Tensor::adam_update` on each device: on the CPU that step computes in f64, on a GPU it is the
//! CUDA kernel the optimizer offload must agree with. Ten steps, each from the same f32 state on
//! both sides, element by element within the documented bound.

use ferry::optim::AdamStep;
use ferry::optim::host::{self, AdamTensor, GradSlice};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::device_test;

/// Elements: past one parallel block and a ragged tail.
const N: usize = (1 << 14) + 1031;

/// f32 values of a fresh random tensor, made on the host so both sides start from the same bits.
fn random(scale: f32) -> Result<Vec<f32>> {
    let t = Tensor::randn(&[N], DType::F32, Device::Cpu)?;
    Ok(t.to_vec::<f32>()?.into_iter().map(|v| v * scale).collect())
}

/// `got[i] - want[i]` within `ulps` f32 epsilons of `scale[i]`.
fn close(what: &str, got: &[f32], want: &[f32], scale: &[f32], ulps: f32) {
    for (i, ((g, w), scale)) in got.iter().zip(want).zip(scale).enumerate() {
        assert!(
            (g - w).abs() <= ulps * f32::EPSILON * scale,
            "{what}[{i}]: {g} against {w}, {} epsilons apart",
            (g - w).abs() / (f32::EPSILON * scale)
        );
    }
}

fn host_matches_the_tensor_step(device: Device) -> Result<()> {
    let (p0, m0, g) = (random(1.0)?, random(0.1)?, random(1.0)?);
    let v0: Vec<f32> = random(0.01)?.iter().map(|v| v * v).collect();
    let (mut p, mut m, mut v) = (p0, m0, v0);
    let on = |x: &[f32]| -> Result<Tensor> {
        use ferry::DeviceMove;
        Tensor::from_slice(x, &[N])?.to(device)
    };
    let tg = on(&g)?;
    for t in 1..=10 {
        // Each step from the same f32 state on both sides: the bound is a step's.
        let (tp, tm, tv) = (on(&p)?, on(&m)?, on(&v)?);
        let prev = p.clone();
        let step: AdamStep = host::adamw_step(t, 1e-3, (0.9, 0.999), 1e-8, 0.01);
        host::adamw(
            &step,
            [AdamTensor {
                master: &mut p,
                exp_avg: &mut m,
                exp_avg_sq: &mut v,
                grad: GradSlice::F32(&g),
                out: None,
            }],
        )?;
        let _no_grad = ferry_tensor::no_grad();
        tp.adam_update(&tg, &tm, &tv, &step)?;
        let read = |t: &Tensor| t.to_vec::<f32>();
        // v is two products and a sum (a fused multiply-add on a GPU) that never cancel.
        close(&format!("v, step {t}"), &v, &read(&tv)?, &v, 2.0);
        // p moves by lr·m̂/√v̂ a step: a few roundings of |p| and of the step, the magnitudes
        // the update is summed from (a weight near 0 cancels against its step). The step is
        // read off the host's result: m̂/√v̂ is large where the random v is tiny.
        let p_scale: Vec<f32> = prev
            .iter()
            .zip(&p)
            .map(|(before, after)| before.abs() + (before - after).abs() + 4e-3)
            .collect();
        close(&format!("p, step {t}"), &p, &read(&tp)?, &p_scale, 4.0);
    }
    Ok(())
}
device_test!(
    host_adamw_matches_the_tensor_step,
    host_matches_the_tensor_step
);
