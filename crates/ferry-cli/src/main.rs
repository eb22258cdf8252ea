//! The `ferry` command: the transfer-methods table and doctor today; benchmarks, the training
//! demo and graph drawing as they land.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod checkpoint;
mod doctor;
mod graph;
mod methods;
mod plot;
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
enum Command {
    /// Print what this machine offers: CPU threads, CUDA driver, devices, NVRTC.
    Doctor,
    /// Measure every way to move a tensor to the host: time, GB/s, extra memory, gradient kept.
    Methods(methods::MethodsArgs),
    /// Draw the autograd graph of a built-in example (DOT or SVG); --trace runs its backward.
    Graph(graph::GraphArgs),
    /// Train a model end to end: progress bar, checkpoints each epoch, test accuracy, curves.
    Train(train::TrainArgs),
    /// Benchmarks, side by side with PyTorch in one run: `transfer` (device moves).
    Bench(ferry_bench::BenchArgs),
    /// Checkpoint files: `verify PATH...` checks headers and checksums, naming the damage.
    Checkpoint(checkpoint::CheckpointArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor => doctor::run(),
        Command::Methods(args) => methods::run(args),
        Command::Graph(args) => graph::run(args),
        Command::Train(args) => train::run(args),
        Command::Bench(args) => ferry_bench::run(args),
        Command::Checkpoint(args) => checkpoint::run(args),
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
    use clap::Parser;

    use super::Cli;

    /// `ferry bench` reaches ferry-bench's arguments; the other commands keep theirs.
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
