//! The `ferry` command: the transfer-methods table (`methods`), the machine's devices (`doctor`),
//! autograd graphs (`graph`), training demos (`train`), checkpoint checks (`checkpoint`), pictures of
//! benchmark results (`plot`) and the
//! benchmarks (`bench`: `transfer`, `train`, `attention`, `autograd`, `pipeline`, `checkpoint`, `offload`,
//! `memory`, `optim`, `offload-optim`, `peer`, `ddp`), each side by side with PyTorch in one run. The
//! benchmarks are the default feature `bench`; `--no-default-features` builds the binary without
//! them.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod checkpoint;
mod doctor;
mod graph;
mod methods;
mod plot;
mod plot_memory;
mod train;

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "An autograd-aware tensor runtime: device moves, measured"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
// Parsed once per run: the size of the largest arguments costs nothing.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Print what this machine offers: CPU threads, CUDA driver, devices, NVRTC.
    Doctor,
    /// Measure every way to move a tensor to the host: time, GB/s, extra memory, gradient kept.
    Methods(methods::MethodsArgs),
    /// Draw the autograd graph of a built-in example (DOT or SVG); --trace runs its backward.
    Graph(graph::GraphArgs),
    /// Train a model end to end: progress bar, checkpoints each epoch, test accuracy, curves.
    Train(train::TrainArgs),
    /// Benchmarks, ferry and PyTorch side by side in one run.
    ///
    /// `transfer` (device moves), `train` (training steps), `attention` (fused attention's
    /// TFLOP/s), `autograd` (graph memory, threads,
    /// per-op overhead), `pipeline` (frames from the GPU to the host), `checkpoint` (state dicts
    /// saved and loaded), `offload` (activation offload), `memory` (the memory plan's curve
    /// against recomputation and offload), `optim` (CPU AdamW), `offload-optim`
    /// (optimizer state on the host), `peer` (GPU to GPU), `ddp` (data-parallel training).
    #[cfg(feature = "bench")]
    Bench(ferry_bench::BenchArgs),
    /// Checkpoint files: `verify PATH...` checks headers and checksums, naming the damage.
    Checkpoint(checkpoint::CheckpointArgs),
    /// Pictures of benchmark results: `memory FILE` draws the memory plan's curves (peak
    /// against step time) from `ferry bench memory --json` or `python -m ferry.bench --memory
    /// --json`.
    Plot(plot_memory::PlotArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor => doctor::run(),
        Command::Methods(args) => methods::run(args),
        Command::Graph(args) => graph::run(args),
        Command::Train(args) => train::run(args),
        #[cfg(feature = "bench")]
        Command::Bench(args) => ferry_bench::run(args),
        Command::Checkpoint(args) => checkpoint::run(args),
        Command::Plot(args) => plot_memory::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Cli;

    /// `ferry bench --help` (the `Bench` variant's doc) and this crate's doc name every bench
    /// ferry-bench has, read from its parser, so a new bench cannot go unmentioned.
    #[cfg(feature = "bench")]
    #[test]
    fn the_bench_help_and_the_crate_doc_name_every_bench() {
        use clap::Args;

        let benches = ferry_bench::BenchArgs::augment_args(clap::Command::new("bench"));
        let names: Vec<&str> = benches.get_subcommands().map(|c| c.get_name()).collect();
        assert!(!names.is_empty());
        let mut cli = Cli::command();
        let bench = cli.find_subcommand_mut("bench").unwrap();
        let about = bench.get_long_about().unwrap().to_string();
        let help = bench.render_long_help().to_string();
        let crate_doc: String = include_str!("main.rs")
            .lines()
            .filter_map(|line| line.strip_prefix("//!"))
            .collect::<Vec<_>>()
            .join(" ");
        for name in names {
            let quoted = format!("`{name}`");
            assert!(
                about.contains(&quoted),
                "`ferry bench --help` does not name {quoted}"
            );
            assert!(help.contains(&quoted), "{help}");
            assert!(
                crate_doc.contains(&quoted),
                "the crate doc does not name {quoted}"
            );
        }
    }

    /// Without the `bench` feature, `ferry --help` has no `bench` command.
    #[cfg(not(feature = "bench"))]
    #[test]
    fn without_the_bench_feature_there_is_no_bench_command() {
        let help = Cli::command().render_help().to_string();
        assert!(!help.contains("bench"), "{help}");
        assert!(Cli::try_parse_from(["ferry", "bench", "transfer"]).is_err());
    }

    /// `ferry bench` reaches ferry-bench's arguments; the other commands keep theirs.
    #[cfg(feature = "bench")]
    #[test]
    fn bench_and_device_commands_parse() {
        for command in [
            "ferry bench transfer --compare-pytorch --python python3 --json t.json",
            "ferry bench peer --compare-pytorch --json peer.json",
            "ferry methods --device cuda:1",
        ] {
            if let Err(err) = Cli::try_parse_from(command.split_whitespace()) {
                panic!("`{command}` does not parse: {err}");
            }
        }
        assert!(Cli::try_parse_from(["ferry", "bench", "nothing"]).is_err());
    }
}
