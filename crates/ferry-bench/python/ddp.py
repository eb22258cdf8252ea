#!/usr/bin/env python3
"""PyTorch's side of `ferry bench ddp`: data-parallel training steps of the wide MLP, timed like ferry's.

One run, one JSON line on stdout (how `ferry bench ddp --compare-pytorch` reads it):
  python3 ddp.py --batch 1024 --steps 50 --warmup 10 --bucket-mib 25
  python3 ddp.py --rows            the row ids and the model, without importing torch

Rows (ids shared with crates/ferry-bench/src/ddp.rs; a Rust test checks):
  plain_1   one GPU, the model alone (no DistributedDataParallel)
  ddp_1     DistributedDataParallel over NCCL, world size 1 (its overhead)
  ddp_2     DistributedDataParallel over NCCL, world size 2, one process per GPU

Every process is started with torch.multiprocessing.spawn (one process per GPU) and joins the
group through a TCP store on 127.0.0.1 at a free port. The model is 1024-4096-4096-10 in fp32
(Linear, ReLU between them), TF32 off, Adam (lr 1e-3, PyTorch's default implementation),
cross-entropy; each rank makes its own batch of BATCH random inputs and labels on its GPU once,
before any clock starts (weak scaling: BATCH per GPU). DDP is PyTorch's usual setup: buckets of
--bucket-mib MiB, gradient_as_bucket_view=True, zero_grad(set_to_none=True).

A step is zero_grad, forward, cross-entropy, backward (DDP all-reduces its buckets while it runs),
optimizer step, then torch.cuda.synchronize() on the rank's GPU; each step is timed on its own
(time.perf_counter). After --warmup untimed steps, --steps timed ones; the step time of a row is
the median over steps of the slowest rank's time for that step (the ranks' per-step times are
reduced with MAX on the GPU after the loop). NCCL_NVLS_ENABLE is set to 0 unless already set.
Needs torch, NCCL and one GPU (two for ddp_2).
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (shared with the other bench scripts, beside this one)
from harness import emit  # noqa: E402

ROWS = ("plain_1", "ddp_1", "ddp_2")
WIDTHS = (1024, 4096, 4096, 10)
CLASSES = 10
LR = 1e-3


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(torch, device, batch, seed):
    """The model on `device` and this rank's batch (inputs, labels), made once."""
    torch.manual_seed(seed)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        if i > 0:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(fan_in, fan_out))
    model = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(batch, WIDTHS[0], device=device)
    y = torch.randint(0, CLASSES, (batch,), device=device)
    return model, x, y


def time_steps(torch, model, x, y, device, steps, warmup):
    """Per-step milliseconds of the timed steps, and the last loss (read after the loop)."""
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    cross_entropy = torch.nn.functional.cross_entropy
    times = []
    loss = None
    torch.cuda.synchronize(device)
    for i in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times, loss.item()


def worker(rank, world, port, args, out_dir):
    """One process per GPU: the rows of this world size; rank 0 writes them to out_dir."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    rows = {}
    if world == 1:
        model, x, y = build(torch, device, args.batch, seed=0)
        times, loss = time_steps(torch, model, x, y, device, args.steps, args.warmup)
        rows["plain_1"] = {"step_ms": times, "final_loss": loss}
        del model, x, y
        torch.cuda.empty_cache()
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=device,
    )
    try:
        model, x, y = build(torch, device, args.batch, seed=rank)
        ddp = DistributedDataParallel(
            model,
            device_ids=[rank],
            bucket_cap_mb=args.bucket_mib,
            gradient_as_bucket_view=True,
        )
        times, loss = time_steps(torch, ddp, x, y, device, args.steps, args.warmup)
        # The slowest rank's time for each step.
        slowest = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        rows[f"ddp_{world}"] = {
            "step_ms": slowest.tolist(),
            "final_loss": loss,
            "bucket_mib": args.bucket_mib,
        }
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(out_dir, f"world{world}.json"), "w") as f:
            json.dump(rows, f)


def nccl_version(torch):
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def summarize(row, world, batch):
    median = harness.median(row["step_ms"])
    return {
        **row,
        "world_size": world,
        "median_ms": median,
        "samples_per_s": world * batch / (median / 1e3),
    }


def run(args):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch, why = harness.import_torch(nccl=True)
    if torch is None:
        emit({"error": why})
        return 1
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count()
    result = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "nccl": nccl_version(torch),
        "device": f"{torch.cuda.get_device_name(0)} x{gpus}",
        "batch_per_gpu": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": {},
        "errors": {},
    }
    with tempfile.TemporaryDirectory(prefix="ferry-ddp-") as out_dir:
        for world in (1, 2):
            if world > gpus:
                result["errors"]["ddp_2"] = f"needs two GPUs; PyTorch sees {gpus}"
                continue
            try:
                mp.spawn(worker, args=(world, free_port(), args, out_dir), nprocs=world, join=True)
                with open(os.path.join(out_dir, f"world{world}.json")) as f:
                    for row_id, row in json.load(f).items():
                        world_of_row = int(row_id.rsplit("_", 1)[1])
                        result["rows"][row_id] = summarize(row, world_of_row, args.batch)
            except Exception as err:  # one world size failing must not hide the other's rows
                for row_id in ROWS:
                    if row_id.endswith(f"_{world}") and row_id not in result["rows"]:
                        result["errors"][row_id] = f"{type(err).__name__}: {err}"
    emit(result)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", action="store_true", help="print the row ids and exit")
    parser.add_argument("--batch", type=int, default=1024, help="samples per GPU per step")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per row first")
    parser.add_argument("--bucket-mib", type=float, default=25.0, help="DDP bucket size, MiB")
    args = parser.parse_args()
    if args.rows:
        emit({"rows": list(ROWS), "widths": list(WIDTHS), "lr": LR})
        return 0
    if args.batch < 1 or args.steps < 1 or args.warmup < 0 or args.bucket_mib <= 0:
        parser.error("--batch and --steps must be >= 1, --warmup >= 0, --bucket-mib > 0")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
