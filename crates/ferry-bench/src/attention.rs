//! `ferry bench attention`: scaled-dot-product attention forward and backward in TFLOP/s, ferry's
//! op beside PyTorch's `scaled_dot_product_attention` (python/attention.py) on the same shapes,
//! samples alternating. Shapes as FlashAttention's benchmarks take them: a fixed number of tokens
//! (batch = tokens / sequence) and a fixed width (heads = width / head dim), bf16, with and
//! without the causal mask. FLOPs: 4·B·H·T²·D forward (halved under the mask), 2.5 times that
//! backward. The goals are the H200's, judged on a GPU only.

use std::error::Error;
use std::time::Instant;

use clap::Args;
use ferry::prelude::*;
use ferry::{AttentionOptions, BackwardOptions};
use serde_json::json;

use crate::harness::goal::{Bound, Goal};
use crate::harness::measure::Measured;
use crate::harness::pytorch::PyTorch;
use crate::harness::table::{Cell, Report, Table};
use crate::harness::{self, SampledArgs};

#[derive(Args, Debug)]
pub struct AttentionArgs {
    #[command(flatten)]
    run: SampledArgs,
    /// Where ferry runs: cuda:N, or cpu for a small check of the path.
    #[arg(long, default_value = "cuda:0")]
    device: Device,
    /// Sequence lengths (queries and keys alike).
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,8192")]
    seqs: Vec<usize>,
    /// Head dims.
    #[arg(long, value_delimiter = ',', default_value = "64,128")]
    head_dims: Vec<usize>,
    /// Tokens per call: batch = tokens / sequence (at least 1).
    #[arg(long, default_value_t = 16384)]
    tokens: usize,
    /// Model width: heads = width / head dim.
    #[arg(long, default_value_t = 2048)]
    width: usize,
    /// Query heads per key/value head (1: none shared).
    #[arg(long, default_value_t = 1)]
    group: usize,
    /// bf16, f16 or f32.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f16", "f32"])]
    dtype: String,
}

/// One row's shape.
#[derive(Debug, Clone, Copy)]
struct Shape {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    seq: usize,
    dim: usize,
    causal: bool,
}

impl Shape {
    /// Forward FLOPs: two products of 2·B·H·T²·D each, half of them under the mask.
    fn forward_flops(&self) -> f64 {
        let full = 4.0 * (self.batch * self.heads) as f64 * (self.seq * self.seq * self.dim) as f64;
        if self.causal { full / 2.0 } else { full }
    }

    fn id(&self) -> String {
        let mask = if self.causal { "causal" } else { "full" };
        format!("T {} d {} {mask}", self.seq, self.dim)
    }
}

/// The goals, judged per row on a GPU: the fused rates at sequence >= 2048 and head dim 128,
/// and ferry's time over PyTorch's at most 1 on every row.
const FORWARD_GOAL: Goal = Goal {
    name: "forward TFLOP/s at T >= 2048, d 128",
    metric: "ferry forward TFLOP/s",
    bound: Bound::AtLeast(450.0),
};
const BACKWARD_GOAL: Goal = Goal {
    name: "backward TFLOP/s at T >= 2048, d 128",
    metric: "ferry backward TFLOP/s",
    bound: Bound::AtLeast(350.0),
};
const PARITY_GOAL: Goal = Goal {
    name: "ferry / PyTorch time, forward and backward",
    metric: "ferry ms / PyTorch ms",
    bound: Bound::AtMost(1.0),
};

/// ferry's tensors of one row: q, k, v requiring grad, and the output's gradient.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad: Tensor,
    options: AttentionOptions,
}

impl Inputs {
    fn new(s: &Shape, dtype: DType, device: Device) -> ferry::Result<Self> {
        ferry::manual_seed(0);
        let draw = |heads: usize| -> ferry::Result<Tensor> {
            Tensor::randn(&[s.batch, heads, s.seq, s.dim], DType::F32, device)?
                .to_dtype(dtype)?
                .with_grad()
        };
        let (q, k, v) = (draw(s.heads)?, draw(s.kv_heads)?, draw(s.kv_heads)?);
        let grad = Tensor::randn(&[s.batch, s.heads, s.seq, s.dim], DType::F32, device)?
            .to_dtype(dtype)?;
        let options = AttentionOptions {
            causal: s.causal,
            ..AttentionOptions::default()
        };
        Ok(Self {
            q,
            k,
            v,
            grad,
            options,
        })
    }

    fn forward(&self) -> ferry::Result<Tensor> {
        self.q
            .scaled_dot_product_attention(&self.k, &self.v, self.options)
    }
}

/// Milliseconds of `work`, the device synchronized before the clock starts and before it
/// stops.
fn timed(device: Device, work: impl FnOnce() -> ferry::Result<()>) -> Result<f64, String> {
    let sync = || -> Result<(), String> {
        match device {
            Device::Cuda(n) => harness::cuda_device(n)
                .and_then(|d| d.synchronize())
                .map_err(|e| e.to_string()),
            _ => Ok(()),
        }
    };
    sync()?;
    let start = Instant::now();
    work().map_err(|e| e.to_string())?;
    sync()?;
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

/// One round of ferry's side: the forward, then (after an untimed forward) the backward.
fn ferry_round(x: &Inputs, device: Device) -> [Result<f64, String>; 2] {
    let forward = timed(device, || x.forward().map(drop));
    let backward = x.forward().map_err(|e| e.to_string()).and_then(|out| {
        timed(device, || {
            out.backward_with(x.grad.clone(), BackwardOptions::default())
                .map(drop)
        })
    });
    for t in [&x.q, &x.k, &x.v] {
        t.set_grad(None);
    }
    [forward, backward]
}

/// Both sides of one row: forward and backward samples each.
struct Row {
    ferry: [Measured; 2],
    torch: [Measured; 2],
}

fn measure(
    s: Shape,
    dtype: DType,
    device: Device,
    mut torch: Option<&mut PyTorch>,
    run: &SampledArgs,
) -> Row {
    let mut row = Row {
        ferry: [Measured::new(), Measured::new()],
        torch: [Measured::new(), Measured::new()],
    };
    let inputs = Inputs::new(&s, dtype, device).map_err(|e| e.to_string());
    if let Err(err) = &inputs {
        row.ferry.iter_mut().for_each(|m| m.fail(err.clone()));
    }
    if let Some(t) = torch.as_deref_mut() {
        let name = match dtype {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            _ => "float32",
        };
        let place = if device == Device::Cpu { "cpu" } else { "cuda" };
        let request = format!(
            "case {place} {name} {} {} {} {} {} {}",
            s.batch, s.heads, s.kv_heads, s.seq, s.dim, s.causal as u8
        );
        if let Err(err) = t.request(&request) {
            row.torch.iter_mut().for_each(|m| m.fail(err.clone()));
        }
    }
    for round in 0..run.warmup + run.samples {
        let timed = round >= run.warmup;
        if let Ok(x) = &inputs {
            for (m, sample) in row.ferry.iter_mut().zip(ferry_round(x, device)) {
                m.record(sample, timed);
            }
        }
        if let Some(t) = torch.as_deref_mut() {
            for (m, request) in row.torch.iter_mut().zip(["forward", "backward"]) {
                if !m.is_failed() {
                    m.record(t.sample(request), timed);
                }
            }
        }
    }
    row
}

/// TFLOP/s of `flops` in a median of milliseconds.
fn rate(flops: f64, ms: Option<f64>) -> Option<f64> {
    ms.map(|ms| flops / ms / 1e9)
}

pub fn run(args: AttentionArgs) -> Result<(), Box<dyn Error>> {
    let dtype = match args.dtype.as_str() {
        "f16" => DType::F16,
        "f32" => DType::F32,
        _ => DType::BF16,
    };
    let on_gpu = args.device != Device::Cpu;
    let device_name = match args.device {
        Device::Cuda(n) => {
            let why_not = |err: &dyn std::fmt::Display| {
                harness::without_cuda(err, "run with --device cpu and small --seqs for a check")
            };
            let Some(dev) = harness::cuda_device_or_say(n, why_not) else {
                return Ok(());
            };
            format!("{} ({})", dev.device(), dev.info().name)
        }
        _ => "cpu".into(),
    };
    if args.group == 0 {
        return Err("--group must be at least 1".into());
    }
    let mut side = args.run.pytorch.side("attention.py", "column");
    let mut shapes = Vec::new();
    for &dim in &args.head_dims {
        let heads = (args.width / dim.max(1)).max(1);
        if !heads.is_multiple_of(args.group) {
            return Err(format!("--group {} must divide the {heads} heads of d {dim}", args.group).into());
        }
        for &seq in &args.seqs {
            for causal in [false, true] {
                shapes.push(Shape {
                    batch: (args.tokens / seq.max(1)).max(1),
                    heads,
                    kv_heads: heads / args.group,
                    seq,
                    dim,
                    causal,
                });
            }
        }
    }
    let mut table = Table::new(&[
        "case",
        "B x H",
        "ferry fwd TFLOP/s",
        "PyTorch fwd TFLOP/s",
        "fwd ferry/PyTorch",
        "ferry bwd TFLOP/s",
        "PyTorch bwd TFLOP/s",
        "bwd ferry/PyTorch",
    ]);
    let mut judged = Vec::new();
    let mut notes = Vec::new();
    for s in shapes {
        eprintln!("measuring {} ...", s.id());
        let row = measure(s, dtype, args.device, side.torch(), &args.run);
        for (i, m) in row.torch.iter().enumerate() {
            if let Some(note) = side.ended_during(&s.id(), m) {
                notes.push(note);
            } else if let (0, Some(err)) = (i, &m.error) {
                notes.push(format!("{}: PyTorch: {err}", s.id()));
            }
        }
        for (what, m) in ["forward", "backward"].iter().zip(&row.ferry) {
            if let Some(err) = &m.error {
                notes.push(format!("{}: ferry's {what}: {err}", s.id()));
            }
        }
        let flops = [s.forward_flops(), 2.5 * s.forward_flops()];
        let medians = |side: &[Measured; 2]| side.each_ref().map(Measured::complete_median);
        let (ours, theirs) = (medians(&row.ferry), medians(&row.torch));
        let ferry_rate = [0, 1].map(|i| rate(flops[i], ours[i]));
        let torch_rate = [0, 1].map(|i| rate(flops[i], theirs[i]));
        table.push_with(
            vec![
                Cell::text(s.id()),
                Cell::text(format!("{} x {}", s.batch, s.heads)),
                Cell::number(ferry_rate[0]).recorded(json!({
                    "tflops": ferry_rate[0], "samples_ms": row.ferry[0].samples_ms,
                })),
                Cell::number(torch_rate[0]).recorded(json!({
                    "tflops": torch_rate[0], "samples_ms": row.torch[0].samples_ms,
                })),
                Cell::ratio(theirs[0], ours[0]),
                Cell::number(ferry_rate[1]).recorded(json!({
                    "tflops": ferry_rate[1], "samples_ms": row.ferry[1].samples_ms,
                })),
                Cell::number(torch_rate[1]).recorded(json!({
                    "tflops": torch_rate[1], "samples_ms": row.torch[1].samples_ms,
                })),
                Cell::ratio(theirs[1], ours[1]),
            ],
            json!({
                "seq": s.seq, "head_dim": s.dim, "causal": s.causal, "batch": s.batch,
                "heads": s.heads, "kv_heads": s.kv_heads, "forward_flops": flops[0],
            }),
        );
        if on_gpu {
            let shown = |x: Option<f64>| x.map_or("-".into(), crate::harness::report::significant);
            if s.seq >= 2048 && s.dim == 128 && dtype == DType::BF16 {
                for (goal, r) in [FORWARD_GOAL, BACKWARD_GOAL].iter().zip(ferry_rate) {
                    judged.push(goal.judge(r, format!("{}: {}", s.id(), shown(r))));
                }
            }
            for i in 0..2 {
                let ratio = ours[i].zip(theirs[i]).map(|(f, t)| f / t);
                let which = ["forward", "backward"][i];
                judged.push(PARITY_GOAL.judge(ratio, format!("{} {which}: {}", s.id(), shown(ratio))));
            }
        }
    }
    let mut title = format!(
        "ferry bench attention on {device_name}: {} q, k, v [B, H, T, d], {} tokens a call, width \
         {}, {} query heads per key/value head; median of {} samples after {} untimed",
        args.dtype, args.tokens, args.width, args.group, args.run.samples, args.run.warmup
    );
    for line in side.label.iter().map(|l| format!("PyTorch {l}")).chain(side.note.clone()) {
        title += &format!("\n{line}");
    }
    let mut report = Report::new("attention", title).with_facts(json!({
        "device": device_name, "dtype": args.dtype, "tokens": args.tokens, "width": args.width,
        "group": args.group, "samples": args.run.samples, "warmup": args.run.warmup,
        "pytorch": side.label,
    }));
    report.table("rows", None, table);
    report.note(
        "TFLOP/s: 4·B·H·T²·d forward (half under the causal mask), 2.5x that backward; \
         ferry/PyTorch: PyTorch's time over ferry's (above 1, ferry is faster)",
    );
    if !on_gpu {
        report.note("goals: the H200's (forward >= 450, backward >= 350 TFLOP/s at T >= 2048, d 128, bf16; no slower than PyTorch); not judged on the CPU");
    }
    for note in notes {
        report.note(note);
    }
    report.goals(judged);
    report.finish(args.run.json.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn flops_follow_the_shape_and_the_mask() {
        let s = Shape {
            batch: 8,
            heads: 16,
            kv_heads: 16,
            seq: 2048,
            dim: 128,
            causal: false,
        };
        assert_eq!(s.forward_flops(), 4.0 * 128.0 * 2048.0 * 2048.0 * 128.0);
        let causal = Shape { causal: true, ..s };
        assert_eq!(causal.forward_flops(), s.forward_flops() / 2.0);
        assert_eq!(causal.id(), "T 2048 d 128 causal");
    }

    /// A small run on the CPU times both passes and writes its rows.
    #[test]
    fn a_small_cpu_run_times_both_passes() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("attention.json");
        let crate::BenchCommand::Attention(args) = crate::parse_bench(&format!(
            "ferry bench attention --device cpu --seqs 32 --head-dims 16 --tokens 64 --width 64 \
             --group 2 --dtype f32 --samples 2 --warmup 1 --json {}",
            json.display()
        ))
        .unwrap() else {
            panic!("not the attention bench")
        };
        run(args).unwrap();
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let rows = doc["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!((&rows[0]["batch"], &rows[0]["heads"], &rows[0]["kv_heads"]), (&json!(2), &json!(4), &json!(2)));
        for row in rows {
            for side in ["ferry_fwd_tflop_per_s", "ferry_bwd_tflop_per_s"] {
                assert_eq!(row[side]["samples_ms"].as_array().unwrap().len(), 2, "{row}");
                assert!(row[side]["tflops"].as_f64().unwrap() > 0.0, "{row}");
            }
        }
        assert_eq!(doc["goals"], json!([]));
    }
}
