#!/usr/bin/env python3
"""PyTorch's side of `ferry bench peer`: float32 moves between two GPUs, timed like ferry's.

Two ways to run it:
  python3 peer.py --serve          one sample per request line on stdin, one JSON line each
                                   (how `ferry bench peer --compare-pytorch` interleaves its
                                   samples with ferry's)
  python3 peer.py --once           every size, both directions, both modes, a few samples
                                   each, alone; one JSON object

Request (`--serve`):
  move SRC DST BYTES MODE
      One x.to(f"cuda:{DST}") of a float32 tensor of BYTES bytes (BYTES / 4 elements) that lives
      on cuda:SRC; MODE is `to` (x.to(dst)) or `non_blocking` (x.to(dst, non_blocking=True)).
      Both devices are synchronized before the clock starts and after the move, before it
      stops (time.perf_counter), so a sample is the whole copy. The source is made once per
      (SRC, BYTES) outside any timed region; the result is dropped after the clock stops, so
      the caching allocator serves every timed move from its cache. Answers {"ms": ...}.

The first line answers whether torch sees two GPUs and whether they have peer access
(torch.cuda.can_device_access_peer). Needs torch and two GPUs.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (the shared --serve loop and timing, beside this script)

MODES = ("to", "non_blocking")
SIZES = (4 << 20, 64 << 20, 400_000_000, 1 << 30)


# Peer moves need two GPUs.
NEEDS = {"gpus": 2}


class Bench:
    def __init__(self, torch):
        self.torch = torch
        self.sources = {}

    def source(self, src, nbytes):
        key = (src, nbytes)
        if key not in self.sources:
            # One source at a time per device: the 1 GB cases do not pile up.
            for old in [k for k in self.sources if k[0] == src]:
                del self.sources[old]
            device = self.torch.device("cuda", src)
            x = self.torch.empty(nbytes // 4, dtype=self.torch.float32, device=device)
            x.normal_()
            self.torch.cuda.synchronize(device)
            self.sources[key] = x
        return self.sources[key]

    def move(self, src, dst, nbytes, mode):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if src == dst:
            raise ValueError("SRC and DST must differ")
        torch = self.torch
        x = self.source(src, nbytes)
        target = torch.device("cuda", dst)
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        start = time.perf_counter()
        y = x.to(target, non_blocking=(mode == "non_blocking"))
        torch.cuda.synchronize(dst)
        torch.cuda.synchronize(src)
        ms = (time.perf_counter() - start) * 1e3
        del y
        return ms


def answer(bench, line):
    parts = line.split()
    if len(parts) != 5 or parts[0] != "move":
        raise ValueError(f"expected `move SRC DST BYTES MODE`, got {line.strip()!r}")
    src, dst, nbytes = int(parts[1]), int(parts[2]), int(parts[3])
    return {"request": line.strip(), "ms": bench.move(src, dst, nbytes, parts[4])}


def describe(torch):
    return harness.describe(
        torch,
        device=f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}",
        peer_access=torch.cuda.can_device_access_peer(0, 1)
        and torch.cuda.can_device_access_peer(1, 0),
    )


def start(torch):
    return Bench(torch), describe(torch)


def once(samples):
    torch = harness.require_torch(**NEEDS)
    bench = Bench(torch)
    results = []
    for nbytes in SIZES:
        for src, dst in ((0, 1), (1, 0)):
            for mode in MODES:
                times = [bench.move(src, dst, nbytes, mode) for _ in range(samples + 1)][1:]
                median = harness.median(times)
                results.append(
                    {
                        "bytes": nbytes,
                        "from": f"cuda:{src}",
                        "to": f"cuda:{dst}",
                        "mode": mode,
                        "ms": times,
                        "median_ms": median,
                        "gb_per_s": nbytes / (median / 1e3) / 1e9,
                    }
                )
    harness.emit({**describe(torch), "results": results})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", action="store_true", help="answer request lines on stdin")
    mode.add_argument("--once", action="store_true", help="measure every case alone")
    parser.add_argument("--samples", type=int, default=5)
    args = parser.parse_args()
    if args.serve:
        harness.serve(start, answer, torch_needs=NEEDS, echo="request")
        return
    if args.samples < 1:
        parser.error("--samples must be >= 1")
    once(args.samples)


if __name__ == "__main__":
    main()
