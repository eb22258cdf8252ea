//! `ferry bench optim`: ferry's CPU AdamW ([`ferry::optim::host`]) in parameters per second on
//! one large tensor and on a Llama's tensors, against the host's bus measured in the same run
//! and, with --compare-pytorch, torch's fused CPU AdamW (python/optim.py), sampled alternately.
//! Needs no GPU. Bytes count as STREAM counts them: an AdamW step moves 28 bytes a parameter
//! (f32 gradients; or bf16 gradients and a bf16 copy written). The bus is the larger of a
//! parallel copy and AdamW's access pattern without its arithmetic ([`BusPass`]).

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use ferry::memory::bf16;
use ferry::memory::simd::{self, Level};
use ferry::optim::host::{self, AdamTensor, GradSlice, ParamSlice};
use rayon::prelude::*;
use serde_json::json;

use crate::harness;
use crate::harness::measure::Measured;
use crate::harness::pytorch::{PyTorch, PyTorchArgs};
use crate::harness::report::significant;
use crate::harness::table::{Cell, Report, Table};

#[derive(Args, Debug)]
pub struct OptimArgs {
    #[command(flatten)]
    pytorch: PyTorchArgs,
    /// Write every sample of both sides to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Parameters of the one-tensor case, in millions.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=16384))]
    million: u64,
    /// Timed steps per case and side; the table shows their median.
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u32).range(1..))]
    samples: u32,
    /// Untimed steps before them (the first touches every page).
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// MiB of the copy that measures the host's bandwidth (large enough to leave every cache).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=65536))]
    copy_mib: u64,
    /// Run only these cases (one, model, model-bf16).
    #[arg(long, value_delimiter = ',')]
    cases: Vec<String>,
}

/// The Llama that `python -m ferry.bench` trains (crates/ferry-py/python/ferry/bench_models.py):
/// hidden 2048, intermediate 5632, 32 heads of which 4 for keys and values, vocab 32000, 19
/// layers; python/optim.py builds it from transformers and reports its counts, which must agree.
fn llama_shapes() -> Vec<usize> {
    let (h, inter, kv, vocab) = (2048, 5632, 4 * 64, 32000);
    let mut sizes = vec![vocab * h];
    for _ in 0..19 {
        // q, k, v, o, gate, up, down, the two norms.
        sizes.extend([h * h, kv * h, kv * h, h * h, inter * h, inter * h, h * inter, h, h]);
    }
    sizes.extend([h, vocab * h]);
    sizes
}

/// `bf16`: bf16 gradients in and a bf16 copy of the weights out (offload's step), else f32 in
/// and none out. torch's fused AdamW takes no mixed dtypes: only f32 cases have its column.
struct Case {
    id: &'static str,
    what: String,
    sizes: Vec<usize>,
    bf16: bool,
}

fn cases(args: &OptimArgs) -> Vec<Case> {
    let llama = llama_shapes();
    let params = llama.iter().sum::<usize>() as f64;
    let what = format!("Llama {:.2} B, {} tensors", params / 1e9, llama.len());
    let case = |id, what, sizes, bf16| Case { id, what, sizes, bf16 };
    let one = vec![(args.million * 1_000_000) as usize];
    vec![
        case("one", format!("one tensor, {}M", args.million), one, false),
        case("model", what.clone(), llama.clone(), false),
        case("model-bf16", format!("{what}, bf16 grads and copy"), llama, true),
    ]
}

/// A case's host state: master weights, moments, gradients and (bf16 cases) the weights' copy.
struct State {
    master: Vec<Vec<f32>>,
    exp_avg: Vec<Vec<f32>>,
    exp_avg_sq: Vec<Vec<f32>>,
    grad: Vec<Vec<f32>>,
    grad_bf16: Vec<Vec<bf16>>,
    out_bf16: Vec<Vec<bf16>>,
}

/// A buffer of `v` per size, or none.
fn filled<T: Clone>(sizes: &[usize], v: T, wanted: bool) -> Vec<Vec<T>> {
    let all = sizes.iter().map(|&n| vec![v.clone(); n]);
    if wanted { all.collect() } else { Vec::new() }
}

impl State {
    fn new(case: &Case) -> Self {
        let (sizes, half) = (&case.sizes[..], case.bf16);
        Self {
            master: filled(sizes, 0.5, true),
            exp_avg: filled(sizes, 0.0, true),
            exp_avg_sq: filled(sizes, 0.0, true),
            grad: filled(sizes, 0.01, !half),
            grad_bf16: filled(sizes, bf16::from_f32(0.01), half),
            out_bf16: filled(sizes, bf16::from_f32(0.0), half),
        }
    }

    fn step(&mut self, t: u64) -> ferry::Result<()> {
        let step = host::adamw_step(t, 1e-3, (0.9, 0.999), 1e-8, 0.01);
        let n = self.master.len();
        let mut outs = self.out_bf16.iter_mut().map(|o| Some(ParamSlice::Bf16(o)));
        let tensors = self
            .master
            .iter_mut()
            .zip(&mut self.exp_avg)
            .zip(&mut self.exp_avg_sq)
            .enumerate()
            .map(|(i, ((master, exp_avg), exp_avg_sq))| AdamTensor {
                master,
                exp_avg,
                exp_avg_sq,
                grad: match self.grad.get(i) {
                    Some(g) => GradSlice::F32(g),
                    None => GradSlice::Bf16(&self.grad_bf16[i]),
                },
                out: outs.next().flatten(),
            })
            .collect::<Vec<_>>();
        debug_assert_eq!(tensors.len(), n);
        host::adamw(&step, tensors)
    }
}

/// MemAvailable from /proc/meminfo, where there is one.
fn available_bytes() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// One parallel copy of `src` into `dst` on all cores, in milliseconds.
fn copy_ms(src: &[u8], dst: &mut [u8]) -> f64 {
    let start = Instant::now();
    dst.par_chunks_mut(1 << 20)
        .zip(src.par_chunks(1 << 20))
        .for_each(|(d, s)| d.copy_from_slice(s));
    start.elapsed().as_secs_f64() * 1e3
}

/// AdamW's traffic without its arithmetic: four f32 streams read, three written back in place
/// (`p += g`, `m += g`, `v += g`), in the same blocks on the same cores. What the bus moves for
/// this access pattern, the ceiling AdamW is judged against (a plain copy pays for reading each
/// destination line before writing it, which this pattern does not, so it understates the bus).
struct BusPass {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
}

impl BusPass {
    fn new(bytes: usize) -> Self {
        let n = bytes / 4;
        Self {
            p: vec![0.5; n],
            m: vec![0.0; n],
            v: vec![0.0; n],
            g: vec![1e-3; n],
        }
    }

    /// Bytes one pass moves.
    fn bytes(&self) -> f64 {
        28.0 * self.p.len() as f64
    }

    fn run_ms(&mut self) -> f64 {
        let start = Instant::now();
        let state = self
            .m
            .par_chunks_mut(host::BLOCK)
            .zip(self.v.par_chunks_mut(host::BLOCK));
        self.p
            .par_chunks_mut(host::BLOCK)
            .zip(state)
            .zip(self.g.par_chunks(host::BLOCK))
            .for_each(|((p, (m, v)), g)| {
                simd::vectorized_wide(|| {
                    let n = p.len();
                    let (m, v, g) = (&mut m[..n], &mut v[..n], &g[..n]);
                    for i in 0..n {
                        p[i] += g[i];
                        m[i] += g[i];
                        v[i] += g[i];
                    }
                })
            });
        start.elapsed().as_secs_f64() * 1e3
    }
}

pub fn run(args: OptimArgs) -> Result<(), Box<dyn Error>> {
    let table = cases(&args);
    let picked = harness::select(&table, &args.cases, "case", |c| c.id)?;
    let mut side = args.pytorch.side("optim.py", "column");
    let threads = rayon::current_num_threads();

    // The bus: a copy (both sides, alternately) and AdamW's traffic without its arithmetic.
    let copy_bytes = (args.copy_mib as usize) << 20;
    let src = vec![1u8; copy_bytes];
    let mut dst = vec![0u8; copy_bytes];
    let mut pass = BusPass::new(copy_bytes);
    let (mut copy, mut torch_copy, mut passes) =
        (Measured::new(), Measured::new(), Measured::new());
    for round in 0..args.warmup + args.samples {
        let ms = copy_ms(&src, &mut dst);
        let pass_ms = pass.run_ms();
        let theirs = side
            .torch()
            .map(|t| t.request(&format!("copy {copy_bytes}")));
        if round >= args.warmup {
            copy.push(ms);
            passes.push(pass_ms);
            if let Some(round) = theirs {
                torch_copy.record(round.map(|r| r["ms"].as_f64().unwrap_or(f64::NAN)), true);
            }
        }
    }
    let pass_bytes = pass.bytes();
    drop((src, dst, pass));
    let gbs = |bytes: f64, ms: f64| bytes / ms / 1e6;
    let copied = gbs(copy_bytes as f64, copy.median().unwrap_or(f64::NAN));
    let pattern = gbs(pass_bytes, passes.median().unwrap_or(f64::NAN));
    let bus = pattern.max(2.0 * copied);

    let mut rows = Table::new(&[
        "case",
        "ferry",
        "G params/s",
        "GB/s moved",
        "of the bus",
        "torch fused",
        "torch G params/s",
        "ferry speed-up",
    ]);
    let mut notes = Vec::new();
    for case in picked {
        let params: usize = case.sizes.iter().sum();
        // 16 bytes a parameter (weight, moments, an f32 gradient or a bf16 one and a copy),
        // twice with torch's.
        let with_torch = !case.bf16 && side.torch.is_some();
        let need = 16 * params * if with_torch { 2 } else { 1 };
        if let Some(free) = available_bytes().filter(|&free| need > free * 9 / 10) {
            notes.push(format!(
                "{}: skipped, needs {:.1} GB of host memory and {:.1} GB is available",
                case.id,
                need as f64 / 1e9,
                free as f64 / 1e9
            ));
            continue;
        }
        let mut state = State::new(case);
        let mut torch = Measured::new();
        let agree = |t: &mut PyTorch| -> Result<(), String> {
            let reply = t.request(&format!("case {} {params}", case.id))?;
            let theirs = (reply["tensors"].as_u64(), reply["params"].as_u64());
            let n = case.sizes.len();
            (theirs == (Some(n as u64), Some(params as u64))).then_some(()).ok_or_else(|| {
                format!("PyTorch's case has {theirs:?} (tensors, params), ferry's ({n}, {params})")
            })
        };
        let torch_ready = match side.torch().filter(|_| with_torch).map(agree) {
            Some(Err(err)) => {
                torch.fail(err);
                false
            }
            agreed => agreed.is_some(),
        };
        let mut ferry = Measured::new();
        for round in 0..args.warmup + args.samples {
            let start = Instant::now();
            state.step(u64::from(round) + 1)?;
            let ms = start.elapsed().as_secs_f64() * 1e3;
            let theirs = side
                .torch()
                .filter(|_| torch_ready)
                .map(|t| t.sample("step"));
            if round >= args.warmup {
                ferry.push(ms);
                if let Some(round) = theirs {
                    torch.record(round, true);
                }
            }
        }
        drop(state);
        if let Some(err) = &torch.error {
            notes.push(format!("{}: PyTorch: {err}", case.id));
        }
        let (ours, theirs) = (ferry.complete_median(), torch.complete_median());
        let per_s = |ms: Option<f64>| Cell::number(ms.map(|ms| params as f64 / ms / 1e6));
        let moved = ours.map(|ms| gbs(28.0 * params as f64, ms));
        let ms = |x: f64| format!("{} ms", significant(x));
        rows.push_with(
            vec![
                Cell::text(&case.what),
                Cell::median_shown(&ferry, ms),
                per_s(ours),
                Cell::number(moved),
                Cell::shown(moved.map(|m| m / bus), |x| format!("{}%", significant(100.0 * x))),
                Cell::median_shown(&torch, ms),
                per_s(theirs),
                Cell::ratio(theirs, ours),
            ],
            json!({
                "id": case.id, "tensors": case.sizes.len(), "params": params, "bf16": case.bf16,
            }),
        );
    }

    let torch_copied = torch_copy.median().map_or(String::new(), |ms| {
        let copied = significant(gbs(copy_bytes as f64, ms));
        format!("; torch's copy_ {copied} GB/s copied")
    });
    let mut title = format!(
        "ferry bench optim: AdamW over host memory, {threads} threads, {} vectors; median of {} \
         steps after {} untimed",
        Level::detect().name(),
        args.samples,
        args.warmup
    );
    for line in side.label.iter().map(|l| format!("PyTorch {l}")).chain(side.note.clone()) {
        title += &format!("\n{line}");
    }
    title += &format!(
        "\nhost memory, {} MiB a stream, all cores: a copy {} GB/s copied ({} GB/s read and \
         written{torch_copied}); AdamW's pattern without arithmetic {} GB/s read and written",
        args.copy_mib,
        significant(copied),
        significant(2.0 * copied),
        significant(pattern),
    );
    let mut report = Report::new("optim", title).with_facts(json!({
        "threads": threads,
        "vectors": Level::detect().name(),
        "pytorch": side.label,
        "copy_bytes": copy_bytes,
        "copy_ms": copy.samples_ms,
        "pattern_bytes": pass_bytes,
        "pattern_ms": passes.samples_ms,
        "torch_copy_ms": torch_copy.samples_ms,
        "torch_copy_error": torch_copy.error,
    }));
    report.table("cases", None, rows);
    for note in notes {
        report.note(note);
    }
    report.note(format!(
        "goals (H200 host): speed-up >= 1.25 over torch fused; GB/s moved >= 80% of the bus, the \
         larger of the two read+written figures above ({} GB/s here)",
        significant(bus)
    ));
    report.finish(args.json.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_llama_list_has_the_python_models_counts() {
        let sizes = llama_shapes();
        assert_eq!(sizes.len(), 19 * 9 + 3);
        // 0.97 B, as bench_models.py says of its 19 layers.
        let params: usize = sizes.iter().sum();
        assert_eq!(params, 967_915_520);
    }

    use serde_json::Value;

    #[test]
    fn a_small_run_steps_and_writes_its_json() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("optim.json");
        let crate::BenchCommand::Optim(args) = crate::parse_bench(&format!(
            "ferry bench optim --million 1 --copy-mib 8 --cases one --samples 2 --warmup 1 --json {}",
            json.display()
        ))
        .unwrap() else {
            panic!("not the optim bench")
        };
        run(args).unwrap();
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(doc["cases"][0]["params"], 1_000_000);
        assert_eq!(doc["cases"][0]["ferry"]["samples_ms"].as_array().unwrap().len(), 2);
        assert_eq!(doc["copy_ms"].as_array().unwrap().len(), 2);
        assert_eq!(doc["pattern_ms"].as_array().unwrap().len(), 2);
    }
}
