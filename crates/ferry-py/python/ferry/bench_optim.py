"""``python -m ferry.bench --optimizer-offload``: a training step of a transformers Llama of
about 1B parameters (bf16 autocast, fp32 weights) with AdamW on the GPU, and with its state in
host memory: ``ferry.optim.OffloadAdamW`` (also with ``delayed_update=True``), torchao's
``CPUOffloadOptimizer`` (fused CPU AdamW; also with ``offload_gradients=True``) where torchao is
installed, and the simple way (gradients to pinned memory, torch's fused CPU AdamW, weights
back; nothing overlapped). Each row:
the median step (forward, backward, step, synchronized), its throughput against AdamW on the GPU,
and the peak GPU memory allocated.
"""

from __future__ import annotations

import gc
import json

import torch

import ferry

from . import bench_harness, bench_models

GIB = 1 << 30
GOAL = 0.85  # of AdamW on the GPU's throughput


def _optimizers(lr):
    """(row name, maker of the optimizer over a model's parameters), in the order they run: the
    shared rows with ferry's after the first (AdamW on the GPU) and the simple offload last, as
    this bench has always run them; a note when torchao is missing."""
    rows, note = bench_harness.optimizer_rows(torch, lr)
    rows[1:1] = [
        ("ferry OffloadAdamW", lambda ps: ferry.optim.OffloadAdamW(ps, lr=lr)),
        ("ferry OffloadAdamW, delayed update",
         lambda ps: ferry.optim.OffloadAdamW(ps, lr=lr, delayed_update=True)),
    ]
    simple = [r for r in rows if r[0] == "simple offload"]
    return [r for r in rows if r[0] != "simple offload"] + simple, note


def run(args) -> int:
    batch = args.optimizer_batch

    def fresh():
        # A model per row: torchao's optimizer leaves its gradient hooks on the parameters.
        torch.manual_seed(0)
        return bench_models._llama("llama", batch, "cuda", tiny=False)

    work = fresh()
    params = work.parameters
    samples = 5 if args.samples is None else args.samples
    warmup = 2 if args.warmup is None else args.warmup
    rows, note = _optimizers(lr=1e-4)
    if args.optimizer_rows:
        # The first row (AdamW on the GPU) is the baseline: always there.
        wanted = [w.strip() for w in args.optimizer_rows.split(",")]
        rows = rows[:1] + [r for r in rows[1:] if any(w in r[0] for w in wanted)]
    print(f"optimizer offload: {work.what}; {params / 1e9:.2f} B parameters; {work.batch} at "
          f"batch {batch}; medians of {samples} steps after {warmup}")
    if note:
        print(f"{note} (pip install torchao)")
    record = {"model": work.what, "parameters": params, "batch": batch, "rows": {}}
    results = []
    for name, make in rows:
        if work is None:
            work = fresh()
        opt = make(work.model.parameters())
        try:
            step = lambda: (opt.zero_grad(), work.loss().backward(), opt.step())  # noqa: E731
            times, peak = bench_harness.timed_steps(torch, step, warmup, samples)
        except torch.OutOfMemoryError as err:
            print(f"{name}: out of GPU memory ({err})")
            times, peak = [], None
        extra = {}
        if isinstance(opt, ferry.optim.OffloadAdamW):
            extra = {"pinned_gib": opt.pinned_bytes() / GIB, "host_state_gib": opt.state_bytes() / GIB}
        del opt
        work = None
        gc.collect()
        torch.cuda.empty_cache()
        record["rows"][name] = {"ms": times, "peak_allocated_gib": None if peak is None else peak / GIB,
                                **extra}
        if times:
            results.append((name, bench_harness.median(times), min(times), max(times), peak))
    if not results:
        return 1
    base = results[0][1]
    print("\n".join(bench_harness.table(
        ["optimizer", "ms/step", "fastest - slowest", "throughput vs AdamW on the GPU",
         "peak allocated GiB"],
        [[name, f"{ms:.0f}", f"{low:.0f} - {high:.0f}", f"{base / ms:.1%}", f"{peak / GIB:.2f}"]
         for name, ms, low, high, peak in results])))
    for name, ms, _, _, peak in results:
        if name.startswith("ferry"):
            share = base / ms
            print(f"{name} keeps {share:.1%} of the GPU AdamW step's throughput (goal >= "
                  f"{GOAL:.0%}: {'met' if share >= GOAL else 'not met'}), "
                  f"{(results[0][4] - peak) / GIB:.2f} GiB less GPU memory at its peak")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)
    return 0
