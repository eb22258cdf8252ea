//! `ferry bench train --profile`: where the time of ferry's step goes on the GPU, after the timed
//! rounds of each case.
//!
//! Three views of the same steps. *As run*: a timed event at the end of each phase of a step
//! (zero_grad, forward, loss, backward, optimizer step) and the host's clock at the same points;
//! a phase's GPU time then includes any wait for the host. *Host ahead*: before each step the GPU
//! is given a few long products to run, so the host queues the whole step while the GPU is busy
//! and each phase's GPU time is its own work (unless the step synchronizes: then the phases after
//! that point wait for the host again, which shows as their host time). *Kernels*: in the host-
//! ahead steps, every launch, GEMM and convolution timed on its own (the device's kernel
//! profiler), summed by name per step.
//!
//! With `--compare-pytorch` PyTorch's side profiles the same number of its own steps under
//! torch.profiler (its kernels summed by name per step), and both sides' kernels are summed
//! into the same categories (GEMMs, attention, elementwise, copies and casts, ...), side by side.

use std::error::Error;
use std::time::Instant;

use ferry::cuda_libs::Profiling;
use ferry::memory::cuda::{CudaDevice, Event};
use ferry::prelude::*;

use serde_json::Value;

use super::cases::{Case, PHASES, Phase};
use super::step::FerryRun;
use crate::harness::pytorch::PyTorch;
use crate::harness::table::{Cell, Table};

/// Products the GPU runs ahead of each host-ahead step (about 2.6 ms each on an H200 in f32).
const HEAD_START: usize = 3;
const HEAD_START_SIDE: usize = 4000;

/// Mean host and GPU milliseconds per phase over `steps` steps; `head_start` runs before each.
fn phase_times(
    run: &mut FerryRun,
    dev: &CudaDevice,
    steps: u32,
    head_start: Option<&(Tensor, Tensor)>,
) -> Result<([f64; 5], [f64; 5]), Box<dyn Error>> {
    let stream = dev.default_stream();
    let mut host = [0.0; 5];
    let mut marks: Vec<(Event, Vec<Event>)> = Vec::new();
    for _ in 0..steps {
        if let Some((a, b)) = head_start {
            let _no_grad = ferry::no_grad();
            for _ in 0..HEAD_START {
                a.matmul(b)?;
            }
        }
        let start = stream.record_timed()?;
        let mut ends = Vec::with_capacity(PHASES.len());
        let mut last = Instant::now();
        run.step_marked(&mut |phase: Phase| {
            ends.push(stream.record_timed()?);
            let now = Instant::now();
            host[phase as usize] += (now - last).as_secs_f64() * 1e3;
            last = now;
            Ok(())
        })?;
        marks.push((start, ends));
    }
    dev.synchronize()?;
    let mut gpu = [0.0; 5];
    for (start, ends) in &marks {
        let mut from = start;
        for (i, end) in ends.iter().enumerate() {
            gpu[i] += f64::from(Event::elapsed_ms(from, end)?);
            from = end;
        }
    }
    let n = f64::from(steps);
    Ok((host.map(|t| t / n), gpu.map(|t| t / n)))
}

/// One kernel's time in a step: launches and microseconds per step.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StepKernel {
    pub name: String,
    pub launches: f64,
    pub us: f64,
}

/// Profiles `steps` of ferry's steps of `case` on its GPU, prints the three views, and returns
/// the kernels per step (empty without a GPU).
pub(crate) fn profile(
    case: &Case,
    run: &mut FerryRun,
    steps: u32,
) -> Result<Vec<StepKernel>, Box<dyn Error>> {
    let Some(dev) = run.cuda.clone() else {
        println!("profile of {}: needs a GPU", case.id);
        return Ok(Vec::new());
    };
    let device = dev.device();
    let side = [HEAD_START_SIDE, HEAD_START_SIDE];
    let head_start = (
        Tensor::randn(&side, DType::F32, device)?,
        Tensor::randn(&side, DType::F32, device)?,
    );
    let (host, as_run) = phase_times(run, &dev, steps, None)?;
    dev.start_profile();
    let timed = phase_times(run, &dev, steps, Some(&head_start));
    let kernels = dev.stop_profile()?;
    let (_, ahead) = timed?;

    println!();
    let (id, what) = (case.id, case.describe());
    println!("profile of {id} ({what}; {steps} steps each view, means per step):");
    let ms = |v: f64| Cell::text(format!("{v:.3}"));
    let mut phases = Table::new(&[
        "phase",
        "host ms (as run)",
        "GPU ms (as run)",
        "GPU ms (host ahead)",
    ]);
    for (i, phase) in PHASES.iter().enumerate() {
        phases.push(vec![Cell::text(phase.label()), ms(host[i]), ms(as_run[i]), ms(ahead[i])]);
    }
    let sum = |v: &[f64; 5]| ms(v.iter().sum());
    phases.push(vec![Cell::text("step"), sum(&host), sum(&as_run), sum(&ahead)]);
    phases.print();
    let head = format!("gemm {HEAD_START_SIDE}x{HEAD_START_SIDE}x{HEAD_START_SIDE}");
    let kernels: Vec<_> = kernels
        .into_iter()
        .filter(|k| !k.name.starts_with(&head))
        .collect();
    let total: f64 = kernels.iter().map(|k| k.total_ms).sum();
    let n = f64::from(steps);
    let mut table = Table::new(&["kernel (host ahead)", "launches/step", "µs/step", "share"]);
    let mut row = |name: String, launches: Option<u64>, ms: f64| {
        let share = match name.as_str() {
            "all" => "100%".into(),
            _ => format!("{:.1}%", 100.0 * ms / total.max(f64::MIN_POSITIVE)),
        };
        table.push(vec![
            Cell::text(name),
            Cell::text(launches.map_or(String::new(), |l| format!("{:.1}", l as f64 / n))),
            Cell::text(format!("{:.1}", ms * 1e3 / n)),
            Cell::text(share),
        ]);
    };
    for k in kernels.iter().take(30) {
        row(k.name.clone(), Some(k.launches), k.total_ms);
    }
    if kernels.len() > 30 {
        let rest: f64 = kernels[30..].iter().map(|k| k.total_ms).sum();
        row(format!("{} more", kernels.len() - 30), None, rest);
    }
    let launches: u64 = kernels.iter().map(|k| k.launches).sum();
    row("all".into(), Some(launches), total);
    println!();
    table.print();
    Ok(kernels
        .into_iter()
        .map(|k| StepKernel {
            us: k.total_ms * 1e3 / n,
            launches: k.launches as f64 / n,
            name: k.name,
        })
        .collect())
}

/// The categories both sides' kernels are summed into, in the order they are printed.
const CATEGORIES: [&str; 8] = [
    "GEMMs",
    "fused attention",
    "elementwise",
    "copies and casts",
    "reductions and losses",
    "norms",
    "optimizer",
    "other",
];

/// The category of a kernel, by ferry's names (kernels/*.cu, cuBLAS and cuDNN calls as the
/// profiler names them) and by PyTorch's (ATen's templates, cuBLAS's, FlashAttention's and
/// cuDNN's kernels as torch.profiler names them).
pub(crate) fn category(name: &str) -> &'static str {
    let n = name.to_ascii_lowercase();
    let has = |parts: &[&str]| parts.iter().any(|p| n.contains(p));
    if has(&["sdpa", "flash", "fmha", "attention", "attn"]) {
        "fused attention"
    } else if has(&["gemm", "nvjet", "cutlass", "xmma", "s16816", "cublas", "matmul"]) {
        "GEMMs"
    } else if has(&["adam", "multi_tensor_apply", "optim"]) {
        "optimizer"
    } else if has(&["layer_norm", "rms_norm", "layernorm", "rmsnorm", "gammabeta"]) {
        "norms"
    } else if has(&["copy", "cast_", "gather_regions", "cat_array", "catarray"]) {
        "copies and casts"
    } else if has(&[
        "reduce", "sum_", "softmax", "nll", "cross_entropy", "logsumexp",
    ]) {
        "reductions and losses"
    } else if has(&[
        "elementwise", "binary_", "unary_", "where_", "fill_", "compare_", "dropout",
        "masked_scale", "rotary_", "arange_", "random_", "functor",
    ]) {
        "elementwise"
    } else {
        "other"
    }
}

/// PyTorch's kernels per step for `steps` of its steps of `case` (its `profile` request).
fn pytorch_kernels(torch: &mut PyTorch, case: &Case, steps: u32) -> Result<Vec<StepKernel>, String> {
    let reply = torch.request(&format!("profile {} {steps}", case.id))?;
    let kernels = reply
        .get("kernels")
        .and_then(Value::as_array)
        .ok_or_else(|| format!("PyTorch's profile reply has no kernels: {reply}"))?;
    Ok(kernels
        .iter()
        .filter_map(|k| {
            Some(StepKernel {
                name: k.get("name")?.as_str()?.to_string(),
                launches: k.get("launches")?.as_f64()?,
                us: k.get("us")?.as_f64()?,
            })
        })
        .collect())
}

/// Prints PyTorch's kernel table for `case` and both sides' kernels summed by category.
pub(crate) fn compare_with_pytorch(
    case: &Case,
    ferry: &[StepKernel],
    torch: &mut PyTorch,
    steps: u32,
) -> Result<(), String> {
    let theirs = pytorch_kernels(torch, case, steps)?;
    let us = |v: f64| Cell::text(format!("{v:.1}"));
    let mut table = Table::new(&["PyTorch kernel", "launches/step", "µs/step"]);
    for k in theirs.iter().take(30) {
        // Template arguments make ATen's names hundreds of characters long.
        let short: String = k.name.chars().take(110).collect();
        table.push(vec![Cell::text(short), Cell::text(format!("{:.1}", k.launches)), us(k.us)]);
    }
    let rest: f64 = theirs.iter().skip(30).map(|k| k.us).sum();
    if theirs.len() > 30 {
        table.push(vec![Cell::text(format!("{} more", theirs.len() - 30)), Cell::text(""), us(rest)]);
    }
    println!();
    println!("PyTorch's kernels in {} ({steps} steps under torch.profiler, means per step):", case.id);
    table.print();
    let sums = |kernels: &[StepKernel]| {
        let mut by = [0.0f64; CATEGORIES.len()];
        let mut launches = [0.0f64; CATEGORIES.len()];
        for k in kernels {
            let i = CATEGORIES.iter().position(|c| *c == category(&k.name)).unwrap_or(7);
            by[i] += k.us;
            launches[i] += k.launches;
        }
        (by, launches)
    };
    let ((ours, our_launches), (their, their_launches)) = (sums(ferry), sums(&theirs));
    let ms = |v: f64| Cell::text(format!("{:.2}", v / 1e3));
    let count = |v: f64| Cell::text(format!("{v:.0}"));
    let mut side = Table::new(&[
        "category",
        "ferry ms/step",
        "PyTorch ms/step",
        "ferry - PyTorch",
        "ferry launches",
        "PyTorch launches",
    ]);
    for (i, name) in CATEGORIES.iter().enumerate() {
        side.push(vec![
            Cell::text(*name),
            ms(ours[i]),
            ms(their[i]),
            ms(ours[i] - their[i]),
            count(our_launches[i]),
            count(their_launches[i]),
        ]);
    }
    let total = |v: &[f64]| v.iter().sum::<f64>();
    side.push(vec![
        Cell::text("all kernels"),
        ms(total(&ours)),
        ms(total(&their)),
        ms(total(&ours) - total(&their)),
        count(total(&our_launches)),
        count(total(&their_launches)),
    ]);
    println!();
    println!(
        "{}: kernel time by category, ferry (host ahead, each launch timed) and PyTorch \
         (torch.profiler):",
        case.id
    );
    side.print();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::category;

    /// Names as each profiler printed them on the H200 (ferry's) and as ATen, cuBLAS and the
    /// attention libraries name theirs.
    #[test]
    fn both_sides_kernels_fall_in_the_same_categories() {
        let cases = [
            ("gemm+bias 8192x8192x2048 TN BF16", "GEMMs"),
            ("gemm 2048x8192x8192 NT BF16", "GEMMs"),
            ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "GEMMs"),
            ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMMs"),
            ("cudnn sdpa Backward SdpaSpec { batch: 8 }", "fused attention"),
            ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "fused attention"),
            ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "fused attention"),
            ("binary_bf16", "elementwise"),
            ("unary_bf16", "elementwise"),
            ("rotary_bf16", "elementwise"),
            ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
            ("cast_float_bf16", "copies and casts"),
            ("copy_b16", "copies and casts"),
            ("void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>", "copies and casts"),
            ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>", "copies and casts"),
            ("sum_col_tiled_bf16", "reductions and losses"),
            ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "reductions and losses"),
            ("cross_entropy_backward_float", "reductions and losses"),
            ("layer_norm_backward_float", "norms"),
            ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", "norms"),
            ("adam_float", "optimizer"),
            ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
            ("index_select_b32", "other"),
        ];
        for (name, want) in cases {
            assert_eq!(category(name), want, "{name}");
        }
    }
}
