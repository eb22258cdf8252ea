#!/usr/bin/env python3
"""PyTorch's side of `ferry bench transfer`: the same device moves, timed the same way.

Three ways to run it:
  python3 transfer.py --cases all              every case alone: warm-up, samples, one JSON object
  python3 transfer.py --serve                  one sample per case id read from stdin, one JSON
                                               line each (how `ferry bench transfer
                                               --compare-pytorch` interleaves its samples)
  python3 transfer.py --first-cpu-sample in a fresh process: time one x.cpu(), print ms

Every sample synchronizes the GPU before starting the clock and before stopping it
(time.perf_counter); results are dropped after the clock stops. Case ids and the resnet50 shapes
match crates/ferry-bench/src/ (a Rust test checks both). Needs only torch (and a GPU).
"""

import argparse
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (the shared --serve loop and timing, beside this script)

SIDE = 10_000  # the large tensor: SIDE x SIDE float32 = 400 MB
CHUNKS = 4
SMALL_REPS = 100  # moves per small-case sample; the sample is their mean
SMALL_BYTES = {"small_4k": 4 << 10, "small_64k": 64 << 10, "small_1m": 1 << 20}


class Fixture:
    """What the cases move, each made on first use, outside any timed region."""

    def __init__(self, torch):
        self.torch = torch
        self._made = {}

    def _get(self, name, make):
        if name not in self._made:
            self._made[name] = make()
            self.torch.cuda.synchronize()
        return self._made[name]

    @property
    def x(self):
        return self._get("x", lambda: self.torch.randn(SIDE, SIDE, device="cuda"))

    @property
    def pinned(self):
        return self._get("pinned", lambda: self.torch.empty(SIDE, SIDE, pin_memory=True))

    @property
    def gpu_dst(self):
        return self._get("gpu_dst", lambda: self.torch.empty(SIDE, SIDE, device="cuda"))

    @property
    def host(self):
        # ones() writes every page, so no page fault lands inside a timed upload.
        return self._get("host", lambda: self.torch.ones(SIDE, SIDE))

    @property
    def out(self):
        return self._get("out", lambda: self.torch.ones(SIDE, SIDE))

    @property
    def state_dict(self):
        return self._get("state_dict", lambda: build_state_dict(self.torch))

    def small(self, case):
        return self._get(
            case, lambda: self.torch.randn(SMALL_BYTES[case] // 4, device="cuda")
        )


timed = harness.synced_ms


def link_d2h(fx):
    return timed(fx.torch, lambda: fx.pinned.copy_(fx.x))


def link_h2d(fx):
    return timed(fx.torch, lambda: fx.gpu_dst.copy_(fx.pinned))


def cpu_repeated(fx):
    return timed(fx.torch, lambda: fx.x.cpu())


def first_cpu(fx):
    out = subprocess.run(
        [sys.executable, __file__, "--first-cpu-sample"], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"--first-cpu-sample failed: {out.stderr.strip()[-500:]}")
    return float(out.stdout.strip().splitlines()[-1])


def first_cpu_sample():
    """In a fresh process: start CUDA, make the tensor, synchronize, time one cpu()."""
    torch, why = harness.import_torch()
    if torch is None:
        sys.exit(why)
    x = torch.randn(SIDE, SIDE, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    y = x.cpu()
    ms = (time.perf_counter() - start) * 1e3
    del y
    print(ms)


def non_blocking(fx):
    return timed(fx.torch, lambda: fx.x.to("cpu", non_blocking=True))


def chunks4(fx):
    return timed(fx.torch, lambda: fx.torch.cat([c.cpu() for c in fx.x.chunk(CHUNKS)]))


def chunks_staging(fx):
    x, out = fx.x, fx.out
    n = SIDE // CHUNKS

    def into_preallocated():
        for i, c in enumerate(x.chunk(CHUNKS)):
            out[i * n : (i + 1) * n].copy_(c)

    return timed(fx.torch, into_preallocated)


def to_f16(fx):
    # What a user writes; torch copies the f32 bytes, then casts on the host.
    return timed(fx.torch, lambda: fx.x.to(device="cpu", dtype=fx.torch.float16))


def state_dict_nb(fx):
    sd = fx.state_dict
    return timed(
        fx.torch,
        lambda: {k: v.detach().to("cpu", non_blocking=True) for k, v in sd.items()},
    )


def state_dict_plain(fx):
    sd = fx.state_dict
    return timed(fx.torch, lambda: {k: v.cpu() for k, v in sd.items()})


def h2d_pageable(fx):
    return timed(fx.torch, lambda: fx.host.cuda())


def small(case):
    def run_case(fx):
        t = fx.small(case)

        def moves():
            for _ in range(SMALL_REPS):
                t.cpu()

        return timed(fx.torch, moves) / SMALL_REPS

    return run_case


# The same ids, in the same order, as the Rust case table.
CASES = {
    "link_d2h": link_d2h,
    "link_h2d": link_h2d,
    "cpu_repeated": cpu_repeated,
    "first_cpu": first_cpu,
    "non_blocking": non_blocking,
    "chunks4": chunks4,
    "chunks_staging": chunks_staging,
    "to_f16": to_f16,
    "state_dict_nb": state_dict_nb,
    "state_dict_plain": state_dict_plain,
    "h2d_pageable": h2d_pageable,
    "small_4k": small("small_4k"),
    "small_64k": small("small_64k"),
    "small_1m": small("small_1m"),
}


def is_counter(name):
    return name.endswith("num_batches_tracked")


def resnet50_summary():
    floats = sum(math.prod(s) for n, s in RESNET50_STATE_DICT if not is_counter(n))
    return {"tensors": len(RESNET50_STATE_DICT), "float_bytes": floats * 4}


def build_state_dict(torch):
    """resnet50's state dict on the GPU: f32 tensors, int64 scalar counters."""
    summary = resnet50_summary()
    if summary["tensors"] != 320:
        raise RuntimeError(f"expected 320 resnet50 tensors, have {summary['tensors']}")
    return {
        name: torch.zeros(shape, dtype=torch.int64, device="cuda")
        if is_counter(name)
        else torch.randn(shape, device="cuda")
        for name, shape in RESNET50_STATE_DICT
    }


def describe(torch):
    return harness.describe(torch, resnet50=resnet50_summary())


def start(torch):
    return Fixture(torch), describe(torch)


def answer(fx, case):
    """One sample of the case id."""
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}")
    return {"case": case, "ms": CASES[case](fx)}


def run_alone(ids, samples, warmup):
    torch = harness.require_torch()
    fx = Fixture(torch)
    results = {}
    for case in ids:
        print(f"measuring {case} ...", file=sys.stderr)
        try:
            for _ in range(warmup):
                CASES[case](fx)
            times = [CASES[case](fx) for _ in range(samples)]
            results[case] = {"samples_ms": times, "median_ms": harness.median(times)}
        except Exception as err:
            results[case] = {"error": f"{type(err).__name__}: {err}"}
    harness.emit({**describe(torch), "samples": samples, "warmup": warmup, "cases": results})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--serve", action="store_true", help="answer case ids from stdin")
    mode.add_argument(
        "--first-cpu-sample", action="store_true", help="time one cpu() in this process"
    )
    parser.add_argument(
        "--cases", default="all", help="ids joined by commas, or all (default)"
    )
    parser.add_argument("--samples", type=int, default=9, help="timed samples per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per case")
    args = parser.parse_args()
    if args.first_cpu_sample:
        first_cpu_sample()
    elif args.serve:
        harness.serve(start, answer)
    else:
        ids = list(CASES) if args.cases == "all" else args.cases.split(",")
        unknown = [i for i in ids if i not in CASES]
        if unknown:
            parser.error(f"unknown case(s) {unknown}; the cases are {', '.join(CASES)}")
        if args.samples < 1 or args.warmup < 0:
            parser.error("--samples must be at least 1 and --warmup at least 0")
        run_alone(ids, args.samples, args.warmup)


# torchvision's resnet50().state_dict(), in order: (name, shape); *.num_batches_tracked are
# int64 scalars, the rest float32. 320 entries, 102,440,608 bytes of float32.
RESNET50_STATE_DICT = [
    ("conv1.weight", (64, 3, 7, 7)),
    ("bn1.weight", (64,)),
    ("bn1.bias", (64,)),
    ("bn1.running_mean", (64,)),
    ("bn1.running_var", (64,)),
    ("bn1.num_batches_tracked", ()),
    ("layer1.0.conv1.weight", (64, 64, 1, 1)),
    ("layer1.0.bn1.weight", (64,)),
    ("layer1.0.bn1.bias", (64,)),
    ("layer1.0.bn1.running_mean", (64,)),
    ("layer1.0.bn1.running_var", (64,)),
    ("layer1.0.bn1.num_batches_tracked", ()),
    ("layer1.0.conv2.weight", (64, 64, 3, 3)),
    ("layer1.0.bn2.weight", (64,)),
    ("layer1.0.bn2.bias", (64,)),
    ("layer1.0.bn2.running_mean", (64,)),
    ("layer1.0.bn2.running_var", (64,)),
    ("layer1.0.bn2.num_batches_tracked", ()),
    ("layer1.0.conv3.weight", (256, 64, 1, 1)),
    ("layer1.0.bn3.weight", (256,)),
    ("layer1.0.bn3.bias", (256,)),
    ("layer1.0.bn3.running_mean", (256,)),
    ("layer1.0.bn3.running_var", (256,)),
    ("layer1.0.bn3.num_batches_tracked", ()),
    ("layer1.0.downsample.0.weight", (256, 64, 1, 1)),
    ("layer1.0.downsample.1.weight", (256,)),
    ("layer1.0.downsample.1.bias", (256,)),
    ("layer1.0.downsample.1.running_mean", (256,)),
    ("layer1.0.downsample.1.running_var", (256,)),
    ("layer1.0.downsample.1.num_batches_tracked", ()),
    ("layer1.1.conv1.weight", (64, 256, 1, 1)),
    ("layer1.1.bn1.weight", (64,)),
    ("layer1.1.bn1.bias", (64,)),
    ("layer1.1.bn1.running_mean", (64,)),
    ("layer1.1.bn1.running_var", (64,)),
    ("layer1.1.bn1.num_batches_tracked", ()),
    ("layer1.1.conv2.weight", (64, 64, 3, 3)),
    ("layer1.1.bn2.weight", (64,)),
    ("layer1.1.bn2.bias", (64,)),
    ("layer1.1.bn2.running_mean", (64,)),
    ("layer1.1.bn2.running_var", (64,)),
    ("layer1.1.bn2.num_batches_tracked", ()),
    ("layer1.1.conv3.weight", (256, 64, 1, 1)),
    ("layer1.1.bn3.weight", (256,)),
    ("layer1.1.bn3.bias", (256,)),
    ("layer1.1.bn3.running_mean", (256,)),
    ("layer1.1.bn3.running_var", (256,)),
    ("layer1.1.bn3.num_batches_tracked", ()),
    ("layer1.2.conv1.weight", (64, 256, 1, 1)),
    ("layer1.2.bn1.weight", (64,)),
    ("layer1.2.bn1.bias", (64,)),
    ("layer1.2.bn1.running_mean", (64,)),
    ("layer1.2.bn1.running_var", (64,)),
    ("layer1.2.bn1.num_batches_tracked", ()),
    ("layer1.2.conv2.weight", (64, 64, 3, 3)),
    ("layer1.2.bn2.weight", (64,)),
    ("layer1.2.bn2.bias", (64,)),
    ("layer1.2.bn2.running_mean", (64,)),
    ("layer1.2.bn2.running_var", (64,)),
    ("layer1.2.bn2.num_batches_tracked", ()),
    ("layer1.2.conv3.weight", (256, 64, 1, 1)),
    ("layer1.2.bn3.weight", (256,)),
    ("layer1.2.bn3.bias", (256,)),
    ("layer1.2.bn3.running_mean", (256,)),
    ("layer1.2.bn3.running_var", (256,)),
    ("layer1.2.bn3.num_batches_tracked", ()),
    ("layer2.0.conv1.weight", (128, 256, 1, 1)),
    ("layer2.0.bn1.weight", (128,)),
    ("layer2.0.bn1.bias", (128,)),
    ("layer2.0.bn1.running_mean", (128,)),
    ("layer2.0.bn1.running_var", (128,)),
    ("layer2.0.bn1.num_batches_tracked", ()),
    ("layer2.0.conv2.weight", (128, 128, 3, 3)),
    ("layer2.0.bn2.weight", (128,)),
    ("layer2.0.bn2.bias", (128,)),
    ("layer2.0.bn2.running_mean", (128,)),
    ("layer2.0.bn2.running_var", (128,)),
    ("layer2.0.bn2.num_batches_tracked", ()),
    ("layer2.0.conv3.weight", (512, 128, 1, 1)),
    ("layer2.0.bn3.weight", (512,)),
    ("layer2.0.bn3.bias", (512,)),
    ("layer2.0.bn3.running_mean", (512,)),
    ("layer2.0.bn3.running_var", (512,)),
    ("layer2.0.bn3.num_batches_tracked", ()),
    ("layer2.0.downsample.0.weight", (512, 256, 1, 1)),
    ("layer2.0.downsample.1.weight", (512,)),
    ("layer2.0.downsample.1.bias", (512,)),
    ("layer2.0.downsample.1.running_mean", (512,)),
    ("layer2.0.downsample.1.running_var", (512,)),
    ("layer2.0.downsample.1.num_batches_tracked", ()),
    ("layer2.1.conv1.weight", (128, 512, 1, 1)),
    ("layer2.1.bn1.weight", (128,)),
    ("layer2.1.bn1.bias", (128,)),
    ("layer2.1.bn1.running_mean", (128,)),
    ("layer2.1.bn1.running_var", (128,)),
    ("layer2.1.bn1.num_batches_tracked", ()),
    ("layer2.1.conv2.weight", (128, 128, 3, 3)),
    ("layer2.1.bn2.weight", (128,)),
    ("layer2.1.bn2.bias", (128,)),
    ("layer2.1.bn2.running_mean", (128,)),
    ("layer2.1.bn2.running_var", (128,)),
    ("layer2.1.bn2.num_batches_tracked", ()),
    ("layer2.1.conv3.weight", (512, 128, 1, 1)),
    ("layer2.1.bn3.weight", (512,)),
    ("layer2.1.bn3.bias", (512,)),
    ("layer2.1.bn3.running_mean", (512,)),
    ("layer2.1.bn3.running_var", (512,)),
    ("layer2.1.bn3.num_batches_tracked", ()),
    ("layer2.2.conv1.weight", (128, 512, 1, 1)),
    ("layer2.2.bn1.weight", (128,)),
    ("layer2.2.bn1.bias", (128,)),
    ("layer2.2.bn1.running_mean", (128,)),
    ("layer2.2.bn1.running_var", (128,)),
    ("layer2.2.bn1.num_batches_tracked", ()),
    ("layer2.2.conv2.weight", (128, 128, 3, 3)),
    ("layer2.2.bn2.weight", (128,)),
    ("layer2.2.bn2.bias", (128,)),
    ("layer2.2.bn2.running_mean", (128,)),
    ("layer2.2.bn2.running_var", (128,)),
    ("layer2.2.bn2.num_batches_tracked", ()),
    ("layer2.2.conv3.weight", (512, 128, 1, 1)),
    ("layer2.2.bn3.weight", (512,)),
    ("layer2.2.bn3.bias", (512,)),
    ("layer2.2.bn3.running_mean", (512,)),
    ("layer2.2.bn3.running_var", (512,)),
    ("layer2.2.bn3.num_batches_tracked", ()),
    ("layer2.3.conv1.weight", (128, 512, 1, 1)),
    ("layer2.3.bn1.weight", (128,)),
    ("layer2.3.bn1.bias", (128,)),
    ("layer2.3.bn1.running_mean", (128,)),
    ("layer2.3.bn1.running_var", (128,)),
    ("layer2.3.bn1.num_batches_tracked", ()),
    ("layer2.3.conv2.weight", (128, 128, 3, 3)),
    ("layer2.3.bn2.weight", (128,)),
    ("layer2.3.bn2.bias", (128,)),
    ("layer2.3.bn2.running_mean", (128,)),
    ("layer2.3.bn2.running_var", (128,)),
    ("layer2.3.bn2.num_batches_tracked", ()),
    ("layer2.3.conv3.weight", (512, 128, 1, 1)),
    ("layer2.3.bn3.weight", (512,)),
    ("layer2.3.bn3.bias", (512,)),
    ("layer2.3.bn3.running_mean", (512,)),
    ("layer2.3.bn3.running_var", (512,)),
    ("layer2.3.bn3.num_batches_tracked", ()),
    ("layer3.0.conv1.weight", (256, 512, 1, 1)),
    ("layer3.0.bn1.weight", (256,)),
    ("layer3.0.bn1.bias", (256,)),
    ("layer3.0.bn1.running_mean", (256,)),
    ("layer3.0.bn1.running_var", (256,)),
    ("layer3.0.bn1.num_batches_tracked", ()),
    ("layer3.0.conv2.weight", (256, 256, 3, 3)),
    ("layer3.0.bn2.weight", (256,)),
    ("layer3.0.bn2.bias", (256,)),
    ("layer3.0.bn2.running_mean", (256,)),
    ("layer3.0.bn2.running_var", (256,)),
    ("layer3.0.bn2.num_batches_tracked", ()),
    ("layer3.0.conv3.weight", (1024, 256, 1, 1)),
    ("layer3.0.bn3.weight", (1024,)),
    ("layer3.0.bn3.bias", (1024,)),
    ("layer3.0.bn3.running_mean", (1024,)),
    ("layer3.0.bn3.running_var", (1024,)),
    ("layer3.0.bn3.num_batches_tracked", ()),
    ("layer3.0.downsample.0.weight", (1024, 512, 1, 1)),
    ("layer3.0.downsample.1.weight", (1024,)),
    ("layer3.0.downsample.1.bias", (1024,)),
    ("layer3.0.downsample.1.running_mean", (1024,)),
    ("layer3.0.downsample.1.running_var", (1024,)),
    ("layer3.0.downsample.1.num_batches_tracked", ()),
    ("layer3.1.conv1.weight", (256, 1024, 1, 1)),
    ("layer3.1.bn1.weight", (256,)),
    ("layer3.1.bn1.bias", (256,)),
    ("layer3.1.bn1.running_mean", (256,)),
    ("layer3.1.bn1.running_var", (256,)),
    ("layer3.1.bn1.num_batches_tracked", ()),
    ("layer3.1.conv2.weight", (256, 256, 3, 3)),
    ("layer3.1.bn2.weight", (256,)),
    ("layer3.1.bn2.bias", (256,)),
    ("layer3.1.bn2.running_mean", (256,)),
    ("layer3.1.bn2.running_var", (256,)),
    ("layer3.1.bn2.num_batches_tracked", ()),
    ("layer3.1.conv3.weight", (1024, 256, 1, 1)),
    ("layer3.1.bn3.weight", (1024,)),
    ("layer3.1.bn3.bias", (1024,)),
    ("layer3.1.bn3.running_mean", (1024,)),
    ("layer3.1.bn3.running_var", (1024,)),
    ("layer3.1.bn3.num_batches_tracked", ()),
    ("layer3.2.conv1.weight", (256, 1024, 1, 1)),
    ("layer3.2.bn1.weight", (256,)),
    ("layer3.2.bn1.bias", (256,)),
    ("layer3.2.bn1.running_mean", (256,)),
    ("layer3.2.bn1.running_var", (256,)),
    ("layer3.2.bn1.num_batches_tracked", ()),
    ("layer3.2.conv2.weight", (256, 256, 3, 3)),
    ("layer3.2.bn2.weight", (256,)),
    ("layer3.2.bn2.bias", (256,)),
    ("layer3.2.bn2.running_mean", (256,)),
    ("layer3.2.bn2.running_var", (256,)),
    ("layer3.2.bn2.num_batches_tracked", ()),
    ("layer3.2.conv3.weight", (1024, 256, 1, 1)),
    ("layer3.2.bn3.weight", (1024,)),
    ("layer3.2.bn3.bias", (1024,)),
    ("layer3.2.bn3.running_mean", (1024,)),
    ("layer3.2.bn3.running_var", (1024,)),
    ("layer3.2.bn3.num_batches_tracked", ()),
    ("layer3.3.conv1.weight", (256, 1024, 1, 1)),
    ("layer3.3.bn1.weight", (256,)),
    ("layer3.3.bn1.bias", (256,)),
    ("layer3.3.bn1.running_mean", (256,)),
    ("layer3.3.bn1.running_var", (256,)),
    ("layer3.3.bn1.num_batches_tracked", ()),
    ("layer3.3.conv2.weight", (256, 256, 3, 3)),
    ("layer3.3.bn2.weight", (256,)),
    ("layer3.3.bn2.bias", (256,)),
    ("layer3.3.bn2.running_mean", (256,)),
    ("layer3.3.bn2.running_var", (256,)),
    ("layer3.3.bn2.num_batches_tracked", ()),
    ("layer3.3.conv3.weight", (1024, 256, 1, 1)),
    ("layer3.3.bn3.weight", (1024,)),
    ("layer3.3.bn3.bias", (1024,)),
    ("layer3.3.bn3.running_mean", (1024,)),
    ("layer3.3.bn3.running_var", (1024,)),
    ("layer3.3.bn3.num_batches_tracked", ()),
    ("layer3.4.conv1.weight", (256, 1024, 1, 1)),
    ("layer3.4.bn1.weight", (256,)),
    ("layer3.4.bn1.bias", (256,)),
    ("layer3.4.bn1.running_mean", (256,)),
    ("layer3.4.bn1.running_var", (256,)),
    ("layer3.4.bn1.num_batches_tracked", ()),
    ("layer3.4.conv2.weight", (256, 256, 3, 3)),
    ("layer3.4.bn2.weight", (256,)),
    ("layer3.4.bn2.bias", (256,)),
    ("layer3.4.bn2.running_mean", (256,)),
    ("layer3.4.bn2.running_var", (256,)),
    ("layer3.4.bn2.num_batches_tracked", ()),
    ("layer3.4.conv3.weight", (1024, 256, 1, 1)),
    ("layer3.4.bn3.weight", (1024,)),
    ("layer3.4.bn3.bias", (1024,)),
    ("layer3.4.bn3.running_mean", (1024,)),
    ("layer3.4.bn3.running_var", (1024,)),
    ("layer3.4.bn3.num_batches_tracked", ()),
    ("layer3.5.conv1.weight", (256, 1024, 1, 1)),
    ("layer3.5.bn1.weight", (256,)),
    ("layer3.5.bn1.bias", (256,)),
    ("layer3.5.bn1.running_mean", (256,)),
    ("layer3.5.bn1.running_var", (256,)),
    ("layer3.5.bn1.num_batches_tracked", ()),
    ("layer3.5.conv2.weight", (256, 256, 3, 3)),
    ("layer3.5.bn2.weight", (256,)),
    ("layer3.5.bn2.bias", (256,)),
    ("layer3.5.bn2.running_mean", (256,)),
    ("layer3.5.bn2.running_var", (256,)),
    ("layer3.5.bn2.num_batches_tracked", ()),
    ("layer3.5.conv3.weight", (1024, 256, 1, 1)),
    ("layer3.5.bn3.weight", (1024,)),
    ("layer3.5.bn3.bias", (1024,)),
    ("layer3.5.bn3.running_mean", (1024,)),
    ("layer3.5.bn3.running_var", (1024,)),
    ("layer3.5.bn3.num_batches_tracked", ()),
    ("layer4.0.conv1.weight", (512, 1024, 1, 1)),
    ("layer4.0.bn1.weight", (512,)),
    ("layer4.0.bn1.bias", (512,)),
    ("layer4.0.bn1.running_mean", (512,)),
    ("layer4.0.bn1.running_var", (512,)),
    ("layer4.0.bn1.num_batches_tracked", ()),
    ("layer4.0.conv2.weight", (512, 512, 3, 3)),
    ("layer4.0.bn2.weight", (512,)),
    ("layer4.0.bn2.bias", (512,)),
    ("layer4.0.bn2.running_mean", (512,)),
    ("layer4.0.bn2.running_var", (512,)),
    ("layer4.0.bn2.num_batches_tracked", ()),
    ("layer4.0.conv3.weight", (2048, 512, 1, 1)),
    ("layer4.0.bn3.weight", (2048,)),
    ("layer4.0.bn3.bias", (2048,)),
    ("layer4.0.bn3.running_mean", (2048,)),
    ("layer4.0.bn3.running_var", (2048,)),
    ("layer4.0.bn3.num_batches_tracked", ()),
    ("layer4.0.downsample.0.weight", (2048, 1024, 1, 1)),
    ("layer4.0.downsample.1.weight", (2048,)),
    ("layer4.0.downsample.1.bias", (2048,)),
    ("layer4.0.downsample.1.running_mean", (2048,)),
    ("layer4.0.downsample.1.running_var", (2048,)),
    ("layer4.0.downsample.1.num_batches_tracked", ()),
    ("layer4.1.conv1.weight", (512, 2048, 1, 1)),
    ("layer4.1.bn1.weight", (512,)),
    ("layer4.1.bn1.bias", (512,)),
    ("layer4.1.bn1.running_mean", (512,)),
    ("layer4.1.bn1.running_var", (512,)),
    ("layer4.1.bn1.num_batches_tracked", ()),
    ("layer4.1.conv2.weight", (512, 512, 3, 3)),
    ("layer4.1.bn2.weight", (512,)),
    ("layer4.1.bn2.bias", (512,)),
    ("layer4.1.bn2.running_mean", (512,)),
    ("layer4.1.bn2.running_var", (512,)),
    ("layer4.1.bn2.num_batches_tracked", ()),
    ("layer4.1.conv3.weight", (2048, 512, 1, 1)),
    ("layer4.1.bn3.weight", (2048,)),
    ("layer4.1.bn3.bias", (2048,)),
    ("layer4.1.bn3.running_mean", (2048,)),
    ("layer4.1.bn3.running_var", (2048,)),
    ("layer4.1.bn3.num_batches_tracked", ()),
    ("layer4.2.conv1.weight", (512, 2048, 1, 1)),
    ("layer4.2.bn1.weight", (512,)),
    ("layer4.2.bn1.bias", (512,)),
    ("layer4.2.bn1.running_mean", (512,)),
    ("layer4.2.bn1.running_var", (512,)),
    ("layer4.2.bn1.num_batches_tracked", ()),
    ("layer4.2.conv2.weight", (512, 512, 3, 3)),
    ("layer4.2.bn2.weight", (512,)),
    ("layer4.2.bn2.bias", (512,)),
    ("layer4.2.bn2.running_mean", (512,)),
    ("layer4.2.bn2.running_var", (512,)),
    ("layer4.2.bn2.num_batches_tracked", ()),
    ("layer4.2.conv3.weight", (2048, 512, 1, 1)),
    ("layer4.2.bn3.weight", (2048,)),
    ("layer4.2.bn3.bias", (2048,)),
    ("layer4.2.bn3.running_mean", (2048,)),
    ("layer4.2.bn3.running_var", (2048,)),
    ("layer4.2.bn3.num_batches_tracked", ()),
    ("fc.weight", (1000, 2048)),
    ("fc.bias", (1000,)),
]

if __name__ == "__main__":
    main()
