"""``python -m ferry.bench --models [gpt2,gpt2-b8,llama,vit]``: ferry on real models, built from
their configs with random weights (nothing is downloaded), beside PyTorch's ways, in one process.

Table 1, per model: a training step as is, under ``ferry.offload_saved()``, under
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` and under
``ferry.offload_saved(max_device_bytes=T)`` at two targets, samples interleaved: time, peak
allocated GPU memory, and how much of the saved activations the peak lost. Beside it, the ferry
step against its link bound, ``max(forward, offloaded / D2H) + max(backward, offloaded / H2D)``,
and its gradients against a step without offload. Table 2: state dicts to the host,
``ferry.move_state_dict`` against the ``non_blocking`` loop and ``.cpu()``. ``--profile MODEL``
profiles one offload step of that model. ``--json FILE`` gets every sample.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import time
from dataclasses import dataclass

import torch

import ferry

from . import bench_harness

GIB = 1 << 30
MODELS = ("gpt2", "gpt2-b8", "llama", "vit")
# Few samples: a GPT-2 round of five steps takes ~10 s on the H200 (save_on_cpu's row is slow).
SAMPLES, WARMUP = 5, 1
BOUND_GOAL, LINK_SHARE_GOAL = 1.15, 0.90


@dataclass
class Workload:
    """A model, its batch and its loss: everything a training step needs."""

    name: str
    what: str  # the configuration, in one line
    batch: str  # the batch and the precision, in one line
    model: torch.nn.Module
    inputs: tuple
    loss_of: object  # (model, *inputs) -> scalar loss
    autocast: torch.dtype | None
    state_dicts: tuple = ()  # the dtypes of the model's state-dict rows, in order

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def loss(self):
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            return self.loss_of(self.model, *self.inputs)


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _image_loss(model, images, labels):
    return torch.nn.functional.cross_entropy(model(images), labels)


def _token_ids(vocab, batch, seq, device):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)


def _gpt2(name, batch, device, tiny):
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64) if tiny else {}
    c = GPT2Config(attn_implementation="sdpa", **size)
    seq = 16 if tiny else 1024
    with torch.device(device):
        model = GPT2LMHeadModel(c)
    what = (f"GPT-2, {c.n_layer} layers, {c.n_embd} wide, {c.n_head} heads, vocab {c.vocab_size}, "
            f"dropout {c.resid_pdrop}")
    return Workload(name, what, f"batch {batch} x {seq} tokens, fp32", model,
                    (_token_ids(c.vocab_size, batch, seq, device),), _lm_loss, None)


def _llama(name, batch, device, tiny):
    from transformers import LlamaConfig, LlamaForCausalLM

    # 19 layers: 0.97 B parameters (18 give 0.92 B); the shape of TinyLlama, fewer layers.
    size = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, num_hidden_layers=19)
    if tiny:
        size = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512, num_hidden_layers=2)
    c = LlamaConfig(attn_implementation="sdpa", **size)
    seq = 16 if tiny else 1024
    with torch.device(device):
        model = LlamaForCausalLM(c)
    what = (f"Llama, {c.num_hidden_layers} layers, hidden {c.hidden_size}, intermediate "
            f"{c.intermediate_size}, {c.num_attention_heads} heads ({c.num_key_value_heads} KV), "
            f"vocab {c.vocab_size}")
    return Workload(name, what, f"batch {batch} x {seq} tokens, bf16 autocast, fp32 weights", model,
                    (_token_ids(c.vocab_size, batch, seq, device),), _lm_loss, torch.bfloat16)


def _vit(name, batch, device, tiny):
    import timm

    size = dict(depth=2, embed_dim=64, num_heads=4, img_size=32) if tiny else {}
    with torch.device(device):
        model = timm.create_model("vit_base_patch16_224", pretrained=False, **size)
    side = model.patch_embed.img_size[0]
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, side, side, generator=g).to(device)
    labels = torch.randint(0, model.num_classes, (batch,), generator=g).to(device)
    what = (f"timm vit_base_patch16_224, {len(model.blocks)} blocks, {model.embed_dim} wide, "
            f"{model.blocks[0].attn.num_heads} heads, {side} px, {model.num_classes} classes")
    return Workload(name, what, f"batch {batch}, fp32", model, (images, labels), _image_loss, None)


# name: (builder, batch, the dtypes of its state-dict rows; gpt2-b8's model is gpt2's)
_BUILDERS = {
    "gpt2": (_gpt2, 12, ("float32",)),
    "gpt2-b8": (_gpt2, 8, ()),
    "llama": (_llama, 4, ("float32", "bfloat16")),
    "vit": (_vit, 128, ("float32",)),
}


def build(name: str, device, tiny: bool = False) -> Workload:
    """The workload ``name`` on ``device`` with random weights (seed 0) in training mode; ``tiny``:
    2 layers, small widths, batch 2 (x 16 tokens), for a smoke test on the CPU."""
    make, batch, state_dicts = _BUILDERS[name]
    torch.manual_seed(0)
    work = make(name, 2 if tiny else batch, device, tiny)
    work.state_dicts = state_dicts
    work.model.train()
    return work


class _NoMark:
    def record(self):
        pass


_NO_MARKS = (_NoMark(),) * 3


def step(work: Workload, scope=None, marks=_NO_MARKS) -> None:
    """One forward (under ``scope``, a context manager, if given) and backward; ``marks`` (three
    CUDA events) are recorded at the start, between forward and backward, and at the end."""
    marks[0].record()
    with scope if scope is not None else contextlib.nullcontext():
        loss = work.loss()
    marks[1].record()
    loss.backward()
    marks[2].record()


def saved_activations(work: Workload) -> tuple[int, int]:
    """(bytes, storages) of the activations a step saves for backward on the model's device: the
    unique storages of saved tensors made by a recorded op (they or their base have a grad_fn),
    what an offload scope could move. Parameters and the batch are not counted."""

    def counted(t):
        base = t._base if t._base is not None else t
        return t.device.type == work.device.type and base.grad_fn is not None

    work.model.zero_grad(set_to_none=True)
    return bench_harness.saved_storages(torch, work.loss, counted)


def gradients(work: Workload, scope_factory=contextlib.nullcontext) -> list:
    """The parameter gradients of one step under ``scope_factory()``, dropout seeded alike for
    every step compared (so its masks are the same)."""
    work.model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    step(work, scope_factory())
    grads = [p.grad for p in work.model.parameters()]
    work.model.zero_grad(set_to_none=True)
    return grads


def gradient_difference(a: list, b: list) -> tuple[float, float]:
    """(max abs difference, norm of the difference / norm of ``a``) over all gradients."""
    max_abs, diff, norm = 0.0, 0.0, 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            if (x is None) != (y is None):
                return math.inf, math.inf
            continue
        d = x.double() - y.double()
        max_abs = max(max_abs, d.abs().max().item())
        diff += d.square().sum().item()
        norm += x.double().square().sum().item()
    return max_abs, math.sqrt(diff / norm) if norm else 0.0


def _median(xs):
    return bench_harness.median(xs, empty=math.nan)


def link_bandwidth(samples: int = 7) -> dict:
    """Bytes per second of a 1 GiB fp32 copy between the GPU and pinned host memory each way
    (median; non_blocking copies timed by CUDA events), and the samples."""
    device = torch.randn(GIB // 4, device="cuda")
    host = torch.empty(GIB // 4, pin_memory=True)
    record = {"d2h": [], "h2d": []}
    for _ in range(samples + 1):  # the first of each way warms up
        for way, dst, src in (("d2h", host, device), ("h2d", device, host)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            record[way].append(GIB / (start.elapsed_time(end) / 1e3))
    record = {way: xs[1:] for way, xs in record.items()}
    return {"d2h": _median(record["d2h"]), "h2d": _median(record["h2d"]), "samples": record}


def _is_oom(e: BaseException) -> bool:
    # Pinned host allocations that fail raise a plain RuntimeError.
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)


def _measured_step(work: Workload, scope_factory, empty_cache: bool = True):
    """(forward ms, backward ms, peak allocated and reserved bytes above the step's start, the
    scope's stats or None) of one step, or None when it ran out of memory. ``empty_cache``:
    the allocator's cache is emptied first (the reserved peak is then the step's own, and the
    step pays for its device allocations); else the step runs on the cache as it is."""
    work.model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    if empty_cache:
        torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    scope = scope_factory()
    try:
        step(work, scope, marks)
        marks[2].synchronize()
    except RuntimeError as e:
        if not _is_oom(e):
            raise
        scope = None
    if scope is None:  # outside the except block: the traceback and its tensors are gone
        work.model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return None
    return (marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2]),
            torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_reserved() - base_reserved,
            dict(scope.stats) if isinstance(scope, ferry.offload_saved) else None)


def _offload_rows(plain_peak: int, saved: int, base: int) -> list:
    """(label, scope factory) of each row.
    A target is torch's allocated memory on the GPU (absolute): the step's start (``base``) plus
    the no-offload peak less a third or two of the saved activations."""
    rows = [
        ("no offload", contextlib.nullcontext),
        ("ferry.offload_saved()", ferry.offload_saved),
        ("torch save_on_cpu(pin_memory=True)", lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)),
    ]
    for thirds in (1, 2):
        above = max(0, int(plain_peak - saved * thirds / 3))
        target = base + above
        label = f"ferry max_device_bytes=start+{above / GIB:.2f} GiB (peak - {thirds}/3 saved)"
        # One scope for every step of the row, as a training loop would use it: it learns
        # from the warmup step what the step allocates after its saves.
        scope = ferry.offload_saved(max_device_bytes=target)
        rows.append((label, lambda scope=scope: scope))
    return rows


def _fit_pinned_budget(saved: int) -> int:
    """Raises ferry's pinned budget to hold the step's saved activations (size classes round up
    by under 1/8), up to half the RAM: torch's host cache holds save_on_cpu's copies beside it."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = max(ferry.pinned_budget(), min(saved * 5 // 4, ram // 2))
    ferry.set_pinned_budget(budget)
    return budget


def measure_offload(work: Workload, link: dict, samples: int, warmup: int) -> dict:
    """Table 1's figures for ``work``, with every sample."""
    saved, storages = saved_activations(work)
    budget = _fit_pinned_budget(saved)
    first = _measured_step(work, contextlib.nullcontext)  # warms up; the targets start from it
    if first is None:
        raise torch.OutOfMemoryError("a step without offload does not fit")
    work.model.zero_grad(set_to_none=True)
    rows = _offload_rows(first[2], saved, torch.cuda.memory_allocated())
    runs = {label: {"ms": [], "forward_ms": [], "backward_ms": [], "peak_bytes": [],
                    "peak_reserved_bytes": [], "status": "ok"}
            for label, make in rows}
    for i in range(warmup + samples):
        for label, make in rows:
            run = runs[label]
            if run["status"] != "ok":
                continue
            out = _measured_step(work, make)
            if out is None:
                run["status"] = "OOM"
                continue
            forward, backward, peak, reserved, stats = out
            if stats is not None:
                run["stats"] = stats
            if i >= warmup:
                for key, value in zip(("forward_ms", "backward_ms", "ms", "peak_bytes",
                                       "peak_reserved_bytes"),
                                      (forward, backward, forward + backward, peak, reserved)):
                    run[key].append(value)
    plain = runs["no offload"]
    forward, backward = _median(plain["forward_ms"]), _median(plain["backward_ms"])
    out = {"what": work.what, "batch": work.batch, "parameters": work.parameters,
           "saved_bytes": saved, "saved_storages": storages, "pinned_budget": budget,
           "forward_ms": forward, "backward_ms": backward, "rows": runs}
    ferry_run = runs["ferry.offload_saved()"]
    if ferry_run["status"] == "ok":
        moved = ferry_run["stats"]["offloaded_bytes"]
        out["offloaded_bytes"] = moved
        out["kept_over_budget"] = ferry_run["stats"]["kept_over_budget"]
        out["bound_ms"] = (max(forward, moved / link["d2h"] * 1e3)
                           + max(backward, moved / link["h2d"] * 1e3))
    return out


def compare_gradients(work: Workload) -> dict:
    """Max abs and relative norm differences: ferry's offload against no offload, and no offload
    against itself (fused attention kernels are not bitwise deterministic)."""
    plain = gradients(work)
    again = gradients(work)
    out = {"plain_vs_plain": gradient_difference(plain, again)}
    del again
    out["ferry_vs_plain"] = gradient_difference(plain, gradients(work, ferry.offload_saved))
    return out


CPU_SAMPLES = 3  # samples of the slow .cpu() reference in the state-dict rows


def measure_state_dicts(work: Workload, link: dict, samples: int, warmup: int) -> list:
    """Table 2's rows for ``work``, one per dtype; the model is cast to each in turn."""
    rows = []
    for dtype in work.state_dicts:
        work.model.to(getattr(torch, dtype))
        sd = work.model.state_dict()
        ways = {
            "ferry": lambda: ferry.move_state_dict(sd, "cpu"),
            "non_blocking": lambda: {k: v.to("cpu", non_blocking=True) for k, v in sd.items()},
            "cpu": lambda: {k: v.cpu() for k, v in sd.items()},
        }
        ms = {way: [] for way in ways}
        for i in range(warmup + samples):
            for way, fn in ways.items():
                # .cpu() is the slow reference (seconds for a large model): a few samples.
                if way == "cpu" and i >= warmup + CPU_SAMPLES:
                    continue
                elapsed = bench_harness.synced_ms(torch, fn)
                if i >= warmup:
                    ms[way].append(elapsed)
        nbytes = sum(v.numel() * v.element_size() for v in sd.values())
        medians = {way: _median(xs) for way, xs in ms.items()}
        rows.append({"model": f"{work.name} {dtype}", "tensors": len(sd), "bytes": nbytes, "ms": ms,
                     "median_ms": medians,
                     "link_share": {w: nbytes / link["d2h"] / (m / 1e3) for w, m in medians.items()}})
        del sd
    return rows


def profile_offload_step(work: Workload, top: int = 25) -> None:
    """Prints what one ferry offload step of ``work`` is made of: torch.profiler's top entries by
    self CUDA time and by self CPU time, and the total of its copies each way."""
    from torch.profiler import ProfilerActivity, profile

    _fit_pinned_budget(saved_activations(work)[0])
    _measured_step(work, ferry.offload_saved)  # a first step's allocations are not the step's
    work.model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(work, ferry.offload_saved())
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(f"profile of one ferry.offload_saved() step of {work.name} ({work.what}; {work.batch})")
    for key in ("self_device_time_total", "self_cpu_time_total"):
        print(averages.table(sort_by=key, row_limit=top, max_name_column_width=50))
    for way in ("DtoH", "HtoD"):
        copies = [a for a in averages if a.key.startswith(f"Memcpy {way}")]
        total = sum(a.self_device_time_total for a in copies) / 1e3
        print(f"memcpy {way}: {total:.1f} ms of GPU time in {sum(a.count for a in copies)} copies")


def _offload_table(r: dict) -> list:
    if "rows" not in r:
        return [f"**{r['name']}**: {r['what']}: OOM before its rows ({r['oom']})", ""]
    gib = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    lines = [f"**{r['name']}**: {r['what']}; {r['parameters'] / 1e6:.1f} M parameters; {r['batch']}. "
             f"Saved activations {gib(r['saved_bytes'])} GiB in {r['saved_storages']} storages; no "
             f"offload: forward {r['forward_ms']:.1f} ms, backward {r['backward_ms']:.1f} ms."]
    if "bound_ms" in r:
        ferry_ms = _median(r["rows"]["ferry.offload_saved()"]["ms"])
        over = ferry_ms / r["bound_ms"]
        lines.append(f"ferry offloaded {gib(r['offloaded_bytes'])} GiB (kept over budget "
                     f"{r['kept_over_budget']}, pinned budget {gib(r['pinned_budget'])} GiB); link "
                     f"bound {r['bound_ms']:.0f} ms, ferry step {over:.2f}x it (goal <= "
                     f"{BOUND_GOAL}x): {'met' if over <= BOUND_GOAL else 'not met'}.")
    if "gradients" in r:
        (fa, fr), (pa, pr) = r["gradients"]["ferry_vs_plain"], r["gradients"]["plain_vs_plain"]
        lines.append(f"Gradients, max abs / relative norm difference: ferry vs no offload {fa:.3g} / "
                     f"{fr:.3g}; no offload vs no offload {pa:.3g} / {pr:.3g}.")
    if "oom" in r:
        lines.append(f"OOM after the rows below ({r['oom']}).")
    # The peak is the highest of the samples (what a user must provision); the last step's
    # beside it shows where a scope that learns across steps (a memory target) has got to.
    plain = r["rows"]["no offload"]
    plain_ms = _median(plain["ms"])
    plain_peak = max(plain["peak_bytes"], default=math.nan)
    cells = []
    for label, run in r["rows"].items():
        if run["status"] != "ok":
            cells.append([label, run["status"]] + [""] * 6)
            continue
        ms, peak = _median(run["ms"]), max(run["peak_bytes"])
        cells.append([label, f"{ms:.0f}", f"{ms / plain_ms:.2f}x",
                      f"{_median(run['forward_ms']):.0f}", f"{_median(run['backward_ms']):.0f}", gib(peak), gib(run["peak_bytes"][-1]),
                      f"{(plain_peak - peak) / r['saved_bytes']:.0%}"])
    header = ["scope", "ms/step", "vs no offload", "forward ms", "backward ms", "peak GiB",
              "last step's peak GiB", "peak lowered by (of saved)"]
    return lines + [""] + bench_harness.table(header, cells) + [""]


def _state_dict_table(rows: list) -> list:
    cells = []
    for r in rows:
        m, s = r["median_ms"], r["link_share"]
        met = s["ferry"] >= LINK_SHARE_GOAL and m["ferry"] <= m["non_blocking"]
        pairs = sorted(f / n for f, n in zip(r["ms"]["ferry"], r["ms"]["non_blocking"]))
        p10, p90 = pairs[len(pairs) // 10], pairs[min(len(pairs) - 1, 9 * len(pairs) // 10)]
        cells.append([r["model"], str(r["tensors"]), f"{r['bytes'] / (1 << 20):.0f}",
                      f"{m['ferry']:.2f}", f"{m['non_blocking']:.2f}", f"{m['cpu']:.0f}",
                      f"{m['ferry'] / m['non_blocking']:.3f} ({p10:.3f}-{p90:.3f})",
                      f"{s['ferry']:.0%} / {s['non_blocking']:.0%} / {s['cpu']:.0%}",
                      "met" if met else "not met"])
    return bench_harness.table(
        ["state dict", "tensors", "MiB", "ferry ms", "non_blocking ms", ".cpu() ms",
         "ferry / non_blocking (sample pairs p10-p90)", "link share ferry / non_blocking / .cpu()",
         "goal"], cells)


def _free_memory() -> None:
    """Gives back what the last model's steps cached, on the GPU and in both pinned pools."""
    torch.cuda.empty_cache()
    ferry.empty_cache("cpu")
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


def _build_on_gpu(name: str) -> Workload | None:
    """The workload on the GPU, or None (and why) when its library is missing."""
    try:
        work = build(name, "cuda")
    except ImportError as e:
        print(f"{name}: skipped, {e}")
        return None
    print(f"{name}: {work.what}; {work.parameters / 1e6:.1f} M parameters; {work.batch}", flush=True)
    return work


def run(args) -> int:
    """The models benchmark for bench.py's parsed arguments (``models``, ``profile``,
    ``samples``, ``warmup``, ``json``); the caller has checked that a GPU is there."""
    names = args.models.split(",") if args.models else []
    unknown = [n for n in names + [args.profile] if n and n not in _BUILDERS]
    if unknown:
        print(f"unknown model {', '.join(unknown)}: choose from {', '.join(MODELS)}")
        return 2
    only_state_dicts = getattr(args, "state_dicts_only", False)
    # State dicts take milliseconds: more samples for the same spread.
    samples = args.samples if args.samples is not None else 30 if only_state_dicts else SAMPLES
    warmup = args.warmup if args.warmup is not None else 5 if only_state_dicts else WARMUP
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    record = {"date": date, "torch": torch.__version__, "ferry": ferry.__version__,
              "device": torch.cuda.get_device_name(0), "samples": samples, "warmup": warmup,
              "models": {}, "state_dicts": []}
    link = record["link"] = link_bandwidth() if names else None
    for name in names:
        started, work = time.perf_counter(), _build_on_gpu(name)
        if work is None:
            continue
        try:
            if not only_state_dicts:
                result = record["models"][work.name] = {"name": work.name, **measure_offload(
                    work, link, samples, warmup)}
                result["gradients"] = compare_gradients(work)
            record["state_dicts"] += measure_state_dicts(work, link, samples, warmup)
        except RuntimeError as e:
            if not _is_oom(e):
                raise
            oom = record["models"].setdefault(name, {"name": name, "what": work.what})
            oom["oom"] = str(e).splitlines()[0]
            print(f"{name}: OOM ({oom['oom']})")
        print(f"{work.name}: measured in {time.perf_counter() - started:.0f} s", flush=True)
        del work
        _free_memory()
    work = _build_on_gpu(args.profile) if args.profile else None
    if work is not None:
        profile_offload_step(work)
    head = (f"{date}, torch {record['torch']}, ferry {record['ferry']}, {record['device']}, "
            f"medians of {samples} after {warmup} warmup")
    if record["models"]:
        print(f"\n## Activation offload, {head}; link D2H {link['d2h'] / 1e9:.1f} GB/s, "
              f"H2D {link['h2d'] / 1e9:.1f} GB/s (1 GiB, pinned)\n")
        for r in record["models"].values():
            print("\n".join(_offload_table(r)))
    if record["state_dicts"]:
        print(f"## State dict to the host, {head}\n")
        print("\n".join(_state_dict_table(record["state_dicts"])))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)
    return 0
