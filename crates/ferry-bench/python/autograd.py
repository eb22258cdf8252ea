#!/usr/bin/env python3
"""PyTorch's side of `ferry bench autograd`: the same chains and steps, measured the same way.

Two ways to run it:
  python3 autograd.py --all            every measurement alone, one JSON object
  python3 autograd.py --serve          one measurement per request line on stdin, one JSON line
                                       each (how `ferry bench autograd --compare-pytorch`
                                       interleaves its rounds with ferry's)

Requests (`--serve`):
  memory CHAIN        build CHAIN on cuda:0 the natural PyTorch way, keep what a user keeps (the
                      leaves, inputs and the output), then `output.sum().backward()`; answers
                      {"retained_bytes", "backward_peak_bytes", "after_drop_bytes"}, each
                      torch.cuda.memory_allocated() (or max_memory_allocated() after
                      reset_peak_memory_stats()) minus what was allocated before the inputs
  overhead T STEPS    STEPS steps of 64x64 f32 (x * y + x).relu().sum().backward() on the CPU
                      with torch.set_num_threads(T) (0: PyTorch's default); answers {"ms": ms per
                      step, "threads": T used}
  threads N STEPS     N Python threads, each stepping its own 64x64 model STEPS times (intra-op
                      threads 1); answers {"steps_per_s": all threads' steps / wall seconds}

The chains, their ids and SIDE match crates/ferry-bench/src/autograd/chains.rs (a Rust test
checks the ids and SIDE). Needs only torch; the memory rows need a GPU, the others do not.
"""

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (the shared --serve loop and timing, beside this script)

SIDE = 10_240  # square tensors are SIDE x SIDE float32 = 400 MiB, a multiple of 2 MiB
DEVICE = "cuda"  # where the chains run (cuda:0)
SMALL = 64  # the per-op and thread-scaling model: 64x64 float32 leaves
OPS_PER_STEP = 4  # mul, add, relu, sum


# The CPU rows run without a GPU; the memory rows answer an error there.
NEEDS = {"cuda": False}


# Each chain takes (torch, side) and returns (what the user holds, the output). Intermediates are
# temporaries of the expressions, so they are freed as soon as nothing saved them.


def leaf(torch, *shape):
    return torch.randn(*shape, device=DEVICE, requires_grad=True)


def elementwise(torch, n):
    x = leaf(torch, n, n)
    return [x], (x * 2 + 1 + x).exp()


def linear_relu(torch, n):
    b, d = n, n // 2
    x = torch.randn(b, d, device=DEVICE)
    w1, b1, w2, b2 = leaf(torch, d, d), leaf(torch, d), leaf(torch, d, d), leaf(torch, d)
    h = (x @ w1 + b1).relu()
    return [x, w1, b1, w2, b2], (h @ w2 + b2).relu()


def tanh(torch, n):
    x = leaf(torch, n, n)
    return [x], (x.tanh() * 2).tanh()


def silu(torch, n):
    x = leaf(torch, n, n)
    return [x], x * x.sigmoid()


def softmax(torch, n):
    x = leaf(torch, n, n)
    return [x], x.softmax(-1)


def cross_entropy(torch, n):
    x = leaf(torch, n, n)
    targets = torch.arange(n, device=DEVICE)
    return [x, targets], torch.nn.functional.cross_entropy(x, targets)


def views(torch, n):
    x, w = leaf(torch, n, n), leaf(torch, n // 2, n)
    return [x, w], x.reshape(2 * n, n // 2).t().narrow(1, 0, n) * w


def device_move(torch, n):
    x = leaf(torch, n, n)
    return [x], x.exp().cpu().tanh().to(DEVICE)


CHAINS = {
    "elementwise": elementwise,
    "linear_relu": linear_relu,
    "tanh": tanh,
    "silu": silu,
    "softmax": softmax,
    "cross_entropy": cross_entropy,
    "views": views,
    "device_move": device_move,
}


def measure_memory(torch, chain):
    if not torch.cuda.is_available():
        raise RuntimeError(f"PyTorch {torch.__version__} sees no CUDA device")
    cuda = torch.cuda
    cuda.synchronize()
    base = cuda.memory_allocated()
    held, out = CHAINS[chain](torch, SIDE)
    cuda.synchronize()
    retained = cuda.memory_allocated() - base
    loss = out.sum()
    cuda.synchronize()
    cuda.reset_peak_memory_stats()
    loss.backward()
    cuda.synchronize()
    peak = cuda.max_memory_allocated() - base
    del held, out, loss
    cuda.synchronize()
    after = cuda.memory_allocated() - base
    return {
        "retained_bytes": retained,
        "backward_peak_bytes": peak,
        "after_drop_bytes": after,
    }


def small_model(torch):
    x = torch.randn(SMALL, SMALL, requires_grad=True)
    y = torch.randn(SMALL, SMALL, requires_grad=True)
    return x, y


def step(x, y):
    # Gradients accumulate across steps, as in ferry's loop: no zeroing on either side.
    (x * y + x).relu().sum().backward()


class Cpu:
    """The per-op model (made once) and PyTorch's default intra-op thread count."""

    def __init__(self, torch):
        self.torch = torch
        self.default_threads = torch.get_num_threads()
        self.model = small_model(torch)

    def overhead(self, threads, steps):
        used = threads or self.default_threads
        self.torch.set_num_threads(used)
        x, y = self.model
        start = time.perf_counter()
        for _ in range(steps):
            step(x, y)
        ms = (time.perf_counter() - start) * 1e3 / steps
        return {"ms": ms, "threads": used}

    def threads(self, n, steps):
        # Python threads share the GIL: each op's Python-side dispatch holds it, so this shows
        # what a Python user gets from threads, not what PyTorch's C++ core could do.
        self.torch.set_num_threads(1)
        models = [small_model(self.torch) for _ in range(n)]
        barrier = threading.Barrier(n + 1)
        errors = []

        def work(model):
            barrier.wait()
            try:
                for _ in range(steps):
                    step(*model)
            except Exception as err:  # reported, not swallowed
                errors.append(err)

        workers = [threading.Thread(target=work, args=(m,)) for m in models]
        for w in workers:
            w.start()
        barrier.wait()
        start = time.perf_counter()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - start
        if errors:
            raise errors[0]
        return {"steps_per_s": n * steps / seconds}


def describe(torch):
    info = harness.describe(torch, cpu_threads=torch.get_num_threads())
    if not torch.cuda.is_available():
        info["device"] = "no CUDA device (CPU rows only)"
    return info


def answer(cpu, line):
    """The reply to one request line; raises ValueError for a malformed one."""
    torch = cpu.torch
    parts = line.split()
    kind, args = (parts[0], parts[1:]) if parts else ("", [])
    if kind == "memory" and len(args) == 1 and args[0] in CHAINS:
        return {"case": args[0], **measure_memory(torch, args[0])}
    if kind == "overhead" and len(args) == 2:
        return cpu.overhead(harness.count(args[0], "threads", zero_ok=True),
                            harness.count(args[1], "steps"))
    if kind == "threads" and len(args) == 2:
        return cpu.threads(harness.count(args[0], "thread count"), harness.count(args[1], "steps"))
    raise ValueError(
        f"unknown request {line.strip()!r}: expected `memory CHAIN` (one of "
        f"{', '.join(CHAINS)}), `overhead THREADS STEPS` or `threads N STEPS`"
    )


def start(torch):
    return Cpu(torch), describe(torch)


def run_alone(rounds, warmup):
    torch = harness.require_torch(**NEEDS)
    cpu = Cpu(torch)
    info = describe(torch)  # before the thread rows change torch's thread count
    results = {}

    def attempt(key, measure):
        print(f"measuring {key} ...", file=sys.stderr)
        try:
            results[key] = measure()
        except Exception as err:
            results[key] = {"error": f"{type(err).__name__}: {err}"}

    for chain in CHAINS:
        attempt(f"memory {chain}", lambda: [measure_memory(torch, chain) for _ in range(2)][-1])

    def timed(request, key):
        samples = [answer(cpu, request)[key] for _ in range(warmup + rounds)][warmup:]
        return {key: samples, "median": harness.median(samples)}

    for threads in (1, 0):
        attempt(f"overhead {threads}", lambda: timed(f"overhead {threads} 1000", "ms"))
    for n in (1, 2, 4, 8, 16):
        attempt(f"threads {n}", lambda: timed(f"threads {n} 200", "steps_per_s"))
    harness.emit({**info, "rounds": rounds, "warmup": warmup, "results": results})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", action="store_true", help="answer request lines on stdin")
    mode.add_argument("--all", action="store_true", help="run every measurement once, alone")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds of the CPU rows")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds of the CPU rows")
    args = parser.parse_args()
    if args.serve:
        harness.serve(start, answer, torch_needs=NEEDS)
        return
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    run_alone(args.rounds, args.warmup)


if __name__ == "__main__":
    main()
