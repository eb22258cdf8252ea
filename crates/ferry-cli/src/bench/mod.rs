//! `ferry bench`: ferry measured side by side with PyTorch on the same machine, in one run.
//!
//! Each benchmark lives in its own module (`transfer`, `train`, `autograd`) and shares the
//! statistics and formatting in `report`, so every table reads the same way: medians, ratios to
//! PyTorch and whether the project's target was met.

use std::error::Error;

use clap::{Args, Subcommand};

mod autograd;
mod autograd_chains;
mod autograd_json;
mod autograd_output;
mod checkpoint;
mod ddp;
mod ferry_cases;
mod offload;
mod peer;
mod pipeline;
mod pipeline_trace;
mod pytorch;
mod report;
mod resnet50;
mod train;
mod train_output;
mod transfer;
mod transfer_cases;
mod transfer_output;

/// `ferry bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Device transfers (400 MB, a resnet50 state dict, small tensors) against the link's limit
    /// and, with --compare-pytorch, against PyTorch, interleaved in one run.
    Transfer(transfer::TransferArgs),
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
    /// save_on_cpu(pin_memory=True) alongside.
    Offload(offload::OffloadArgs),
    /// Moves between two GPUs (4 MiB to 1 GiB, both directions); with --compare-pytorch,
    /// PyTorch's `.to('cuda:N')` and `non_blocking=True` interleaved. Needs two GPUs.
    Peer(peer::PeerArgs),
    /// Data-parallel training of the 1024-4096-4096-10 MLP: one GPU alone, DataParallel on one
    /// and two GPUs (step time, samples/s, scaling efficiency, replicas equal); with
    /// --compare-pytorch, PyTorch's DistributedDataParallel (one process per GPU). --host runs
    /// it on the CPU.
    Ddp(ddp::DdpArgs),
}

pub fn run(args: BenchArgs) -> Result<(), Box<dyn Error>> {
    match args.command {
        BenchCommand::Transfer(args) => transfer::run(args),
        BenchCommand::Train(args) => train::run(args),
        BenchCommand::Autograd(args) => autograd::run(args),
        BenchCommand::Pipeline(args) => pipeline::run(args),
        BenchCommand::Checkpoint(args) => checkpoint::run(args),
        BenchCommand::Offload(args) => offload::run(args),
        BenchCommand::Peer(args) => peer::run(args),
        BenchCommand::Ddp(args) => ddp::run(args),
    }
}
