#!/usr/bin/env python3
"""PyTorch's side of `ferry bench attention`: torch.nn.functional.scaled_dot_product_attention
forward and backward, timed like ferry's.

  python3 attention.py --serve     one sample per request line on stdin, one JSON line each

Requests:
  case DEVICE DTYPE B H HKV T D CAUSAL   Builds q [B, H, T, D], k and v [B, HKV, T, D] (standard
                                         normal, seed 0) on DEVICE (cpu or cuda) in DTYPE
                                         (bfloat16, float16, float32), requiring grad, and a
                                         gradient for the output; CAUSAL is 0 or 1.
  forward                                One forward with grad recorded. Answers {"ms": ...}.
  backward                               One forward untimed, then its backward timed.
                                         Answers {"ms": ...}.

Each sample synchronizes the device before the clock starts and before it stops. The first line
gives torch's version and the GPU. Needs torch; a CUDA case needs a GPU.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (the shared --serve loop, beside this script)


class Bench:
    def __init__(self, torch):
        self.torch = torch
        self.case = None

    def build(self, device, dtype, b, h, hkv, t, d, causal):
        torch = self.torch
        self.case = None
        g = torch.Generator().manual_seed(0)
        dtype = getattr(torch, dtype)

        def draw(heads):
            x = torch.randn(b, heads, t, d, generator=g).to(device=device, dtype=dtype)
            return x.requires_grad_()

        q, k, v = draw(h), draw(hkv), draw(hkv)
        grad = torch.randn(b, h, t, d, generator=g).to(device=device, dtype=dtype)
        self.case = (q, k, v, grad, causal == "1", h != hkv)
        return {"built": [b, h, hkv, t, d]}

    def forward(self):
        q, k, v, _, causal, gqa = self.case
        return self.torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=gqa)

    def timed(self, work):
        torch = self.torch
        sync = torch.cuda.synchronize if self.case[0].is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        result = work()
        sync()
        ms = (time.perf_counter() - start) * 1e3
        del result
        return ms

    def backward(self):
        q, k, v, grad, _, _ = self.case
        for x in (q, k, v):
            x.grad = None
        out = self.forward()
        return self.timed(lambda: out.backward(grad))


def answer(bench, line):
    parts = line.split()
    if len(parts) == 9 and parts[0] == "case":
        device, dtype = parts[1], parts[2]
        sizes = [harness.count(x, "a size") for x in parts[3:8]]
        return bench.build(device, dtype, *sizes, parts[8])
    if bench.case is None:
        raise ValueError("no case: send `case DEVICE DTYPE B H HKV T D CAUSAL` first")
    if parts == ["forward"]:
        return {"ms": bench.timed(bench.forward)}
    if parts == ["backward"]:
        return {"ms": bench.backward()}
    raise ValueError(f"expected `case ...`, `forward` or `backward`, got {line.strip()!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", action="store_true", required=True)
    parser.parse_args()

    def start(torch):
        return Bench(torch), harness.describe(torch)

    harness.serve(start, answer, torch_needs={"cuda": False}, echo="request")


if __name__ == "__main__":
    main()
