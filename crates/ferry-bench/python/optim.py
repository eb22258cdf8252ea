#!/usr/bin/env python3
"""PyTorch's side of `ferry bench optim`: torch.optim.AdamW(fused=True) on CPU tensors, and the
host's copy bandwidth as torch measures it, timed like ferry's.

  python3 optim.py --serve     one sample per request line on stdin, one JSON line each

Requests:
  case NAME PARAMS      Builds case NAME (`one`: one float32 tensor of PARAMS elements;
                        `model`: the parameters of the Llama that python -m ferry.bench trains,
                        built on the meta device from its transformers config, then allocated
                        on the CPU), with f32 gradients, and an AdamW(lr=1e-3, betas=(0.9,
                        0.999), eps=1e-8, weight_decay=0.01, fused=True) over it. Answers
                        {"tensors": N, "params": P} so ferry can check it steps the same list.
  step                  One optimizer.step() of the current case. Answers {"ms": ...}.
  copy BYTES            One dst.copy_(src) of BYTES bytes between two CPU tensors made once.
                        Answers {"ms": ...}.

The first line gives torch's version and its intra-op thread count. Needs torch (no GPU);
`model` also needs transformers.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (the shared --serve loop and timing, beside this script)

# The Llama of crates/ferry-py/python/ferry/bench_models.py (kept equal by ferry's side, which
# compares the tensor and parameter counts this script reports).
LLAMA = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000, num_hidden_layers=19)


class Bench:
    def __init__(self, torch):
        self.torch = torch
        self.opt = None
        self.params = []
        self.copies = {}

    def case(self, name, count):
        torch = self.torch
        self.opt, self.params = None, []
        if name == "one":
            shapes = [(count,)]
        elif name == "model":
            from transformers import LlamaConfig, LlamaForCausalLM

            with torch.device("meta"):
                model = LlamaForCausalLM(LlamaConfig(**LLAMA))
            shapes = [tuple(p.shape) for p in model.parameters()]
            del model
        else:
            raise ValueError(f"case {name!r} is not `one` or `model`")
        g = torch.Generator().manual_seed(0)
        for shape in shapes:
            p = torch.empty(shape).uniform_(-1, 1, generator=g).requires_grad_()
            p.grad = torch.empty(shape).uniform_(-1, 1, generator=g)
            self.params.append(p)
        self.opt = torch.optim.AdamW(self.params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                     weight_decay=0.01, fused=True)
        return {"tensors": len(self.params), "params": sum(p.numel() for p in self.params)}

    def step(self):
        if self.opt is None:
            raise ValueError("no case: send `case NAME PARAMS` first")
        start = time.perf_counter()
        self.opt.step()
        return (time.perf_counter() - start) * 1e3

    def copy(self, nbytes):
        torch = self.torch
        if nbytes not in self.copies:
            self.copies.clear()
            src = torch.ones(nbytes, dtype=torch.uint8)
            self.copies[nbytes] = (src, torch.zeros_like(src))
        src, dst = self.copies[nbytes]
        start = time.perf_counter()
        dst.copy_(src)
        return (time.perf_counter() - start) * 1e3


def answer(bench, line):
    parts = line.split()
    if len(parts) == 3 and parts[0] == "case":
        return bench.case(parts[1], int(parts[2]))
    if parts == ["step"]:
        return {"ms": bench.step()}
    if len(parts) == 2 and parts[0] == "copy":
        return {"ms": bench.copy(int(parts[1]))}
    raise ValueError(f"expected `case NAME PARAMS`, `step` or `copy BYTES`, got {line.strip()!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", action="store_true", required=True)
    parser.parse_args()

    def start(torch):
        return Bench(torch), harness.describe(torch, threads=torch.get_num_threads())

    harness.serve(start, answer, torch_needs={"cuda": False}, echo="request")


if __name__ == "__main__":
    main()
