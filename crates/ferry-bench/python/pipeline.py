#!/usr/bin/env python3
"""PyTorch's side of `ferry bench pipeline`: the same video pipeline, written as fast as PyTorch allows.

Frames (1080 x 1920 x 3 float32) are produced on the GPU by a few elementwise kernels, moved to
the host, and reduced there (`passes` sums of the frame). Cases, in ms per frame:

  gpu        producing frames alone
  link       one frame's device-to-host copy into a reused pinned buffer, waited for
  host       the host's work on one frame alone
  serial     produce, copy, process, one frame at a time (reused pinned buffer)
  pipelined  the expert version: copies on a side stream into `depth` pinned buffers, each
             ordered after its frame's kernels by the stream, marked done by an event, the
             frame's memory kept from reuse by record_stream; the host reduces the oldest frame
             while the next ones are produced and copied
  pipelined_slots
             the same, each frame computed straight into one of `depth` device slots (out=
             and in-place kernels: no allocation, no record_stream)
  streamed   a batch produced first, then copied a frame at a time through two pinned buffers
             on the side stream while the host reduces the previous frame

Two ways to run it:
  python3 pipeline.py --serve         one sample per request line `case frames passes depth`
                                      on stdin, one JSON line each (`ferry bench pipeline
                                      --compare-pytorch` interleaves its samples with these)
  python3 pipeline.py                 every case alone, printing one JSON object

Every sample synchronizes the GPU before starting the clock (time.perf_counter) and ends when the
host has reduced the last frame. Needs only torch (and a GPU).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (the shared --serve loop and timing, beside this script)

FRAME = (1080, 1920, 3)


class Fixture:
    """Inputs, pinned buffers and the side stream, made once outside any timed region."""

    def __init__(self, torch):
        self.torch = torch
        self.base = torch.rand(FRAME, device="cuda")
        self.side = torch.cuda.Stream()
        self._batch_base = {}
        self._pinned = []
        self._slots = []

    def batch_base(self, frames):
        if frames not in self._batch_base:
            self._batch_base.clear()
            self._batch_base[frames] = self.torch.rand((frames, *FRAME), device="cuda")
        return self._batch_base[frames]

    def slots(self, n):
        """`n` device frames to compute into."""
        while len(self._slots) < n:
            self._slots.append(self.torch.empty(FRAME, device="cuda"))
        return self._slots[:n]

    def pinned(self, n):
        """`n` reused page-locked frame buffers."""
        while len(self._pinned) < n:
            self._pinned.append(self.torch.empty(FRAME, pin_memory=True))
        return self._pinned[:n]


def produce(base, i):
    """Frame i: the same five elementwise kernels as ferry's, in place after the first."""
    y = base * (1.0 + i * 1e-3)
    y.add_(0.1).tanh_().mul_(0.5).add_(0.5)
    return y


def produce_into(torch, out, base, i):
    """`produce`, computed straight into `out`."""
    torch.mul(base, 1.0 + i * 1e-3, out=out)
    out.add_(0.1).tanh_().mul_(0.5).add_(0.5)
    return out


def process(frame, passes):
    acc = 0.0
    for _ in range(passes):
        acc += frame.sum().item()
    return acc


def per_frame(start, frames):
    return (time.perf_counter() - start) * 1e3 / frames


def case_gpu(fx, frames, passes, depth):
    start = time.perf_counter()
    for i in range(frames):
        produce(fx.base, i)
    fx.torch.cuda.synchronize()
    return per_frame(start, frames)


def case_link(fx, frames, passes, depth):
    frame = produce(fx.base, 0)
    (pinned,) = fx.pinned(1)
    fx.torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(frames):
        pinned.copy_(frame)  # DMA into page-locked memory, waited for
    return per_frame(start, frames)


def case_host(fx, frames, passes, depth):
    (pinned,) = fx.pinned(1)
    pinned.copy_(produce(fx.base, 0))
    start = time.perf_counter()
    for _ in range(frames):
        process(pinned, passes)
    return per_frame(start, frames)


def case_serial(fx, frames, passes, depth):
    (pinned,) = fx.pinned(1)
    start = time.perf_counter()
    for i in range(frames):
        pinned.copy_(produce(fx.base, i))
        process(pinned, passes)
    return per_frame(start, frames)


def case_pipelined(fx, frames, passes, depth):
    torch = fx.torch
    buffers = fx.pinned(depth)
    done = [torch.cuda.Event() for _ in range(depth)]
    compute = torch.cuda.current_stream()
    start = time.perf_counter()
    for i in range(frames + depth - 1):
        if i < frames:
            slot = i % depth
            # Its previous frame (i - depth) was reduced on the host one iteration ago, so the
            # buffer is free; the copy waits for this frame's kernels only.
            frame = produce(fx.base, i)
            fx.side.wait_stream(compute)
            with torch.cuda.stream(fx.side):
                buffers[slot].copy_(frame, non_blocking=True)
                done[slot].record()
            frame.record_stream(fx.side)  # its memory is not reused before the copy ran
            del frame
        oldest = i - (depth - 1)
        if oldest >= 0:
            slot = oldest % depth
            done[slot].synchronize()
            process(buffers[slot], passes)
    return per_frame(start, frames)


def case_pipelined_slots(fx, frames, passes, depth):
    torch = fx.torch
    buffers = fx.pinned(depth)
    slots = fx.slots(depth)
    done = [torch.cuda.Event() for _ in range(depth)]
    compute = torch.cuda.current_stream()
    start = time.perf_counter()
    for i in range(frames + depth - 1):
        if i < frames:
            slot = i % depth
            # The slot's last copy (frame i - depth) completed before that frame was reduced,
            # one iteration ago, so overwriting it now is safe.
            produce_into(torch, slots[slot], fx.base, i)
            fx.side.wait_stream(compute)
            with torch.cuda.stream(fx.side):
                buffers[slot].copy_(slots[slot], non_blocking=True)
                done[slot].record()
        oldest = i - (depth - 1)
        if oldest >= 0:
            slot = oldest % depth
            done[slot].synchronize()
            process(buffers[slot], passes)
    return per_frame(start, frames)


def case_streamed(fx, frames, passes, depth):
    torch = fx.torch
    buffers = fx.pinned(2)
    done = [torch.cuda.Event() for _ in range(2)]
    start = time.perf_counter()
    batch = produce(fx.batch_base(frames), 0)
    fx.side.wait_stream(torch.cuda.current_stream())

    def queue(j):
        with torch.cuda.stream(fx.side):
            buffers[j % 2].copy_(batch[j], non_blocking=True)
            done[j % 2].record()

    queue(0)
    for j in range(frames):
        if j + 1 < frames:
            queue(j + 1)  # buffer (j + 1) % 2 held frame j - 1, already reduced
        done[j % 2].synchronize()
        process(buffers[j % 2], passes)
    batch.record_stream(fx.side)
    return per_frame(start, frames)


CASES = {
    "gpu": case_gpu,
    "link": case_link,
    "host": case_host,
    "serial": case_serial,
    "pipelined": case_pipelined,
    "pipelined_slots": case_pipelined_slots,
    "streamed": case_streamed,
}


def parse_request(line):
    """`case frames passes depth` -> (case, frames, passes, depth)."""
    parts = line.split()
    if len(parts) != 4:
        raise ValueError(f"expected `case frames passes depth`, got {line!r}")
    case, frames, passes, depth = parts[0], int(parts[1]), int(parts[2]), int(parts[3])
    if frames < 2 or passes < 1 or depth < 2:
        raise ValueError("frames and depth must be at least 2, passes at least 1")
    return case, frames, passes, depth


def start(torch):
    return Fixture(torch), harness.describe(torch)


def answer(fx, line):
    """One sample of `case frames passes depth`, in ms per frame."""
    case, frames, passes, depth = parse_request(line)
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}")
    fx.torch.cuda.synchronize()
    return {"case": case, "ms": CASES[case](fx, frames, passes, depth)}


def run_alone(frames, passes, depth, samples):
    torch = harness.require_torch()
    fx = Fixture(torch)
    results = {}
    for case, fn in CASES.items():
        print(f"measuring {case} ...", file=sys.stderr)
        try:
            fn(fx, frames, passes, depth)  # warm-up
            times = []
            for _ in range(samples):
                torch.cuda.synchronize()
                times.append(fn(fx, frames, passes, depth))
            results[case] = {"ms_per_frame": times, "median": harness.median(times)}
        except Exception as err:
            results[case] = {"error": f"{type(err).__name__}: {err}"}
    harness.emit(
        {
            **harness.describe(torch),
            "frames": frames,
            "passes": passes,
            "depth": depth,
            "cases": results,
        }
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help="answer requests from stdin")
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--host-passes", type=int, default=1)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--samples", type=int, default=5)
    args = parser.parse_args()
    if args.serve:
        harness.serve(start, answer)
    else:
        if args.frames < 2 or args.host_passes < 1 or args.depth < 2 or args.samples < 1:
            parser.error("--frames and --depth must be at least 2, the others at least 1")
        run_alone(args.frames, args.host_passes, args.depth, args.samples)


if __name__ == "__main__":
    main()
