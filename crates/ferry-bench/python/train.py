#!/usr/bin/env python3
"""PyTorch's side of `ferry bench train`: training steps of two MLPs, the digits CNN and the
character-level GPT (tests/torch/gpt.py's model), eager, timed the same way as ferry; each in
fp32, three of them in bf16 autocast as well, and the wide MLP's matrix products alone.

Two ways to run it:
  python3 train.py --cases all           every case alone: warm-up, rounds, one JSON object
  python3 train.py --serve               one round per request line `CASE STEPS` on stdin, one
                                         JSON line each, `{"ms": ms per step}` (how `ferry bench
                                         train --compare-pytorch` interleaves its rounds)

A step is what ferry's is: zero_grad (set to None), forward, cross-entropy, backward, Adam
(lr 1e-3, PyTorch's default implementation) step. Eager only: no torch.compile, no CUDA graphs,
and TF32 off, so both sides compute in fp32. Inputs are standard normal, labels uniform ints in
[0, 10), made on the GPU before any clock starts. A round synchronizes the GPU, runs STEPS steps,
synchronizes again and reports the mean time per step; no loss is read inside a round. The
`_bf16` cases run forward and loss inside `torch.autocast("cuda", dtype=torch.bfloat16)`, with
fp32 weights and optimizer. `mlp_4096_gemms` times only the eight fp32 products of mlp_4096's
step (torch.mm of the same shapes, under no_grad). Case ids,
layer widths and batch sizes match crates/ferry-bench/src/train.rs (a Rust test checks).
Needs only torch (and a GPU).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (the shared --serve loop and timing, beside this script)

# id: (layer widths, batch size, steps per round); for digits_cnn the widths are
# [features, classes], for gpt [context, vocabulary]
CASES = {
    "digits_mlp": ([64, 128, 10], 64, 200),
    "mlp_4096": ([1024, 4096, 4096, 10], 1024, 50),
    "digits_cnn": ([64, 10], 64, 100),
    "gpt": ([64, 57], 32, 50),
    "mlp_4096_gemms": ([1024, 4096, 4096, 10], 1024, 50),
    "mlp_4096_bf16": ([1024, 4096, 4096, 10], 1024, 50),
    "digits_cnn_bf16": ([64, 10], 64, 100),
    "gpt_bf16": ([64, 57], 32, 50),
}
# the cases whose forward and loss run in bf16 autocast
BF16 = {"mlp_4096_bf16", "digits_cnn_bf16", "gpt_bf16"}
CLASSES = 10
LR = 1e-3


def fp32_only(torch):
    """TF32 off, so both sides compute in fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


class Run:
    """One case's model, optimizer and batch, made once, outside any timed region."""

    def __init__(self, torch, case):
        widths, batch, _ = CASES[case]
        nn = torch.nn
        torch.manual_seed(0)
        self.torch = torch
        self.bf16 = case in BF16
        self.gemms = None
        self.loss = None
        model_id = case.removesuffix("_bf16")
        if case == "mlp_4096_gemms":
            self.gemms = mlp_gemms(torch, widths, batch)
            torch.cuda.synchronize()
            return
        if model_id == "digits_cnn":
            # ferry train digits-cnn's CNN, without dropout
            model = nn.Sequential(
                nn.Unflatten(1, (1, 8, 8)),
                nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                nn.MaxPool2d(2), nn.Flatten(),
                nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                nn.Linear(64, widths[1]))
            self.x = torch.randn(batch, widths[0], device="cuda")
            self.y = (torch.rand(batch, device="cuda") * widths[1]).to(torch.int64)
        elif model_id == "gpt":
            # ferry train gpt's model, from tests/torch/gpt.py
            import importlib.util
            import pathlib
            path = pathlib.Path(__file__).resolve().parents[3] / "tests" / "torch" / "gpt.py"
            spec = importlib.util.spec_from_file_location("ferry_gpt", path)
            gpt = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(gpt)
            context, vocab = widths
            model = gpt.Gpt(vocab, context, 128, 4, 4)
            self.x = (torch.rand(batch, context, device="cuda") * vocab).to(torch.int64)
            self.y = (torch.rand(batch * context, device="cuda") * vocab).to(torch.int64)
        else:
            layers = []
            for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
                if i > 0:
                    layers.append(nn.ReLU())
                layers.append(nn.Linear(fan_in, fan_out))
            model = nn.Sequential(*layers)
            self.x = torch.randn(batch, widths[0], device="cuda")
            self.y = (torch.rand(batch, device="cuda") * CLASSES).to(torch.int64)
        self.model = model.cuda()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=LR)
        torch.cuda.synchronize()

    def step(self):
        torch = self.torch
        if self.gemms is not None:
            with torch.no_grad():
                for left, right in self.gemms:
                    torch.mm(left, right)
            return
        self.opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(self.x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(self.y.numel(), -1), self.y)
        loss.backward()
        self.opt.step()
        self.loss = loss.detach()  # stays on the GPU: reading it would synchronize

    def round_ms_per_step(self, steps):
        def round_():
            for _ in range(steps):
                self.step()

        return harness.synced_ms(self.torch, round_) / steps


def mlp_gemms(torch, widths, batch):
    """The eight products of an MLP step (as crates/ferry-bench/src/train.rs's mlp_gemms): per
    layer forward a @ W.T, backward g.T @ a and, past the first layer, g @ W."""
    products = []
    for layer, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        a = torch.randn(batch, fan_in, device="cuda")
        w = torch.randn(fan_out, fan_in, device="cuda")
        g = torch.randn(batch, fan_out, device="cuda")
        products += [(a, w.t()), (g.t(), a)]
        if layer > 0:
            products.append((g, w))
    return products


class Runs:
    def __init__(self, torch):
        self.torch = torch
        self._made = {}

    def get(self, case):
        if case not in self._made:
            self._made[case] = Run(self.torch, case)
        return self._made[case]


def describe(torch):
    return harness.describe(torch, allow_tf32=torch.backends.cuda.matmul.allow_tf32)


def parse_request(line):
    """`CASE STEPS` (STEPS defaults to the case's own) -> (case, steps), or raises ValueError."""
    parts = line.split()
    if not parts or parts[0] not in CASES:
        raise ValueError(f"unknown case {line.strip()!r}; the cases are {', '.join(CASES)}")
    steps = int(parts[1]) if len(parts) > 1 else CASES[parts[0]][2]
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    return parts[0], steps


def start(torch):
    fp32_only(torch)
    return Runs(torch), describe(torch)


def answer(runs, line):
    """One round of `CASE STEPS`: its mean ms per step."""
    case, steps = parse_request(line)
    return {"case": case, "steps": steps, "ms": runs.get(case).round_ms_per_step(steps)}


def run_alone(ids, rounds, warmup, steps):
    torch = harness.require_torch()
    fp32_only(torch)
    runs = Runs(torch)
    results = {}
    for case in ids:
        print(f"measuring {case} ...", file=sys.stderr)
        n = steps or CASES[case][2]
        try:
            run = runs.get(case)
            for _ in range(warmup):
                run.round_ms_per_step(n)
            times = [run.round_ms_per_step(n) for _ in range(rounds)]
            results[case] = {
                "steps_per_round": n,
                "ms_per_step": times,
                "median_ms_per_step": harness.median(times),
                "final_loss": None if run.loss is None else run.loss.item(),
            }
        except Exception as err:
            results[case] = {"error": f"{type(err).__name__}: {err}"}
    harness.emit({**describe(torch), "rounds": rounds, "warmup": warmup, "cases": results})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help="answer `CASE STEPS` lines on stdin")
    parser.add_argument("--cases", default="all", help="ids joined by commas, or all (default)")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per case")
    parser.add_argument("--steps", type=int, default=0, help="steps per round (0: the case's own)")
    args = parser.parse_args()
    if args.serve:
        harness.serve(start, answer)
        return
    ids = list(CASES) if args.cases == "all" else args.cases.split(",")
    unknown = [i for i in ids if i not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; the cases are {', '.join(CASES)}")
    if args.rounds < 1 or args.warmup < 0 or args.steps < 0:
        parser.error("--rounds must be >= 1, --warmup and --steps >= 0")
    run_alone(ids, args.rounds, args.warmup, args.steps)


if __name__ == "__main__":
    main()
