"""``python -m ferry.bench --memory [nanogpt,gpt2-b8,llama,vit,mlp]``: issue 41's curves, peak
activation memory against step time, per model in one process, each row's steps in a row on a warm allocator: a step as
is; ``torch.utils.checkpoint`` on every block (``use_reentrant=False``, wrapped as a user would);
``torch.autograd.graph.save_on_cpu(pin_memory=True)``; ``ferry.offload_saved()``; and
``ferry.plan.MemoryPlan`` (profiled once, then ``retarget``) at five targets from 90% of the
plain peak down to full checkpointing's measured peak, and one at the plain peak less half the
saved activations. Prints a table and the goals' verdicts per model, draws each curve as a PNG
(``--png DIR``), and writes everything to ``--json FILE``.

The models are ``bench_models``' (random weights, nothing downloaded), nanoGPT's GPT-2 small
(batch 12 x 1024, fp32, dropout 0): nanoGPT's own ``model.py`` where it is importable as
``model`` (``PYTHONPATH=path/to/nanoGPT``), else the same shape from transformers' GPT-2, and a
small MLP (4 x (Linear(2048) + Tanh), batch 4096: 256 MiB saved).

A peak is ``torch.cuda.max_memory_allocated`` over one step above what was allocated at its
start (the model, its batch: ``bench_models._measured_step``); a row's peak is the highest of its
samples, its time the median. A plan's target is in the planner's currency (activation bytes at
the peak): a measured target less what the plain step's measured peak holds beside the planner's
figure for it.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence

import torch
from torch.utils.checkpoint import checkpoint

import ferry

from . import bench_harness, bench_models
from ._plan_selective import KEPT_OPS
from ._plan_torch import _bytes
from .plan import MemoryPlan, TargetUnreachable, find_regions

GIB = 1 << 30
MODELS = ("nanogpt", "gpt2-b8", "llama", "vit", "mlp")
TARGETS = 5  # plan targets from 90% of the plain peak down to full checkpointing's
TOP_TARGET = 0.9
AT_CHECKPOINT_GOAL, AT_HALF_GOAL = 1.05, 1.03  # step / no plan's step
# Peaks within this share of the plain peak, and steps within this share of each other, count
# as equal when points are compared (run-to-run noise).
TOLERANCE = 0.01
PLAIN = "no plan"
CHECKPOINT = "torch checkpoint, every block"
SAVE_ON_CPU = "torch save_on_cpu(pin_memory=True)"
OFFLOAD = "ferry.offload_saved()"
SELECTIVE = "torch selective checkpoint, every block"
# One letter per block in the tables: keep, offload, recompute, selective recompute, and
# selective recompute with its kept outputs offloaded.
LETTERS = {"keep": "K", "offload": "O", "recompute": "R", "selective": "S",
           "selective_offload": "X"}
RIVALS = (CHECKPOINT, SAVE_ON_CPU)  # issue 41's: every plan curve must dominate them


# -- the workloads -----------------------------------------------------------------------------


def _nanogpt_module() -> Any:
    """nanoGPT's model.py (``GPT``, ``GPTConfig``) if importable as ``model``, else None."""
    try:
        module = importlib.import_module("model")
    except Exception:  # whatever "model" is here, it is not nanoGPT's
        return None
    return module if hasattr(module, "GPT") and hasattr(module, "GPTConfig") else None


def _nanogpt(name: str, batch: int, device: Any, tiny: bool) -> bench_models.Workload:
    layers, heads, width, vocab, seq = (2, 4, 64, 512, 16) if tiny else (12, 12, 768, 50304, 1024)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
    nano = _nanogpt_module()
    if nano is not None:
        config = nano.GPTConfig(n_layer=layers, n_head=heads, n_embd=width, vocab_size=vocab,
                                block_size=max(seq, 64), dropout=0.0, bias=True)
        with torch.device(device):
            model = nano.GPT(config)
        origin = f"nanoGPT's GPT ({nano.__file__})"
        inputs: tuple = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
        loss_of: Callable[..., Any] = lambda m, x, y: m(x, y)[1]  # noqa: E731
    else:
        transformers = importlib.import_module("transformers")
        config = transformers.GPT2Config(
            n_layer=layers, n_head=heads, n_embd=width, vocab_size=vocab, n_positions=seq,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
        with torch.device(device):
            model = transformers.GPT2LMHeadModel(config)
        origin = "nanoGPT's shape from transformers' GPT-2 (no nanoGPT importable as `model`)"
        inputs, loss_of = (ids[:, :-1].contiguous(),), bench_models._lm_loss
    what = f"{origin}, {layers} layers, {width} wide, {heads} heads, vocab {vocab}, dropout 0"
    return bench_models.Workload(name, what, f"batch {batch} x {seq} tokens, fp32", model,
                                 inputs, loss_of, None)


def _mlp(name: str, device: Any, tiny: bool) -> bench_models.Workload:
    """The small model the offload scope's default window failed: 4 x (Linear(2048) + Tanh) at
    batch 4096, fp32: 256 MiB of saved activations, each block a region."""
    width, batch = (64, 32) if tiny else (2048, 4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
              for _ in range(4)])
        x = torch.randn(batch, width)
    return bench_models.Workload(
        name, f"4 x (Linear({width}) + Tanh)", f"batch {batch}, fp32", model, (x,),
        lambda m, x: m(x).square().mean(), None)


def build(name: str, device: Any, tiny: bool = False) -> bench_models.Workload:
    """The workload ``name`` (``MODELS``) with random weights in training mode, caches off (a
    recomputed block must not append to a key/value cache); ``tiny`` as in bench_models."""
    if name == "nanogpt":
        torch.manual_seed(0)
        work = _nanogpt(name, 2 if tiny else 12, device, tiny)
        work.model.train()
    elif name == "mlp":
        work = _mlp(name, device, tiny)
    else:
        work = bench_models.build(name, device, tiny)
    config = getattr(work.model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    return work


# -- the rows ----------------------------------------------------------------------------------


@contextlib.contextmanager
def checkpoint_blocks(blocks: Sequence[torch.nn.Module], **options: Any) -> Any:
    """``torch.utils.checkpoint`` around each block's forward while inside, as a user wraps
    them (``use_reentrant=False``, the RNG state preserved by default; ``options`` go to
    ``checkpoint`` too)."""
    owned = [(b, b.__dict__.get("forward")) for b in blocks]
    for b in blocks:
        setattr(b, "forward", functools.partial(checkpoint, b.forward, use_reentrant=False,
                                                **options))
    try:
        yield
    finally:
        for b, own in owned:
            if own is None:
                b.__dict__.pop("forward", None)
            else:
                setattr(b, "forward", own)


def selective_checkpoint_blocks(blocks: Sequence[torch.nn.Module]) -> Any:
    """torch's own selective activation checkpointing in eager mode around each block, as a
    user writes it: ``create_selective_checkpoint_contexts`` with a policy that saves the
    matrix products' and attention's outputs (the ops a ferry selective recompute keeps) and
    recomputes the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return (CheckpointPolicy.MUST_SAVE if op.overloadpacket in KEPT_OPS
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return checkpoint_blocks(
        blocks, context_fn=lambda: create_selective_checkpoint_contexts(policy))


@dataclass
class Row:
    """One way to run the step: ``around`` (or ``plan``) spans the whole step, ``scope`` only
    its forward (saved-tensor hooks)."""

    label: str
    kind: str  # "plain", "rival" or "plan"
    around: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    scope: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    plan: Optional[MemoryPlan] = None
    record: Dict[str, Any] = field(default_factory=dict)


def _rival_rows(blocks: Sequence[torch.nn.Module]) -> List[Row]:
    return [Row(PLAIN, "plain"),
            Row(CHECKPOINT, "rival", around=lambda: checkpoint_blocks(blocks)),
            Row(SAVE_ON_CPU, "rival",
                scope=lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)),
            Row(OFFLOAD, "rival", scope=lambda: ferry.offload_saved()),
            Row(SELECTIVE, "rival", around=lambda: selective_checkpoint_blocks(blocks))]


def _run(work: bench_models.Workload, row: Row, empty_cache: bool = True) -> Any:
    """``bench_models._measured_step`` under the row: (forward ms, backward ms, peak, reserved
    peak, stats), or None on OOM."""
    with row.plan if row.plan is not None else row.around():
        return bench_models._measured_step(work, row.scope, empty_cache)


def targets(plain_peak: float, low_peak: float, saved: int) -> List[float]:
    """Measured peaks to plan for: ``TARGETS`` from ``TOP_TARGET`` of the plain peak down to
    ``low_peak``, then the plain peak less half the saved activations."""
    top = TOP_TARGET * plain_peak
    steps = [top + (low_peak - top) * k / (TARGETS - 1) for k in range(TARGETS)]
    return steps + [plain_peak - saved / 2]


def _plan_rows(profiled: MemoryPlan, measured_targets: Sequence[float],
               beside: float) -> List[Row]:
    """A retargeted plan per measured target; ``beside``: the plain peak's bytes beyond the
    planner's activation bytes, taken off each target."""
    rows = []
    for k, target in enumerate(measured_targets, start=1):
        planned = int(min(max(1.0, target - beside), profiled.cost.plain_bytes))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TargetUnreachable)  # reachable= says it
            plan = profiled.retarget(target_bytes=planned)
        half = " (saved / 2)" if k > TARGETS else ""
        row = Row(f"plan {k}{half}: target {_bytes(target)}", "plan", plan=plan)
        row.record = {"target_bytes": target, "plan_target_bytes": planned,
                      "choices": "".join(LETTERS[c] for c in plan.choices),
                      "reachable": plan.reachable, "least_bytes": plan.least_bytes + beside,
                      "predicted_peak_bytes": plan.predicted_peak_bytes + beside,
                      "predicted_extra_ms": plan.predicted_extra_ms}
        rows.append(row)
    return rows


def measure(work: bench_models.Workload, samples: int, warmup: int) -> Dict[str, Any]:
    """Every row's samples for ``work``, the plan's profile and the targets."""
    saved, storages = bench_models.saved_activations(work)
    budget = bench_models._fit_pinned_budget(saved)
    blocks = find_regions(work.model)
    rows = _rival_rows(blocks)
    first: Dict[str, Any] = {}
    for row in rows[:2]:  # the plain and checkpointed peaks the targets come from
        for _ in range(max(1, warmup) + 1):
            first[row.label] = _run(work, row)
    if first[PLAIN] is None:
        raise torch.OutOfMemoryError("out of memory: a step without a plan does not fit")
    work.model.zero_grad(set_to_none=True)
    refused, profiled, beside = None, None, None
    try:
        profiled = MemoryPlan.profile(work.model, lambda: bench_models.step(work),
                                      fraction=1.0, regions=blocks)
    except ValueError as e:
        # The planner keeps each region's input whatever it chooses: a model whose blocks save
        # nothing else has nothing to plan. Its rivals are measured still.
        refused = str(e)
    work.model.zero_grad(set_to_none=True)
    if profiled is not None:
        plain_peak = first[PLAIN][2]
        beside = plain_peak - profiled.cost.plain_bytes
        checkpointed = first[CHECKPOINT]
        low = checkpointed[2] if checkpointed is not None else profiled.least_bytes + beside
        rows += _plan_rows(profiled, targets(plain_peak, low, saved), beside)
    runs = {row.label: {"kind": row.kind, "status": "ok", "ms": [], "forward_ms": [],
                        "backward_ms": [], "peak_bytes": [], **row.record} for row in rows}
    # A row's steps one after another, as a training loop runs them: the allocator's cache is
    # emptied when the row starts (none inherits another's blocks), and its warmup steps fill
    # it, so that the timed steps run on a warm cache, as a user's do.
    warm = max(1, warmup)
    for row in rows:
        run = runs[row.label]
        for i in range(warm + samples):
            out = _run(work, row, empty_cache=i == 0)
            if out is None:
                run["status"] = "OOM"
                break
            if i >= warm:
                forward, backward, peak = out[0], out[1], out[2]
                for key, value in (("forward_ms", forward), ("backward_ms", backward),
                                   ("ms", forward + backward), ("peak_bytes", peak)):
                    run[key].append(value)
                if out[4] is not None:  # an offload scope's counts, per sample
                    run.setdefault("offload_stats", []).append(
                        {k: out[4][k] for k in ("offloaded", "offloaded_bytes", "kept",
                                                "kept_over_budget")})
    for row in rows:
        if row.plan is not None:
            runs[row.label]["explain"] = row.plan.explain()
    return {"what": work.what, "batch": work.batch, "parameters": work.parameters,
            "saved_bytes": saved, "saved_storages": storages, "pinned_budget": budget,
            "regions": len(blocks),
            "plain_activation_bytes": profiled.cost.plain_bytes if profiled else None,
            "profile_measured": bool(profiled and profiled.cost.measured),
            "beside_bytes": beside, "profile": profiled.explain() if profiled else None,
            "plan_refused": refused, "rows": runs}


# -- the curve and the goals (pure: they read a measure() result) -------------------------------


@dataclass(frozen=True)
class Point:
    """A row as measured: median step ms and highest peak; a plan's target and predictions."""

    label: str
    kind: str
    ms: float
    peak: float
    target: Optional[float] = None
    reachable: bool = True
    least: Optional[float] = None
    choices: str = ""
    predicted_peak: Optional[float] = None
    predicted_extra_ms: Optional[float] = None


def curve(result: Dict[str, Any]) -> List[Point]:
    """The measured points of a model's rows in their order; rows that ran out of memory or
    have no samples are left out."""
    points = []
    for label, run in result["rows"].items():
        if run["status"] != "ok" or not run["ms"]:
            continue
        points.append(Point(label, run["kind"], bench_harness.median(run["ms"]),
                            max(run["peak_bytes"]), run.get("target_bytes"),
                            run.get("reachable", True), run.get("least_bytes"),
                            run.get("choices", ""), run.get("predicted_peak_bytes"),
                            run.get("predicted_extra_ms")))
    return points


def _gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def judge(points: Sequence[Point], saved_bytes: float) -> List[Dict[str, str]]:
    """Issue 41's goals on one model's points: each ``{"goal", "verdict", "detail"}``, the
    verdict "met", "not met" or "n/a" (nothing to judge), or "info" (beyond the goals)."""
    by = {p.label: p for p in points}
    plain, plans = by.get(PLAIN), [p for p in points if p.kind == "plan"]
    if plain is None:
        return [{"goal": "all", "verdict": "n/a", "detail": "no step without a plan was measured"}]
    slack = TOLERANCE * plain.peak
    goals: List[Dict[str, str]] = []

    def add(goal: str, verdict: str, detail: str) -> None:
        goals.append({"goal": goal, "verdict": verdict, "detail": detail})

    offloaded = by.get(OFFLOAD)
    lowers = f"{OFFLOAD} lowers the peak"
    if offloaded is None:
        add(lowers, "n/a", "not measured (OOM)")
    else:
        # Beyond noise: a window that brings every saved tensor back at once lowers nothing.
        add(lowers, "met" if offloaded.peak < plain.peak - slack else "not met",
            f"{_bytes(offloaded.peak)} against {_bytes(plain.peak)} without it "
            f"({offloaded.peak / plain.peak:.2f})")
    if not plans:
        add("the plan's goals", "n/a", "no plan step was measured")
        return goals

    def fastest_at(peak: float) -> Optional[Point]:
        fits = [p for p in plans if p.peak <= peak + slack]
        return min(fits, key=lambda p: p.ms) if fits else None

    def step_at(goal: str, peak: float, limit: float) -> None:
        best = fastest_at(peak)
        if best is None:
            least = min(plans, key=lambda p: p.peak)
            add(goal, "not met", f"no plan point at or below {_bytes(peak)}; the least "
                f"measured is {_bytes(least.peak)} ({least.label})")
            return
        ratio = best.ms / plain.ms
        add(goal, "met" if ratio <= limit else "not met",
            f"{best.label}: {best.ms:.1f} ms = {ratio:.3f}x no plan (goal <= {limit}x) at "
            f"{_bytes(best.peak)} (<= {_bytes(peak)})")

    checkpointed = by.get(CHECKPOINT)
    goal = f"at full checkpointing's peak: step <= {AT_CHECKPOINT_GOAL}x"
    if checkpointed is None:
        add(goal, "n/a", "the checkpointed step was not measured (OOM)")
    else:
        step_at(goal, checkpointed.peak, AT_CHECKPOINT_GOAL)
    step_at(f"saved activations halved: step <= {AT_HALF_GOAL}x", plain.peak - saved_bytes / 2,
            AT_HALF_GOAL)
    for label in RIVALS + (OFFLOAD, SELECTIVE):
        rival = by.get(label)
        goal = f"dominates {label}"
        if rival is None:
            if label in RIVALS:
                add(goal, "n/a", "not measured (OOM)")
            continue
        better = [p for p in plans
                  if p.peak <= rival.peak + slack and p.ms <= rival.ms * (1 + TOLERANCE)]
        near = fastest_at(rival.peak)
        detail = (f"{label}: {rival.ms:.1f} ms at {_bytes(rival.peak)}; " + (
            f"{better[0].label}: {better[0].ms:.1f} ms at {_bytes(better[0].peak)}" if better
            else f"fastest plan at that peak: {near.label}, {near.ms:.1f} ms" if near
            else "no plan point at that peak"))
        add(goal, ("met" if better else "not met") if label in RIVALS else "info", detail)
    unreachable = [p for p in plans if not p.reachable]
    for p in unreachable:
        # Other plans as low, bar those with its choices (the same plan, another target).
        same = [q for q in plans if q.choices != p.choices and q.peak <= p.peak + slack]
        best = min(same, key=lambda q: q.ms) if same else None
        ok = best is None or p.ms <= best.ms * (1 + TOLERANCE)
        add(f"unreachable target {_bytes(p.target or 0)}", "met" if ok else "not met",
            f"least the plan reaches: {_bytes(p.least or 0)} predicted, {_bytes(p.peak)} "
            f"measured, at {p.ms:.1f} ms" + ("" if best is None else
                                             f"; fastest other plan at that peak {best.ms:.1f} ms"))
    if not unreachable:
        add("an unreachable target", "n/a", "every target was reachable")
    return goals


def table(name: str, result: Dict[str, Any]) -> List[str]:
    """A model's lines: what it is, its rows, the goals."""
    if "rows" not in result:
        return [f"**{name}**: {result.get('what', '')}: {result['note']}", ""]
    points = curve(result)
    plain = next((p for p in points if p.kind == "plain"), None)
    if result.get("plan_refused") is not None:
        planner = f"no plan rows: {result['plan_refused']}"
    elif result.get("profile_measured"):
        planner = (f"the profiled step's measured peak {_gib(result['plain_activation_bytes'])} "
                   f"GiB, this run's plain peak {result['beside_bytes'] / GIB:+.2f} GiB from it")
    else:
        planner = (f"the plain peak is the planner's {_gib(result['plain_activation_bytes'])} "
                   f"GiB of activations + {_gib(result['beside_bytes'])} GiB beside them")
    lines = [f"**{name}**: {result['what']}; {result['parameters'] / 1e6:.1f} M parameters; "
             f"{result['batch']}. Saved activations {_gib(result['saved_bytes'])} GiB; "
             f"{result['regions']} regions; {planner}.", ""]
    cells = []
    for label, run in result["rows"].items():
        p = next((q for q in points if q.label == label), None)
        if p is None:
            cells.append([label, run["status"]] + [""] * 7)
            continue
        meas = "" if plain is None or p.kind != "plan" else f"{p.ms - plain.ms:.1f}"
        choices = p.choices + ("" if p.reachable else " (unreachable)")
        cells.append([label, f"{p.ms:.1f}",
                      "" if plain is None else f"{p.ms / plain.ms:.3f}x", _gib(p.peak),
                      "" if plain is None or not plain.peak else f"{p.peak / plain.peak:.2f}",
                      choices, "" if p.predicted_peak is None else _gib(p.predicted_peak),
                      "" if p.predicted_extra_ms is None else f"{p.predicted_extra_ms:.1f}",
                      meas])
    lines += bench_harness.table(
        ["way", "step ms", "vs no plan", "peak GiB", "vs plain peak", "choices (K/O/R/S/X)",
         "pred. peak GiB", "pred. extra ms", "meas. extra ms"], cells)
    lines += [""] + [f"- {g['goal']}: **{g['verdict']}**: {g['detail']}"
                     for g in result.get("goals", [])]
    for label, run in result["rows"].items():
        over = [s["kept_over_budget"] for s in run.get("offload_stats", [])]
        if any(over):
            lines.append(f"- {label}: tensors left on the GPU because ferry's pinned budget "
                         f"({_gib(result['pinned_budget'])} GiB) was full, per sample: "
                         f"{', '.join(map(str, over))} (offloaded: "
                         f"{', '.join(str(s['offloaded']) for s in run['offload_stats'])})")
    return lines + [""]


def draw(name: str, title: str, points: Sequence[Point], directory: Path) -> Path:
    """The model's curve as ``directory/memory-<name>.png``: peak GiB against step ms, the
    plan's points joined from the highest peak down (hollow: an unreachable target), the other
    rows as markers. Raises
    ImportError without matplotlib."""
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plans = sorted((p for p in points if p.kind == "plan"), key=lambda p: (-p.peak, p.ms))
    if plans:
        ax.plot([p.ms for p in plans], [p.peak / GIB for p in plans], "-", color="tab:blue",
                label="ferry.plan (targets)")
        for p in plans:
            ax.plot(p.ms, p.peak / GIB, "o", color="tab:blue",
                    markerfacecolor="tab:blue" if p.reachable else "white")
    markers = {PLAIN: ("k", "*"), CHECKPOINT: ("tab:red", "s"), SAVE_ON_CPU: ("tab:green", "^"),
               OFFLOAD: ("tab:orange", "D"), SELECTIVE: ("tab:purple", "v")}
    for p in points:
        if p.kind != "plan":
            color, marker = markers.get(p.label, ("gray", "x"))
            ax.plot(p.ms, p.peak / GIB, marker, color=color, markersize=9, linestyle="",
                    label=p.label)
    ax.set_xlabel("step ms (median)")
    ax.set_ylabel("peak GiB above the model (highest sample)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"memory-{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _default_png_dir() -> Path:
    """docs/img of the repository when run from its root, else the current directory."""
    here = Path.cwd()
    return here / "docs" / "img" if (here / "crates" / "ferry-py").is_dir() else here


# -- the command -------------------------------------------------------------------------------


def run(args: Any) -> int:
    """The memory benchmark for bench.py's parsed arguments (``memory``, ``samples``,
    ``warmup``, ``json``, ``png``); the caller has checked that a GPU is there."""
    names = [n for n in args.memory.split(",") if n] if args.memory else list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(f"unknown model {', '.join(unknown)}: choose from {', '.join(MODELS)}")
        return 2
    samples = args.samples if args.samples is not None else bench_models.SAMPLES
    warmup = args.warmup if args.warmup is not None else bench_models.WARMUP
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    record: Dict[str, Any] = {
        "date": date, "torch": torch.__version__, "ferry": ferry.__version__,
        "device": torch.cuda.get_device_name(0), "samples": samples, "warmup": warmup,
        "link": bench_models.link_bandwidth(), "models": {}}
    for name in names:
        started = time.perf_counter()
        try:
            work = build(name, "cuda")
        except ImportError as e:
            print(f"{name}: skipped, {e}")
            record["models"][name] = {"note": f"skipped: {e}"}
            continue
        print(f"{name}: {work.what}; {work.parameters / 1e6:.1f} M parameters; {work.batch}",
              flush=True)
        try:
            result = measure(work, samples, warmup)
            result["goals"] = judge(curve(result), result["saved_bytes"])
        except RuntimeError as e:
            if not bench_models._is_oom(e):
                raise
            result = {"what": work.what, "note": f"OOM ({str(e).splitlines()[0]})"}
            print(f"{name}: {result['note']}")
        record["models"][name] = result
        print(f"{name}: measured in {time.perf_counter() - started:.0f} s\n", flush=True)
        # Each model's table and the JSON as soon as it is measured: a run stopped at a time
        # limit keeps what it measured.
        print("\n".join(table(name, result)), flush=True)
        if args.json:
            _write_json(args.json, record)
        del work
        bench_models._free_memory()
    link = record["link"]
    print(f"\n## Memory plans, {date}, torch {record['torch']}, ferry {record['ferry']}, "
          f"{record['device']}, medians of {samples} after {warmup} warmup, peaks the highest "
          f"sample; link D2H {link['d2h'] / 1e9:.1f} GB/s, H2D {link['h2d'] / 1e9:.1f} GB/s\n")
    for name, result in record["models"].items():
        print("\n".join(table(name, result)))
    directory = Path(args.png) if getattr(args, "png", None) else _default_png_dir()
    for name, result in record["models"].items():
        if "rows" not in result:
            continue
        try:
            path = draw(name, f"{name}: {result['what'][:70]}\n{result['batch']}",
                        curve(result), directory)
        except ImportError as e:
            print(f"curves not drawn: matplotlib is not importable ({e}); with --json FILE, "
                  "`ferry plot memory FILE` draws them")
            break
        result["png"] = str(path)
        print(f"{name}: curve drawn in {path}")
    if args.json:
        _write_json(args.json, record)
    return 0


def _write_json(path: str, record: Dict[str, Any]) -> None:
    with open(path, "w") as out:
        json.dump(record, out, indent=1)
