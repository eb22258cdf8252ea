//! ferry-bench: the `ferry bench` harness, ferry measured side by side with PyTorch on the same
//! machine, in one run.
//!
//! It owns every benchmark (one module per `ferry bench` subcommand: `transfer`, `train`, `attention`,
//! `autograd`, `pipeline`, `checkpoint`, `offload`, `memory`, `optim`, `offload-optim`, `peer`, `ddp`), their PyTorch twins (the
//! scripts in `python/`, beside this crate's sources) and the harness they share (`harness`):
//! the skip without a GPU, PyTorch's side and its notes, [`Measured`] samples and their
//! statistics, tables ([`print_table`]) and verdicts, and the JSON file with the run's facts
//! ([`RunInfo`]). A bench module is its cases and its output. `ferry methods` times and prints
//! with the same [`Measured`] and [`print_table`]. It does not own the models it times (they
//! come from [`ferry::models`]) nor the `ferry` binary (ferry-cli parses the command line and
//! calls [`run`]). The benches are the default feature `benches`: without it the crate is the
//! harness alone, what `ferry methods` measures and prints with.
//!
//! The key design decision: PyTorch runs as a long-lived child (`script.py --serve`) answering
//! one JSON line per request, so ferry's and PyTorch's samples interleave in one process pair on
//! one machine, and whatever goes wrong on PyTorch's side becomes a note beside ferry's column,
//! never the end of the benchmark.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
// Without the benches, harness items only they use are unused.
#![cfg_attr(not(feature = "benches"), allow(dead_code, unused_imports))]

#[cfg(feature = "benches")]
use std::error::Error;

#[cfg(feature = "benches")]
use clap::{Args, Subcommand};

pub use harness::measure::Measured;
pub use harness::report::print_table;
pub use harness::run_info::RunInfo;
pub use harness::{cuda_device, cuda_device_or_say, without_cuda};

mod harness;

/// Declares the bench modules: compiled only with the `benches` feature.
macro_rules! benches {
    ($($name:ident)*) => { $(#[cfg(feature = "benches")] mod $name;)* };
}
benches! {
    attention autograd checkpoint ddp memory offload offload_optim optim peer pipeline train
    transfer
}

/// `ferry bench`: which benchmark to run, with its flags.
#[cfg(feature = "benches")]
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[cfg(feature = "benches")]
#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Device transfers (400 MB, a resnet50 state dict, small tensors) against the link's limit
    /// and, with --compare-pytorch, against PyTorch, interleaved in one run.
    Transfer(transfer::TransferArgs),
    /// Scaled-dot-product attention forward and backward in TFLOP/s at sequences 1024-8192 and
    /// head dims 64 and 128 and, with --compare-pytorch, PyTorch's SDPA on the same shapes.
    Attention(attention::AttentionArgs),
    /// Training steps (forward, cross-entropy, backward, Adam) of the digits MLP and a
    /// 1024-4096-4096-10 MLP and, with --compare-pytorch, of the same in PyTorch, interleaved.
    Train(train::TrainBenchArgs),
    /// The autograd core: device memory kept by standard chains and peak during backward,
    /// CPU thread scaling and per-op overhead; with --compare-pytorch, PyTorch's alongside.
    Autograd(autograd::AutogradArgs),
    /// A video pipeline: frames produced on the GPU, moved to the host, reduced there; serial,
    /// ferry's overlapped pipeline and stream_to against the ideal and, with --compare-pytorch,
    /// PyTorch's best (side stream, pinned double buffering).
    Pipeline(pipeline::PipelineArgs),
    /// A GPU state dict (10 GiB by default) saved and loaded through bounded staging: time,
    /// GB/s, extra device and host memory; with --compare-pytorch, torch.save and safetensors.
    Checkpoint(checkpoint::CheckpointArgs),
    /// Activation offload on an MLP with >= 4 GB of saved activations: step time, peak device
    /// memory and saved bytes with and without it; with --compare-pytorch, PyTorch's
    /// save_on_cpu(pin_memory=True) alongside. --sweep: MLPs across layers x width x batch and
    /// transformer blocks, each against the link bound and the peak goal.
    Offload(offload::OffloadArgs),
    /// Activation memory against step time for ferry's GPT: everything kept, every block
    /// recomputed, every block offloaded, and the memory plan at five targets (a curve, with the
    /// goals at full recomputation's bytes and at half the saved activations).
    Memory(memory::MemoryArgs),
    /// ferry's CPU AdamW (the host half of optimizer offload) in parameters/s on one large
    /// tensor and on a Llama's tensors, against the host's copy bandwidth and, with
    /// --compare-pytorch, torch's fused CPU AdamW. Needs no GPU.
    Optim(optim::OptimArgs),
    /// ferry's GPT at about 1 B parameters trained with AdamW on the GPU and with its state
    /// offloaded to the host (OffloadAdamW): step time, throughput, device peak, losses.
    OffloadOptim(offload_optim::OffloadOptimArgs),
    /// Moves between two GPUs (4 MiB to 1 GiB, both directions); with --compare-pytorch,
    /// PyTorch's `.to('cuda:N')` and `non_blocking=True` interleaved. Needs two GPUs.
    Peer(peer::PeerArgs),
    /// Data-parallel training of the 1024-4096-4096-10 MLP: one GPU alone, DataParallel on one
    /// and two GPUs (step time, samples/s, scaling efficiency, replicas equal); with
    /// --compare-pytorch, PyTorch's DistributedDataParallel (one process per GPU). --host runs
    /// it on the CPU.
    Ddp(ddp::DdpArgs),
}

/// Runs the chosen benchmark: prints its table (and writes its JSON with `--json`). Without
/// the GPU(s) a benchmark needs, it says so and returns `Ok`.
#[cfg(feature = "benches")]
pub fn run(args: BenchArgs) -> Result<(), Box<dyn Error>> {
    match args.command {
        BenchCommand::Transfer(args) => transfer::run(args),
        BenchCommand::Train(args) => train::run(args),
        BenchCommand::Attention(args) => attention::run(args),
        BenchCommand::Autograd(args) => autograd::run(args),
        BenchCommand::Pipeline(args) => pipeline::run(args),
        BenchCommand::Checkpoint(args) => checkpoint::run(args),
        BenchCommand::Offload(args) => offload::run(args),
        BenchCommand::Memory(args) => memory::run(args),
        BenchCommand::Optim(args) => optim::run(args),
        BenchCommand::OffloadOptim(args) => offload_optim::run(args),
        BenchCommand::Peer(args) => peer::run(args),
        BenchCommand::Ddp(args) => ddp::run(args),
    }
}

/// Parses a whole `ferry bench ...` command line as the binary does, for the benches' tests.
#[cfg(feature = "benches")]
#[cfg(test)]
fn parse_bench(command: &str) -> Result<BenchCommand, clap::Error> {
    use clap::Parser;

    /// The `ferry` binary, as far as `bench` goes.
    #[derive(Parser, Debug)]
    #[command(name = "ferry")]
    enum Ferry {
        Bench(BenchArgs),
    }
    let Ferry::Bench(args) = Ferry::try_parse_from(command.split_whitespace())?;
    Ok(args.command)
}
