#!/usr/bin/env python3
"""PyTorch's side of `ferry bench offload`: the same MLP step, with and without save_on_cpu.

Two ways to run it:
  python3 offload.py --serve          one step per request line on stdin, one JSON line each
                                      (how `ferry bench offload --compare-pytorch` interleaves
                                      its rounds with ferry's)
  python3 offload.py --once           a few steps of each mode with the default model, one JSON
                                      object (to try the script alone)

Request (`--serve`):
  step MODE BATCH WIDTH LAYERS
      MODE is `none` or `save_on_cpu`. One training step of LAYERS bias-free Linear(WIDTH,
      WIDTH) + tanh layers on a BATCH x WIDTH float32 input on cuda:0: forward, sum, backward,
      the weights' .grad cleared (set to None) before the step. `save_on_cpu` runs the forward
      under torch.autograd.graph.save_on_cpu(pin_memory=True). Answers {"ms": wall time of the
      step, synchronized, "peak_bytes": torch.cuda.max_memory_allocated() after
      reset_peak_memory_stats() minus memory_allocated() before the step, "saved_bytes": bytes of
      the distinct storages autograd saved for backward (measured once per model, without
      offload, through saved_tensors_hooks)}.

The model matches crates/ferry-bench/src/offload.rs: weights randn / sqrt(WIDTH), input
randn without grad, full float32 matmuls (TF32 off, as ferry's cuBLAS calls use
CUBLAS_COMPUTE_32F). Needs torch and a GPU.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (the shared --serve loop and timing, beside this script)

MODES = ("none", "save_on_cpu")


class Bench:
    def __init__(self, torch):
        self.torch = torch
        self.device = torch.device("cuda", 0)
        # Same arithmetic as ferry: full-precision float32 GEMMs.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.key = None
        self.x = None
        self.ws = None
        self.saved_bytes = None

    def model(self, batch, width, layers):
        """Builds (once per shape) the weights and input; frees the previous model first."""
        key = (batch, width, layers)
        if key == self.key:
            return
        torch = self.torch
        self.x = self.ws = None
        torch.cuda.empty_cache()
        scale = width ** -0.5
        self.ws = [
            (torch.randn(width, width, device=self.device) * scale).requires_grad_()
            for _ in range(layers)
        ]
        self.x = torch.randn(batch, width, device=self.device)
        self.key = key
        self.saved_bytes = self.measure_saved()

    def forward(self):
        h = self.x
        for w in self.ws:
            h = self.torch.tanh(h @ w)
        return h.sum()

    def measure_saved(self):
        """Bytes of the distinct storages autograd saves for backward, in an untimed pass."""
        saved, _ = harness.saved_storages(self.torch, self.forward)
        for w in self.ws:
            w.grad = None
        return saved

    def step(self, mode, batch, width, layers):
        torch = self.torch
        self.model(batch, width, layers)
        for w in self.ws:
            w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        if mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                loss = self.forward()
        else:
            loss = self.forward()
        loss.backward()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - started) * 1e3
        peak = torch.cuda.max_memory_allocated() - base
        del loss
        return {"ms": ms, "peak_bytes": peak, "saved_bytes": self.saved_bytes}


def answer(bench, line):
    parts = line.split()
    if len(parts) == 5 and parts[0] == "step" and parts[1] in MODES:
        names = ("batch", "width", "layers")
        batch, width, layers = (harness.count(v, n) for v, n in zip(parts[2:], names))
        return {"mode": parts[1], **bench.step(parts[1], batch, width, layers)}
    raise ValueError(
        f"unknown request {line.strip()!r}: expected `step MODE BATCH WIDTH LAYERS` with MODE "
        f"one of {', '.join(MODES)}"
    )


def start(torch):
    return Bench(torch), harness.describe(torch)


def once(batch, width, layers, steps):
    torch = harness.require_torch()
    bench = Bench(torch)
    results = {}
    for mode in MODES:
        samples = [bench.step(mode, batch, width, layers) for _ in range(steps + 1)][1:]
        results[mode] = samples
    harness.emit(
        {
            **harness.describe(torch),
            "batch": batch,
            "width": width,
            "layers": layers,
            "results": results,
        }
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", action="store_true", help="answer request lines on stdin")
    mode.add_argument("--once", action="store_true", help="run each mode a few times, alone")
    parser.add_argument("--batch", type=int, default=16_384)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.serve:
        harness.serve(start, answer, echo="request")
        return
    if min(args.batch, args.width, args.layers, args.steps) < 1:
        parser.error("--batch, --width, --layers and --steps must be >= 1")
    once(args.batch, args.width, args.layers, args.steps)


if __name__ == "__main__":
    main()
