#!/usr/bin/env python3
"""PyTorch's side of `ferry bench checkpoint`: the same GPU state dict saved and loaded with
torch.save / torch.load and safetensors' save_file / load_file, timed and measured the same way.

Two ways to run it:
  python3 checkpoint.py --serve                  requests on stdin, one JSON line per answer
                                                  (how `ferry bench checkpoint --compare-pytorch`
                                                  interleaves its samples with ferry's)
  python3 checkpoint.py --gb 10 --dir /tmp every case alone: warm-up, samples, one JSON
                                                  object

Requests in --serve mode: `setup GB DIR` (builds the state dict on the GPU, answers its size),
then case ids (`torch_save`, `torch_load`, `torch_load_mmap`, `st_save`, `st_load`), `cleanup`
(deletes this side's files) and `quit`.

Each sample synchronizes the GPU before starting the clock and before stopping it. Memory is
measured around each sample: extra device memory is torch.cuda.max_memory_allocated() over what
was allocated before (less the loaded tensors, for loads: they are the result), and extra host
memory is the growth of the process's resident set (VmHWM after, over VmRSS before, with the
high-water mark reset through /proc/self/clear_refs). A save's fsync is timed apart, so both the
plain and the durable time can be set against ferry's durable save.
"""

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (the shared --serve loop and timing, beside this script)

SIDE = 8192  # each large tensor: SIDE x SIDE float32 = 256 MiB
CASES = ["torch_save", "torch_load", "torch_load_mmap", "st_save", "st_load"]


def large_count(gb):
    """Tensors of 256 MiB in a state dict of `gb` GiB (rounded half up, as ferry rounds)."""
    return max(1, math.floor(gb * 4 + 0.5))


def build_state_dict(torch, gb):
    """The dict ferry builds too (crates/ferry-bench/src/checkpoint.rs): `large_count`
    weights of 8192 x 8192 float32, four biases, a float16 embedding and an int64 step."""
    sd = {}
    for i in range(large_count(gb)):
        sd[f"layers.{i}.weight"] = torch.randn(SIDE, SIDE, device="cuda")
    for i in range(4):
        sd[f"layers.{i}.bias"] = torch.randn(SIDE, device="cuda")
    sd["embed.weight"] = torch.randn(4096, 4096, device="cuda").half()
    sd["step"] = torch.tensor(7, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    return sd


def status(field):
    """A field of /proc/self/status in bytes, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Meter:
    """Peak extra device and host memory of what runs inside it."""

    def __init__(self, torch):
        self.torch = torch

    def __enter__(self):
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        self.device_before = self.torch.cuda.memory_allocated()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
            self.rss_before = status("VmRSS:")
        except OSError:
            self.rss_before = None
        return self

    def __exit__(self, *exc):
        self.torch.cuda.synchronize()
        self.extra_device = self.torch.cuda.max_memory_allocated() - self.device_before
        hwm = status("VmHWM:")
        self.extra_host = (
            None if self.rss_before is None or hwm is None else max(0, hwm - self.rss_before)
        )
        return False


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Bench:
    def __init__(self, torch):
        self.torch = torch
        self.sd = None
        self.dir = None

    def setup(self, gb, directory):
        self.sd = None
        self.torch.cuda.empty_cache()
        self.sd = build_state_dict(self.torch, gb)
        self.dir = directory
        return {
            "tensors": len(self.sd),
            "bytes": sum(t.numel() * t.element_size() for t in self.sd.values()),
        }

    def path(self, ext):
        return os.path.join(self.dir, f"pytorch-{os.getpid()}.{ext}")

    def save(self, write, path):
        if os.path.exists(path):
            os.remove(path)
        with Meter(self.torch) as m:
            start = time.perf_counter()
            write(path)
            ms = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        fsync(path)
        fsync_ms = (time.perf_counter() - start) * 1e3
        return {"ms": ms, "fsync_ms": fsync_ms, "extra_device": m.extra_device,
                "extra_host": m.extra_host}

    def load(self, read, path):
        if not os.path.exists(path):
            raise RuntimeError(f"{path} is missing: run its save case first")
        with Meter(self.torch) as m:
            start = time.perf_counter()
            result = read(path)
            self.torch.cuda.synchronize()
            ms = (time.perf_counter() - start) * 1e3
        loaded = sum(t.numel() * t.element_size() for t in result.values())
        if set(result) != set(self.sd) or not all(
            result[k].is_cuda and result[k].shape == self.sd[k].shape for k in result
        ):
            raise RuntimeError("the loaded state dict differs from the saved one")
        first = next(iter(self.sd))
        if not self.torch.equal(result[first][:2], self.sd[first][:2]):
            raise RuntimeError(f"{first} came back with other values")
        del result
        return {"ms": ms, "extra_device": m.extra_device - loaded, "extra_host": m.extra_host,
                "result_bytes": loaded}

    def run(self, case):
        torch = self.torch
        if case == "torch_save":
            return self.save(lambda p: torch.save(self.sd, p), self.path("pt"))
        if case == "torch_load":
            return self.load(
                lambda p: torch.load(p, map_location="cuda", weights_only=True), self.path("pt"))
        if case == "torch_load_mmap":
            return self.load(
                lambda p: torch.load(p, map_location="cuda", weights_only=True, mmap=True),
                self.path("pt"))
        from safetensors.torch import load_file, save_file
        if case == "st_save":
            return self.save(lambda p: save_file(self.sd, p), self.path("safetensors"))
        if case == "st_load":
            return self.load(lambda p: load_file(p, device="cuda"), self.path("safetensors"))
        raise ValueError(f"unknown case {case!r}")

    def cleanup(self):
        for ext in ("pt", "safetensors"):
            if self.dir and os.path.exists(self.path(ext)):
                os.remove(self.path(ext))


def describe(torch):
    try:
        import safetensors
        st = safetensors.__version__
    except ImportError:
        st = None
    return harness.describe(torch, safetensors=st)


def start(torch):
    return Bench(torch), describe(torch)


def answer(bench, line):
    """`setup GB DIR`, `cleanup`, or a case id."""
    words = line.split()
    if not words:
        raise ValueError("empty request: expected `setup GB DIR`, `cleanup` or a case id")
    if words[0] == "setup":
        return {"case": "setup", **bench.setup(float(words[1]), words[2])}
    if words[0] == "cleanup":
        bench.cleanup()
        return {"case": "cleanup", "ok": True}
    return {"case": words[0], **bench.run(words[0])}


def run_alone(gb, directory, samples, warmup):
    torch = harness.require_torch()
    bench = Bench(torch)
    info = bench.setup(gb, directory)
    results = {case: [] for case in CASES}
    errors = {}
    try:
        for round_ in range(warmup + samples):
            print(f"round {round_ + 1} of {warmup + samples} ...", file=sys.stderr)
            for case in CASES:
                if case in errors:
                    continue
                try:
                    out = bench.run(case)
                except Exception as err:
                    errors[case] = f"{type(err).__name__}: {err}"
                    continue
                if round_ >= warmup:
                    results[case].append(out)
            bench.cleanup()
    finally:
        bench.cleanup()
    summary = {
        case: {"samples": rows, "median_ms": harness.median([r["ms"] for r in rows])}
        for case, rows in results.items()
        if rows
    }
    harness.emit({**describe(torch), **info, "samples": samples, "warmup": warmup, "cases": summary,
          "errors": errors})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--gb", type=float, default=10.0, help="GiB of the state dict")
    parser.add_argument("--dir", default=None, help="where files go (default: the temp dir)")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    if args.serve:
        harness.serve(start, answer, cleanup=Bench.cleanup)
    else:
        import tempfile
        run_alone(args.gb, args.dir or tempfile.gettempdir(), args.samples, args.warmup)


if __name__ == "__main__":
    main()
