#!/usr/bin/env python3
"""PyTorch's side of `ferry bench train`: training steps of two MLPs, the digits CNN and the
character-level GPT (tests/torch/gpt.py's model), eager, timed the same way as ferry; each in
fp32, three of them in bf16 autocast as well, and the wide MLP's matrix products alone. Then
two 1 B models in bf16 autocast with fp32 weights and torch.optim.AdamW(fused=True): the same GPT
at 20 x 2048 (heads of 128, SDPA's fused attention) and transformers' LlamaForCausalLM with
ferry's LlamaConfig::llama_1b (attn_implementation="sdpa"), at batch 8 and 16 x 1024 tokens.

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
    "gpt_1b_b8": ([1024, 256, 2048, 20], 8, 5),
    "gpt_1b_b16": ([1024, 256, 2048, 20], 16, 5),
    "llama_1b_b8": ([1024], 8, 5),
    "llama_1b_b16": ([1024], 16, 5),
}
# the cases whose forward and loss run in bf16 autocast
BF16 = {"mlp_4096_bf16", "digits_cnn_bf16", "gpt_bf16", "gpt_1b_b8", "gpt_1b_b16", "llama_1b_b8", "llama_1b_b16"}
# the 1 B models, trained with torch.optim.AdamW(fused=True) at LARGE_LR
LARGE = {"gpt_1b_b8", "gpt_1b_b16", "llama_1b_b8", "llama_1b_b16"}
CLASSES = 10
LR = 1e-3
LARGE_LR = 3e-4
# ferry's LlamaConfig::llama_1b (crates/ferry/src/models/llama/config.rs)
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=19,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                rms_norm_eps=1e-6, tie_word_embeddings=False)


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
        model_id = case.removesuffix("_bf16").removesuffix("_b8").removesuffix("_b16")
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
        elif model_id in ("gpt", "gpt_1b"):
            # ferry train gpt's model (and ferry bench offload-optim's at 1 B), tests/torch/gpt.py
            gpt = harness.load_gpt()
            context, vocab = widths[:2]
            if model_id == "gpt_1b":
                width, layers = widths[2:]
                heads = width // 128
            else:
                width, layers, heads = 128, 4, 4
            model = gpt.Gpt(vocab, context, width, layers, heads)
            self.x = (torch.rand(batch, context, device="cuda") * vocab).to(torch.int64)
            self.y = (torch.rand(batch * context, device="cuda") * vocab).to(torch.int64)
        elif model_id == "llama_1b":
            # transformers' Llama with its SDPA attention, as a user would train it
            import transformers
            config = transformers.LlamaConfig(**LLAMA_1B, attn_implementation="sdpa")
            llama = transformers.LlamaForCausalLM(config)
            model = logits_only(nn, llama)
            (context,), vocab = widths, LLAMA_1B["vocab_size"]
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
        if case in LARGE:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LARGE_LR, fused=True)
        else:
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


def logits_only(nn, lm):
    """A transformers causal LM as a module from token ids to logits (what ferry's Llama
    returns), so every model's loss is computed the same way."""

    class LogitsOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids, use_cache=False).logits

    return LogitsOnly()


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
    """The case last asked for, made once; asking for another frees it first (two 1 B models
    and their optimizers would not fit beside ferry's)."""

    def __init__(self, torch):
        self.torch = torch
        self._case, self._run = None, None

    def get(self, case):
        if case != self._case:
            self.clear()
            self._run = Run(self.torch, case)
            self._case = case
        return self._run

    def clear(self):
        """Frees the case held, and the allocator's cache."""
        self._case, self._run = None, None
        self.torch.cuda.empty_cache()


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


def losses(runs, line):
    """`losses CASE STEPS DIR` (`ferry bench train --losses`): transformers' Llama loaded from
    DIR (written by ferry's save_pretrained), trained STEPS steps on DIR/batches.safetensors
    (i64 [steps, batch, context + 1]) with bf16 autocast and fused AdamW; every step's loss."""
    parts = line.split()
    if len(parts) != 4 or parts[1] not in LARGE or not parts[1].startswith("llama"):
        raise ValueError(f"expected `losses llama_1b_bN STEPS DIR`, got {line.strip()!r}")
    steps, directory = int(parts[2]), parts[3]
    torch = runs.torch
    runs.clear()
    import transformers
    from safetensors.torch import load_file

    model = transformers.LlamaForCausalLM.from_pretrained(
        directory, torch_dtype=torch.float32, attn_implementation="sdpa").cuda()
    batches = load_file(os.path.join(directory, "batches.safetensors"))["batches"].cuda()
    if batches.shape[0] < steps:
        raise ValueError(f"batches.safetensors holds {batches.shape[0]} steps, not {steps}")
    opt = torch.optim.AdamW(model.parameters(), lr=LARGE_LR, fused=True)
    out = []
    for step in range(steps):
        x, y = batches[step, :, :-1], batches[step, :, 1:]
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(y.numel(), -1), y.reshape(-1))
        loss.backward()
        opt.step()
        out.append(loss.item())
    del model, opt, batches
    torch.cuda.empty_cache()
    return {"case": parts[1], "steps": steps, "losses": out}


def profile(runs, line):
    """`profile CASE STEPS` (`ferry bench train --profile`): the GPU kernels of STEPS of
    PyTorch's steps of CASE under torch.profiler, summed by name, per step: the same view as
    ferry's kernel table, so the two can be set side by side."""
    parts = line.split()
    if len(parts) != 3:
        raise ValueError(f"expected `profile CASE STEPS`, got {line.strip()!r}")
    case, steps = parts[1], int(parts[2])
    torch = runs.torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    run = runs.get(case)
    run.step()  # outside the profile: the first step after a round may allocate
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run.step()
        torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        if getattr(event, "device_type", None) != DeviceType.CUDA:
            continue
        total = getattr(event, "device_time_total", None)
        if total is None:
            total = event.cuda_time_total
        if total > 0:
            kernels.append({"name": event.key, "launches": event.count / steps,
                            "us": total / steps})
    kernels.sort(key=lambda k: -k["us"])
    return {"case": case, "steps": steps, "kernels": kernels}


def answer(runs, line):
    """One round of `CASE STEPS`: its mean ms per step, and the most bytes the caching
    allocator held during it; or a `losses` or `profile` request."""
    if line.startswith("losses "):
        return losses(runs, line)
    if line.startswith("profile "):
        return profile(runs, line)
    case, steps = parse_request(line)
    run = runs.get(case)
    runs.torch.cuda.reset_peak_memory_stats()
    ms = run.round_ms_per_step(steps)
    peak = runs.torch.cuda.max_memory_allocated()
    return {"case": case, "steps": steps, "ms": ms, "peak_bytes": peak}


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
