//! The `ferry` command: doctor today; the transfer-methods table, benchmarks, the training demo
//! and graph drawing as they land.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod doctor;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor => doctor::run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}
