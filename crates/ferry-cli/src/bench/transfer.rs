//! `ferry bench transfer`: the device moves of the performance issue, measured against the link
//! and, with --compare-pytorch, against PyTorch, in one run on one machine.
//!
//! The link (a plain pinned DMA of the same 400 MB, each direction) is measured first. Every
//! case is then warmed up and sampled alternately, ferry then PyTorch, and reported as medians.
//! ferry's side of each case is one function in `ferry_cases`; PyTorch's is the function of the
//! same id in bench/transfer.py.

use std::error::Error;
use std::path::PathBuf;

use clap::Args;
use ferry::memory::cuda::CudaDevice;

use super::ferry_cases::{self as ferry_side, BenchResult, Fixture};
use super::pytorch::{self, PyTorch};
use super::transfer_cases::{Case, cases, select};
use super::transfer_output::{LinkSpeed, Measured, RunInfo, print_header, print_results, to_json};

#[derive(Args, Debug)]
pub struct TransferArgs {
    /// Also run every case in PyTorch (bench/transfer.py), its samples interleaved with ferry's.
    #[arg(long)]
    compare_pytorch: bool,
    /// Write every number, all samples included, to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Timed samples per case and side; the table shows their median (claims need 9 or more).
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u32).range(1..))]
    samples: u32,
    /// Untimed rounds per case and side before the samples.
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// Only these cases (ids joined by commas, listed under the table); the link always runs.
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    cases: Vec<String>,
    /// The Python interpreter for --compare-pytorch.
    #[arg(long, default_value = "python3")]
    python: String,
    /// The PyTorch script [default: bench/transfer.py here, else in the source tree].
    #[arg(long, value_name = "PATH")]
    pytorch_script: Option<PathBuf>,
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
) -> BenchResult<Measured<'a>> {
    let mut m = Measured {
        case,
        ferry_ms: Vec::new(),
        staging_peak: None,
        ferry_error: None,
        pytorch_ms: Vec::new(),
        pytorch_error: None,
    };
    for round in 0..warmup + samples {
        let timed = round >= warmup;
        if m.ferry_error.is_none() {
            fx.dev.synchronize()?;
            match (case.run)(fx) {
                Ok(sample) if timed => {
                    m.ferry_ms.push(sample.ms);
                    m.staging_peak = m.staging_peak.max(sample.staging_peak_bytes);
                }
                Ok(_) => {}
                Err(err) => m.ferry_error = Some(err.to_string()),
            }
        }
        if let (Some(torch), None) = (torch.as_deref_mut(), &m.pytorch_error) {
            match torch.sample(case.id) {
                Ok(ms) if timed => m.pytorch_ms.push(ms),
                Ok(_) => {}
                Err(err) => m.pytorch_error = Some(err),
            }
        }
        if m.ferry_error.is_some() && (torch.is_none() || m.pytorch_error.is_some()) {
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
    let dev = match CudaDevice::get(0) {
        Ok(dev) => dev,
        Err(err) => {
            println!("no CUDA device: {err}");
            return Ok(());
        }
    };
    let mut info = RunInfo {
        device: format!("{} ({})", dev.device(), dev.info().name),
        samples: args.samples,
        warmup: args.warmup,
        pytorch: None,
        pytorch_note: None,
    };
    let mut torch = None;
    if args.compare_pytorch {
        match pytorch::locate_script(args.pytorch_script.as_deref())
            .and_then(|script| PyTorch::start(&args.python, &script))
        {
            Ok(t) => {
                info.pytorch = Some(format!("{} on {}", t.version, t.device));
                torch = Some(t);
            }
            Err(err) => info.pytorch_note = Some(format!("no PyTorch column: {err}")),
        }
    }
    print_header(&info);
    let mut fx = Fixture::new(dev)?;
    let mut measured = Vec::new();
    for case in &selected {
        eprintln!("measuring {} ...", case.id);
        let m = measure(case, &mut fx, torch.as_mut(), args.warmup, args.samples)?;
        if let (Some(err), Some(t)) = (&m.pytorch_error, torch.as_mut())
            && !t.is_alive()
        {
            info.pytorch_note = Some(format!(
                "the PyTorch script ended during {}: {err}",
                case.id
            ));
            torch = None;
        }
        measured.push(m);
    }
    drop(fx);
    let link = LinkSpeed::from_measured(&measured);
    print_results(&measured, link, &info);
    if let Some(path) = &args.json {
        let doc = to_json(&info, &measured, link);
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")?;
        println!("wrote every sample to {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    /// bench/README.md's commands are the ones a reader copies: they must parse.
    #[test]
    fn the_readme_commands_parse() {
        let readme = include_str!("../../../../bench/README.md");
        let commands: Vec<&str> = readme
            .lines()
            .filter_map(|l| l.strip_prefix("cargo run --release -p ferry-cli -- "))
            .collect();
        assert!(!commands.is_empty());
        for command in commands {
            let args = std::iter::once("ferry").chain(command.split_whitespace());
            if let Err(err) = crate::Cli::try_parse_from(args) {
                panic!("`{command}` does not parse: {err}");
            }
        }
    }
}
