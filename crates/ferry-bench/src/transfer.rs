//! `ferry bench transfer`: the device moves of the performance issue, measured against the link
//! and, with --compare-pytorch, against PyTorch, in one run on one machine.
//!
//! The link (a plain pinned DMA of the same 400 MB, each direction) is measured first. Every
//! case is then warmed up and sampled alternately, ferry then PyTorch, and reported as medians.
//! ferry's side of each case is one function in `ferry_cases`; PyTorch's is the function of the
//! same id in python/transfer.py.

use std::error::Error;

use clap::Args;

use crate::Measured;
use crate::harness::pytorch::PyTorch;
use crate::harness::{self, NO_CUDA_DEVICE, RunSetup, SampledArgs};
use cases::{Case, cases, select};
use ferry_cases::{self as ferry_side, BenchResult, Fixture};
use output::{CaseResult, LinkSpeed, print_header, print_results, to_json};

mod cases;
mod ferry_cases;
mod output;
mod resnet50;

#[derive(Args, Debug)]
pub struct TransferArgs {
    #[command(flatten)]
    run: SampledArgs,
    /// Only these cases (ids joined by commas, listed under the table); the link always runs.
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    cases: Vec<String>,
    /// Internal: time one cpu() in this fresh process and print its milliseconds.
    #[arg(long, hide = true)]
    first_cpu_sample: bool,
}

/// Warm-up rounds, then timed rounds; each round runs ferry's sample, then PyTorch's.
fn measure<'a>(
    case: &'a Case,
    fx: &mut Fixture,
    mut torch: Option<&mut PyTorch>,
    warmup: u32,
    samples: u32,
) -> BenchResult<CaseResult<'a>> {
    let mut m = CaseResult {
        case,
        ferry: Measured::new(),
        staging_peak: None,
        pytorch: Measured::new(),
    };
    for round in 0..warmup + samples {
        let timed = round >= warmup;
        if !m.ferry.is_failed() {
            fx.dev.synchronize()?;
            match (case.run)(fx) {
                Ok(sample) if timed => {
                    m.ferry.push(sample.ms);
                    m.staging_peak = m.staging_peak.max(sample.staging_peak_bytes);
                }
                Ok(_) => {}
                Err(err) => m.ferry.fail(err.to_string()),
            }
        }
        if let (Some(torch), false) = (torch.as_deref_mut(), m.pytorch.is_failed()) {
            match torch.sample(case.id) {
                Ok(ms) if timed => m.pytorch.push(ms),
                Ok(_) => {}
                Err(err) => m.pytorch.fail(err),
            }
        }
        if m.ferry.is_failed() && (torch.is_none() || m.pytorch.is_failed()) {
            break;
        }
    }
    Ok(m)
}

pub fn run(args: TransferArgs) -> Result<(), Box<dyn Error>> {
    if args.first_cpu_sample {
        println!("{}", ferry_side::first_cpu_in_this_process()?);
        return Ok(());
    }
    let all = cases();
    let selected = select(&all, &args.cases)?;
    let Some(dev) = harness::cuda_device_or_say(0, |err| format!("{NO_CUDA_DEVICE}: {err}")) else {
        return Ok(());
    };
    let mut torch = args.run.pytorch.side("transfer.py", "column");
    let mut info = RunSetup {
        device: format!("{} ({})", dev.device(), dev.info().name),
        on_gpu: true,
        samples: args.run.samples,
        warmup: args.run.warmup,
        pytorch: torch.label.clone(),
        pytorch_note: torch.note.clone(),
    };
    print_header(&info);
    let mut fx = Fixture::new(dev)?;
    let mut measured = Vec::new();
    for case in &selected {
        eprintln!("measuring {} ...", case.id);
        let m = measure(
            case,
            &mut fx,
            torch.torch(),
            args.run.warmup,
            args.run.samples,
        )?;
        if let Some(note) = torch.ended_during(case.id, &m.pytorch) {
            info.pytorch_note = Some(note);
        }
        measured.push(m);
    }
    drop(fx);
    let link = LinkSpeed::from_measured(&measured);
    print_results(&measured, link, &info);
    if let Some(path) = &args.run.json {
        harness::write_json(path, &to_json(&info, &measured, link), "sample")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    /// crates/ferry-bench/README.md's commands are the ones a reader copies: they must parse.
    #[test]
    fn the_readme_commands_parse() {
        let readme = include_str!("../README.md");
        let commands: Vec<&str> = readme
            .lines()
            .filter_map(|l| l.strip_prefix("cargo run --release -p ferry-cli -- "))
            .collect();
        assert!(!commands.is_empty());
        for command in commands {
            if let Err(err) = crate::parse_bench(&format!("ferry {command}")) {
                panic!("`{command}` does not parse: {err}");
            }
        }
    }
}
