"""``python -m ferry.bench``: the seven ways PyTorch code moves a CUDA tensor, done the PyTorch
way and through ferry, side by side in one process, samples interleaved.

Each case times one move from issue to usable result (the device is synchronized before each
sample; a non-blocking move is waited for). The table shows medians, ferry / PyTorch, and the
speedup. A second table times a training step of an MLP whose saved activations are
``--offload-gb`` GB three ways: as is, under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
and under ``ferry.offload_saved()``, with the peak GPU memory of each (``--offload-gb 0`` skips
it). ``--json FILE`` writes every sample. ``--models`` runs the real-model benchmark instead
(``bench_models.py``: activation offload and state dicts of GPT-2, Llama and ViT), and
``--optimizer-offload`` the optimizer-offload one (``bench_optim.py``: a 1B Llama's step with
AdamW on the GPU, ``ferry.optim.OffloadAdamW``, torchao's CPUOffloadOptimizer and the simple
offload). ``--memory`` runs issue 41's memory curves (``bench_memory.py``: ferry.plan against
torch's checkpointing, save_on_cpu and ferry.offload_saved, with PNGs), and ``--checkpoint`` the
checkpoint one (``bench_checkpoint.py``: the stall a Llama's training loop feels from
``ferry.save_async``, ``dcp.async_save`` with torch's writer and with ferry's, and a pinned
snapshot saved on a thread; then loading the files; ``--device cpu`` runs it on the host).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch

import ferry

from . import bench_checkpoint, bench_harness, bench_memory, bench_models, bench_optim

MB = 1 << 20


def _resnet50_like_state_dict(device):
    """Shapes of torchvision's resnet50 state dict (25.6 M parameters, 320 tensors), built
    without torchvision: conv weights, batch-norm weights, biases, running stats, counters."""
    g = torch.Generator(device="cpu").manual_seed(0)
    sd = {}

    def add(name, *shape, dtype=torch.float32):
        if dtype == torch.int64:
            sd[name] = torch.zeros(shape, dtype=dtype, device=device)
        else:
            sd[name] = torch.randn(shape, generator=g).to(device)

    def bn(prefix, c):
        add(f"{prefix}.weight", c)
        add(f"{prefix}.bias", c)
        add(f"{prefix}.running_mean", c)
        add(f"{prefix}.running_var", c)
        add(f"{prefix}.num_batches_tracked", dtype=torch.int64)

    add("conv1.weight", 64, 3, 7, 7)
    bn("bn1", 64)
    inplanes = 64
    for layer, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            p = f"layer{layer}.{b}"
            add(f"{p}.conv1.weight", planes, inplanes, 1, 1)
            bn(f"{p}.bn1", planes)
            add(f"{p}.conv2.weight", planes, planes, 3, 3)
            bn(f"{p}.bn2", planes)
            add(f"{p}.conv3.weight", planes * 4, planes, 1, 1)
            bn(f"{p}.bn3", planes * 4)
            if b == 0:
                add(f"{p}.downsample.0.weight", planes * 4, inplanes, 1, 1)
                bn(f"{p}.downsample.1", planes * 4)
            inplanes = planes * 4
    add("fc.weight", 1000, 2048)
    add("fc.bias", 1000)
    return sd


def _cases(mb: int):
    n = mb * MB // 4
    x = torch.randn(n, device="cuda")
    xg = x.clone().requires_grad_(True)
    rows = x.view(-1, 1024)
    host = x.cpu()
    sd = _resnet50_like_state_dict("cuda")

    def torch_non_blocking():
        out = x.to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        return out

    def ferry_non_blocking():
        p = ferry.to(x, "cpu", non_blocking=True)
        return p.wait() if isinstance(p, ferry.PendingMove) else p

    return [
        ("cpu", f".cpu() of {mb} MB", lambda: x.cpu(), lambda: ferry.cpu(x)),
        (
            "to_fp16",
            f".to('cpu', float16) of {mb} MB",
            lambda: x.to("cpu", torch.float16),
            lambda: ferry.to(x, "cpu", dtype=torch.float16),
        ),
        (
            "detach_cpu",
            f".detach().cpu() of {mb} MB (requires grad)",
            lambda: xg.detach().cpu(),
            lambda: ferry.cpu(xg.detach()),
        ),
        ("non_blocking", f"non_blocking .to('cpu') of {mb} MB", torch_non_blocking, ferry_non_blocking),
        (
            "chunked",
            f"4 chunks of {mb} MB into one host tensor",
            lambda: torch.cat([c.cpu() for c in rows.chunk(4)]),
            lambda: ferry.to_chunked(rows, "cpu", chunks=4),
        ),
        ("to_cuda", f".to('cuda') of {mb} MB from pageable memory", lambda: host.to("cuda"), lambda: ferry.to(host, "cuda")),
        (
            "state_dict",
            "resnet50 state dict to the CPU",
            lambda: {k: v.cpu() for k, v in sd.items()},
            lambda: ferry.move_state_dict(sd, "cpu"),
        ),
    ]


def _offload_rows(gb: float, samples: int, warmup: int):
    """(what, ms, peak allocated GiB, peak reserved GiB), one of each per sample, for a step as
    is, with save_on_cpu, and with ferry."""
    width, layers = 4096, 8
    batch = max(1, int(gb * (1 << 30) / (layers * width * 4)))
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*blocks).cuda()
    x = torch.randn(batch, width, device="cuda")
    scopes = [
        ("no offload", contextlib.nullcontext),
        ("torch save_on_cpu(pin_memory=True)",
         lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)),
        ("ferry.offload_saved()", lambda: ferry.offload_saved()),
        ("ferry.offload_saved(prefetch=2)", lambda: ferry.offload_saved(prefetch=2)),
        ("ferry.offload_saved(in_flight=1)", lambda: ferry.offload_saved(in_flight=1)),
    ]

    def step(scope):
        model.zero_grad(set_to_none=True)
        with scope():
            loss = model(x).square().mean()
        loss.backward()

    times = {what: [] for what, _ in scopes}
    peaks = {what: [] for what, _ in scopes}
    reserved = {what: [] for what, _ in scopes}
    for i in range(warmup + samples):
        for what, scope in scopes:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            base_reserved = torch.cuda.memory_reserved()
            ms = bench_harness.synced_ms(torch, lambda: step(scope))
            # Reserved as well as allocated: a block freed while a side-stream copy still reads
            # it leaves the allocated count at once but cannot be reused until the copy is done.
            peak = torch.cuda.max_memory_allocated() - base
            peak_reserved = torch.cuda.max_memory_reserved() - base_reserved
            if i >= warmup:
                times[what].append(ms)
                peaks[what].append(peak / (1 << 30))
                reserved[what].append(peak_reserved / (1 << 30))
    saved = layers * batch * width * 4
    return saved, [(w, times[w], peaks[w], reserved[w]) for w, _ in scopes]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ferry.bench", description=__doc__)
    parser.add_argument("--mb", type=int, default=400, help="tensor size in MB (default 400)")
    parser.add_argument("--samples", type=int,
                        help="default 9 (5 with --models or --memory; with --checkpoint, 8 "
                             "steps without a save before and after each row)")
    parser.add_argument("--warmup", type=int,
                        help="default 2 (1 with --models or --memory, 3 with --checkpoint)")
    parser.add_argument("--offload-gb", type=float, default=2.0,
                        help="saved activations of the offload step in GB (0: skip it)")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--models", nargs="?", const=",".join(bench_models.MODELS), metavar="LIST",
                        help="only the real-model rows, of these models (default: "
                             f"{','.join(bench_models.MODELS)})")
    parser.add_argument("--memory", nargs="?", const=",".join(bench_memory.MODELS), metavar="LIST",
                        help="only the memory-plan curves, of these models (default: "
                             f"{','.join(bench_memory.MODELS)})")
    parser.add_argument("--png", metavar="DIR",
                        help="with --memory: where the curves' PNGs go (default docs/img from the "
                             "repository's root, else the current directory)")
    parser.add_argument("--optimizer-offload", action="store_true",
                        help="only the optimizer-offload rows (bench_optim.py): a 1B Llama's step "
                             "with AdamW on the GPU, ferry.optim.OffloadAdamW, torchao and the "
                             "simple offload")
    parser.add_argument("--optimizer-batch", type=int, default=16,
                        help="the Llama's batch for --optimizer-offload (x 1024 tokens; default 16)")
    parser.add_argument("--optimizer-rows", metavar="LIST",
                        help="only the --optimizer-offload rows whose names contain one of these "
                             "comma-separated words (besides AdamW on the GPU)")
    parser.add_argument("--checkpoint", action="store_true",
                        help="only the checkpoint rows (bench_checkpoint.py): the stall of "
                             "checkpointing a Llama's training loop, and loading the files")
    parser.add_argument("--cases", default=",".join(bench_checkpoint.CASES), metavar="LIST",
                        help="the --checkpoint models (default: "
                             f"{','.join(bench_checkpoint.CASES)})")
    parser.add_argument("--ways", metavar="LIST",
                        help="only the --checkpoint rows whose names contain one of these "
                             "comma-separated words (ferry's default row always runs)")
    parser.add_argument("--saves", type=int, default=3,
                        help="saves per --checkpoint row (default 3)")
    parser.add_argument("--every", type=int, default=10,
                        help="the fewest steps from one --checkpoint save to the next, which "
                             "also waits until the last is durable (default 10)")
    parser.add_argument("--dir", default="/tmp",
                        help="where --checkpoint writes its files, removed after (default /tmp)")
    parser.add_argument("--device", default="cuda",
                        help="the device --checkpoint trains on (default cuda; cpu implies --tiny)")
    parser.add_argument("--tiny", action="store_true",
                        help="with --checkpoint: Llamas of 2 and 3 layers, batch 2 x 16")
    parser.add_argument("--state-dicts-only", action="store_true",
                        help="with --models: only the state-dict rows (default 30 samples after 5)")
    parser.add_argument("--profile", metavar="MODEL",
                        help="profile one ferry offload step of MODEL (with or without --models)")
    args = parser.parse_args(argv)
    if args.checkpoint:  # it says itself whether it can run: --device cpu needs no GPU
        return bench_checkpoint.run(args)
    if not (torch.cuda.is_available() and ferry.cuda_available()):
        print("no CUDA device: the benchmark moves CUDA tensors; nothing to measure here")
        return 0
    if args.optimizer_offload:
        return bench_optim.run(args)
    if args.memory is not None:
        return bench_memory.run(args)
    if args.models is not None or args.profile:
        return bench_models.run(args)
    args.samples = 9 if args.samples is None else args.samples
    args.warmup = 2 if args.warmup is None else args.warmup
    rows, record = [], {"torch": torch.__version__, "ferry": ferry.__version__,
                        "device": torch.cuda.get_device_name(0), "cases": {}}
    for case_id, what, torch_fn, ferry_fn in _cases(args.mb):
        samples = {"pytorch": [], "ferry": []}
        for i in range(args.warmup + args.samples):
            for side, fn in (("ferry", ferry_fn), ("pytorch", torch_fn)):
                ms = bench_harness.synced_ms(torch, fn)
                if i >= args.warmup:
                    samples[side].append(ms)
        f, p = bench_harness.median(samples["ferry"]), bench_harness.median(samples["pytorch"])
        rows.append((what, p, f))
        record["cases"][case_id] = {"what": what, **samples, "median_ms": {"pytorch": p, "ferry": f}}
    print(f"ferry {ferry.__version__} against torch {torch.__version__} on {record['device']}, "
          f"medians of {args.samples}")
    print("\n".join(bench_harness.table(
        ["case", "PyTorch ms", "ferry ms", "ferry / PyTorch", "speedup"],
        [[what, f"{p:.3g}", f"{f:.3g}", f"{f / p:.3f}", f"{p / f:.1f}x"] for what, p, f in rows])))
    if args.offload_gb > 0:
        saved, offload = _offload_rows(args.offload_gb, args.samples, args.warmup)
        # Each row: median time, and the highest peak of the samples (what a user must provision);
        # every sample's figures go to the JSON file.
        record["offload"] = {"saved_bytes": saved, "rows": {
            what: {"ms": t, "median_ms": bench_harness.median(t), "peak_allocated_gib": max(peak),
                   "peak_reserved_gib": max(res), "peak_allocated_gib_samples": peak,
                   "peak_reserved_gib_samples": res} for what, t, peak, res in offload}}
        rows = [(what, bench_harness.median(t), max(peak), min(peak), max(res))
                for what, t, peak, res in offload]
        plain_ms, plain_peak, _, plain_res = rows[0][1], rows[0][2], rows[0][3], rows[0][4]
        print()
        print(f"training step, MLP 8 x Linear(4096, 4096) + tanh, {saved / (1 << 30):.2f} GiB of "
              f"activations, medians of {args.samples}; peaks over the step (the highest of the "
              "samples, and the lowest), above what was allocated (reserved) before it, after "
              "empty_cache")
        print("\n".join(bench_harness.table(
            ["scope", "ms/step", "vs no offload", "peak allocated GiB", "lowest sample", "lower by",
             "peak reserved GiB", "lower by"],
            [[what, f"{ms:.3g}", f"{ms / plain_ms:.2f}x", f"{peak:.2f}", f"{lowest:.2f}",
              f"{(plain_peak - peak) / plain_peak:.0%}", f"{res:.2f}",
              f"{(plain_res - res) / plain_res:.0%}"] for what, ms, peak, lowest, res in rows])))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
