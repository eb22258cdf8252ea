//! Whole models trained on both devices from the same weights on the same batches: the GPU's
//! run follows the CPU's. A kernel that is right on the shapes its own tests use and wrong on a
//! model's would show here as losses that part ways.

use ferry::nn::{Module, cross_entropy};
use ferry::optim::{AdamW, Optimizer};
use ferry_tensor::{DType, Device, Result, Tensor};

/// A learnable task on 8 x 8 images: the class is how bright the top rows are.
fn batch(rows: usize) -> Result<(Tensor, Tensor)> {
    let x = Tensor::rand(&[rows, 64], DType::F32, Device::Cpu)?;
    let brightness = x.narrow(1, 0, 16)?.sum_axis(1, false)?;
    let y = brightness
        .sub_scalar(5.0)?
        .mul_scalar(10.0 / 6.0)?
        .clamp(0.0, 9.0)?
        .to_dtype(DType::I64)?;
    Ok((x, y))
}

/// The digits CNN (no dropout) trained for 40 AdamW steps (lr 1e-2, batch 16, as
/// `ferry train digits-cnn`) on the CPU and on the GPU from the same initial weights.
#[test]
#[ignore = "needs a CUDA device"]
fn the_digits_cnn_trains_alike_on_both_devices() {
    ferry_tests::run_on(Device::Cuda(0), |device| {
        ferry::manual_seed(7);
        let cpu = ferry::models::digits_cnn(Device::Cpu, 0.0)?;
        ferry::manual_seed(7);
        let mut gpu = ferry::models::digits_cnn(Device::Cpu, 0.0)?;
        gpu.to(device)?;
        let mut cpu_opt = AdamW::new(cpu.parameters(), 1e-2)?;
        let mut gpu_opt = AdamW::new(gpu.parameters(), 1e-2)?;
        let mut worst = (0usize, 0.0f64);
        let mut losses = Vec::new();
        for step in 0..40 {
            let (x, y) = batch(16)?;
            let run = |model: &dyn Module, opt: &mut AdamW, x: &Tensor, y: &Tensor| {
                opt.zero_grad();
                let loss = cross_entropy(&model.forward(x)?, y)?;
                loss.backward()?;
                opt.step()?;
                loss.item()
            };
            let here = run(&cpu, &mut cpu_opt, &x, &y)?;
            let (gx, gy) = (
                ferry_tests::on(device, x.clone())?,
                ferry_tests::on(device, y.clone())?,
            );
            let there = run(&gpu, &mut gpu_opt, &gx, &gy)?;
            let rel = (here - there).abs() / here.abs().max(1e-3);
            if rel > worst.1 {
                worst = (step, rel);
            }
            losses.push((here, there));
        }
        eprintln!("losses (cpu, gpu): {losses:?}");
        eprintln!(
            "worst relative difference {:.2e} at step {}",
            worst.1, worst.0
        );
        assert!(
            losses.last().unwrap().0 < losses[0].0,
            "the CPU run did not learn: {losses:?}"
        );
        // Rounding differs (other summation orders, cuDNN's algorithms), and Adam amplifies it
        // where gradients are tiny; a wrong kernel moves the losses apart by far more.
        assert!(worst.1 < 1e-2, "step {}: {:?}", worst.0, losses[worst.0]);
        Ok(())
    });
}

/// The largest difference between `got` and `want` over the largest magnitude in `want`.
fn relative_gap(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, w| m.max(w.abs())).max(1e-6) as f64;
    let gap = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
    gap as f64 / scale
}

/// ferry's Llama loads what transformers' `save_pretrained` writes and computes its logits:
/// float32 to float32 rounding on each device, bfloat16 within bfloat16's (the models and
/// their logits come from tests/torch/llama_reference.py, in both its variants).
#[test]
#[ignore = "needs Python with torch and transformers (the GPU machine has them)"]
fn llama_logits_equal_transformers() {
    use ferry::models::Llama;
    use ferry::prelude::*;

    let cuda = ferry::memory::cuda::CudaDevice::get(0).is_ok();
    let devices: &[Device] = if cuda {
        &[Device::Cpu, Device::Cuda(0)]
    } else {
        println!("no CUDA device: comparing on the CPU only");
        &[Device::Cpu]
    };
    for variant in ["plain", "tied-llama3"] {
        let dir = std::env::temp_dir().join(format!(
            "ferry-llama-reference-{variant}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let script = ferry_tests::repo_root().join("tests/torch/llama_reference.py");
        let out = std::process::Command::new("python3")
            .arg(&script)
            .arg(&dir)
            .arg(variant)
            .output()
            .expect("python3 runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{variant}: {}", String::from_utf8_lossy(&out.stdout).trim());
        let ids = ferry::load_npy(dir.join("ids.npy")).unwrap();
        for &device in devices {
            for (sub, tolerance) in [("", 1e-5), ("bf16", 3e-2)] {
                let files = dir.join(sub);
                let want = ferry::load_npy(files.join("logits.npy"))
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
                let model = Llama::from_pretrained(&files, device).unwrap();
                let got = model
                    .forward(&ids.to(device).unwrap())
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
                let gap = relative_gap(&got, &want);
                let dtype = if sub.is_empty() { "f32" } else { sub };
                println!(
                    "{variant} {dtype} on {device}: largest gap {gap:.2e} of the largest logit"
                );
                assert!(gap <= tolerance, "{variant} {dtype} on {device}: {gap:e}");
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
