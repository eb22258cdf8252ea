#!/usr/bin/env python3
"""PyTorch's rows of `ferry bench offload-optim --compare-pytorch`: the same GPT (from
tests/torch/gpt.py, the model of `ferry train gpt`, heads of 128; fp32 weights, bf16 autocast)
at the same batch, trained by

  AdamW on the GPU       torch.optim.AdamW(fused=True), the state on the GPU: the baseline.
  simple offload         after backward, every gradient to pinned host memory, torch's fused CPU
                         AdamW on fp32 host copies of the weights, the weights back; nothing
                         overlaps.
  torchao                torchao.optim.CPUOffloadOptimizer (fused CPU AdamW), also with
                         offload_gradients=True; left out, with a note, where torchao is not
                         installed.

A fresh model per row (torchao leaves hooks on the parameters), the same synthetic batch for all.

    python3 offload_optim.py --layers 20 --width 2048 --batch 8 --seq 1024 --samples 5 --warmup 2

Prints one JSON object: torch's version, a note when torchao is missing, and per row: name,
params, ms (each timed step: zero_grad, forward, backward, step, synchronize), peak_bytes (the
most GPU memory allocated over the timed steps), or error.
"""

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (the shared helpers, beside this script)

VOCAB = 256
LR = 1e-4


def run_row(torch, gpt, args, make):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = gpt.Gpt(VOCAB, args.seq, args.width, args.layers, args.width // 128)
    params = sum(p.numel() for p in model.parameters())
    opt = make(model.parameters())
    n = args.batch * args.seq
    ids = torch.tensor([(i * 2_654_435_761) % VOCAB for i in range(n + 1)], dtype=torch.int64)
    x, y = ids[:n].view(args.batch, args.seq).cuda(), ids[1:].cuda()

    def step():
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), y)
        loss.backward()
        opt.step()

    try:
        times, peak = harness.timed_steps(torch, step, args.warmup, args.samples)
        return {"ms": times, "peak_bytes": peak, "params": params}
    except torch.OutOfMemoryError as err:
        return {"error": f"out of GPU memory ({err})", "params": params}
    finally:
        del opt, model
        gc.collect()
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--layers", 20), ("--width", 2048), ("--batch", 8), ("--seq", 1024),
                          ("--samples", 5), ("--warmup", 2)):
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    torch = harness.require_torch()
    gpt = harness.load_gpt()
    rows, note = harness.optimizer_rows(torch, LR)
    out = {"torch": torch.__version__, "rows": []}
    if note:
        out["note"] = note
    for name, make in rows:
        print(f"PyTorch: {name} ...", file=sys.stderr, flush=True)
        out["rows"].append({"name": name, **run_row(torch, gpt, args, make)})
    harness.emit(out)


if __name__ == "__main__":
    main()
