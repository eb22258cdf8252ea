"""python -m ferry.bench --memory: its pure parts on the CPU (the curve read from a result, the
goals judged on synthetic points, the targets, the PNG where matplotlib is importable), its rows
on a tiny model with CUDA's timers stubbed and the peak counted as the bytes autograd saves
outside a checkpoint, and the whole command on tiny configs on a GPU."""

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ferry  # noqa: E402
from ferry import bench, bench_memory, bench_models  # noqa: E402
from ferry.bench_memory import CHECKPOINT, GIB, OFFLOAD, PLAIN, SAVE_ON_CPU, Point  # noqa: E402


class Block(nn.Module):
    calls = 0

    def __init__(self, d):
        super().__init__()
        self.fc, self.out, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, x):
        Block.calls += 1
        return x + self.drop(self.out(torch.tanh(self.fc(x))))


class Tiny(nn.Module):
    def __init__(self, d=32, layers=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _tiny_work(name="tiny"):
    torch.manual_seed(0)
    model = Tiny().train()
    x, y = torch.randn(1024, 32), torch.randint(0, 8, (1024,))
    return bench_models.Workload(name, "4 residual MLP blocks, 32 wide", "batch 1024, fp32", model,
                                 (x, y), bench_models._image_loss, None)


class _TimedEvent:
    def __init__(self, enable_timing=False):
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


@pytest.fixture
def cpu_bench(monkeypatch, host_offload):
    """The bench's CUDA calls made harmless on the CPU; a step's peak is the bytes of the
    storages that autograd saves under no other hooks (what a checkpoint leaves saved)."""
    monkeypatch.setattr(torch.cuda, "Event", _TimedEvent)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *device: None)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                 "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda *device: 0)
    budget = [1 << 30]
    monkeypatch.setattr(ferry, "pinned_budget", lambda: budget[0])
    monkeypatch.setattr(ferry, "set_pinned_budget", lambda b: budget.__setitem__(0, b))
    monkeypatch.setattr(ferry, "empty_cache", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "a stub")
    monkeypatch.setattr(bench_models, "link_bandwidth", lambda: {"d2h": 5e10, "h2d": 5e10})
    measured = bench_models._measured_step
    emptied = []  # per step, whether the allocator's cache was emptied before it

    def counted(work, scope_factory, empty_cache=True):
        emptied.append(empty_cache)
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = measured(work, scope_factory, empty_cache)
        return None if out is None else (out[0], out[1], sum(saved.values()), 0, out[4])

    monkeypatch.setattr(bench_models, "_measured_step", counted)
    return emptied


def test_checkpointed_blocks_run_twice_and_give_the_same_gradients():
    work = _tiny_work()
    plain = bench_models.gradients(work)
    blocks = list(work.model.blocks)
    Block.calls = 0
    with bench_memory.checkpoint_blocks(blocks):
        wrapped = bench_models.gradients(work)
    assert Block.calls == 8  # forward, and again in backward
    assert bench_models.gradient_difference(plain, wrapped) == (0.0, 0.0)  # dropout included
    assert all("forward" not in b.__dict__ for b in blocks)


def test_the_rows_of_a_tiny_model(cpu_bench):
    work = _tiny_work()
    result = bench_memory.measure(work, samples=2, warmup=1)
    rows = result["rows"]
    # Each row's steps in a row: the cache emptied before its warmup step, never before a
    # timed one (the steps before those are the profile's and the targets').
    timed = cpu_bench[-3 * len(rows):]
    assert timed == [True, False, False] * len(rows)
    assert list(rows)[:4] == [PLAIN, CHECKPOINT, SAVE_ON_CPU, OFFLOAD]
    plans = [label for label in rows if rows[label]["kind"] == "plan"]
    assert len(plans) == bench_memory.TARGETS + 1 and "(saved / 2)" in plans[-1]
    assert all(r["status"] == "ok" and len(r["ms"]) == 2 for r in rows.values())
    peak = {label: max(r["peak_bytes"]) for label, r in rows.items()}
    assert peak[CHECKPOINT] < peak[PLAIN]
    # Targets fall from 90% of the plain peak to the checkpointed one; plans recompute more.
    targets = [rows[label]["target_bytes"] for label in plans[:bench_memory.TARGETS]]
    assert targets[0] == pytest.approx(0.9 * peak[PLAIN]) and targets[-1] == peak[CHECKPOINT]
    recomputed = [rows[label]["choices"].count("R") for label in plans[:bench_memory.TARGETS]]
    assert recomputed == sorted(recomputed) and recomputed[-1] > recomputed[0]
    assert all(len(rows[label]["choices"]) == 4 and "explain" in rows[label] for label in plans)
    assert peak[plans[bench_memory.TARGETS - 1]] < peak[PLAIN]
    result["goals"] = bench_memory.judge(bench_memory.curve(result), result["saved_bytes"])
    assert {g["verdict"] for g in result["goals"]} <= {"met", "not met", "n/a", "info"}
    lines = bench_memory.table("tiny", result)
    assert any(line.startswith("| no plan | ") for line in lines)
    assert any(line.startswith("| plan 1: target ") for line in lines)
    assert any(line.startswith("- at full checkpointing's peak") for line in lines)
    # The offload row's counts, per sample; none held back by the pinned budget, none said.
    stats = rows[OFFLOAD]["offload_stats"]
    assert len(stats) == 2 and not any(s["kept_over_budget"] for s in stats)
    assert not any("pinned budget" in line for line in lines)


def test_an_offload_held_back_by_the_pinned_budget_is_said(cpu_bench, monkeypatch):
    from ferry import offload

    class EveryTensor(offload.offload_saved):  # the tiny model's tensors are all < 1 MiB
        def __init__(self) -> None:
            super().__init__(min_bytes=0)

    monkeypatch.setattr(ferry, "offload_saved", EveryTensor)
    # ferry's pinned pool refuses every block, as when its budget is full.
    monkeypatch.setattr(offload._ferry, "empty_pinned", lambda shape, dtype, ordered: None)
    result = bench_memory.measure(bench_memory.build("mlp", "cpu", tiny=True), 1, 0)
    stats = result["rows"][OFFLOAD]["offload_stats"]
    assert stats and all(s["offloaded"] == 0 < s["kept_over_budget"] for s in stats)
    said = [line for line in bench_memory.table("mlp", result) if "pinned budget" in line]
    assert len(said) == 1 and said[0].startswith(f"- {OFFLOAD}: tensors left on the GPU"), said


def test_the_memory_bench_runs_end_to_end_on_the_cpu(cpu_bench, monkeypatch, tmp_path, capsys):
    def tiny(name, device, tiny=False):
        work = _tiny_work(name)
        if name == "vit":  # a model whose first step does not fit
            work.loss_of = lambda *_: (_ for _ in ()).throw(torch.OutOfMemoryError("out of memory"))
        return work

    monkeypatch.setattr(bench_memory, "build", tiny)
    out_json = tmp_path / "memory.json"
    args = bench.argparse.Namespace(memory="nanogpt,vit", samples=1, warmup=0,
                                    json=str(out_json), png=str(tmp_path / "img"))
    assert bench_memory.run(args) == 0
    out = capsys.readouterr().out
    tables = out[out.index("## Memory plans"):]
    assert "**nanogpt**: 4 residual MLP blocks" in tables and "| no plan | " in tables
    assert "**vit**" in tables and "OOM" in tables
    record = bench.json.loads(out_json.read_text())
    assert set(record["models"]) == {"nanogpt", "vit"} and record["device"] == "a stub"
    assert record["models"]["nanogpt"]["goals"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "curves not drawn: matplotlib is not importable" in out
    else:
        assert Path(record["models"]["nanogpt"]["png"]).is_file()


def test_targets_fall_from_ninety_percent_to_the_low_peak_then_halve_the_saved():
    assert bench_memory.targets(100.0, 40.0, 60) == pytest.approx([90, 77.5, 65, 52.5, 40, 70])


def test_the_curve_leaves_out_rows_without_samples():
    result = {"rows": {
        PLAIN: {"kind": "plain", "status": "ok", "ms": [3.0, 1.0, 2.0], "peak_bytes": [5, 7, 6]},
        SAVE_ON_CPU: {"kind": "rival", "status": "OOM", "ms": [], "peak_bytes": []},
        "plan 1: target 1.00 GiB": {"kind": "plan", "status": "ok", "ms": [4.0],
                                    "peak_bytes": [3], "target_bytes": 4, "reachable": False,
                                    "least_bytes": 3, "choices": "KR",
                                    "predicted_peak_bytes": 3, "predicted_extra_ms": 1.5},
        OFFLOAD: {"kind": "rival", "status": "ok", "ms": [], "peak_bytes": []}}}
    points = bench_memory.curve(result)
    assert [p.label for p in points] == [PLAIN, "plan 1: target 1.00 GiB"]
    assert (points[0].ms, points[0].peak) == (2.0, 7)
    assert points[1] == Point("plan 1: target 1.00 GiB", "plan", 4.0, 3, 4, False, 3, "KR", 3, 1.5)


def _points(at_checkpoint_ms=104.0, save_on_cpu_peak=5 * GIB, unreachable_ms=104.5):
    return [
        Point(PLAIN, "plain", 100.0, 10 * GIB),
        Point(CHECKPOINT, "rival", 117.0, 4 * GIB),
        Point(SAVE_ON_CPU, "rival", 300.0, save_on_cpu_peak),
        Point(OFFLOAD, "rival", 160.0, 6 * GIB),
        Point("plan 1", "plan", 100.5, 9 * GIB, 9 * GIB, choices="KKKR"),
        Point("plan 2", "plan", 102.0, 5 * GIB, 5 * GIB, choices="KRRR"),
        Point("plan 3", "plan", at_checkpoint_ms, 4 * GIB, 4 * GIB, choices="ORRR"),
        Point("plan 4", "plan", unreachable_ms, 4 * GIB, 3 * GIB, False, 4 * GIB, "RRRR"),
        # The same plan as plan 4 for a lower target: not a rival of plan 4.
        Point("plan 5", "plan", unreachable_ms - 3, 4 * GIB, 2 * GIB, False, 4 * GIB, "RRRR"),
    ]


def test_goals_met_on_a_curve_that_beats_every_rival():
    goals = {g["goal"]: g for g in bench_memory.judge(_points(), saved_bytes=10 * GIB)}
    verdicts = {goal: g["verdict"] for goal, g in goals.items()}
    assert verdicts == {
        "at full checkpointing's peak: step <= 1.05x": "met",
        "saved activations halved: step <= 1.03x": "met",
        f"dominates {CHECKPOINT}": "met",
        f"dominates {SAVE_ON_CPU}": "met",
        f"dominates {OFFLOAD}": "info",
        f"{OFFLOAD} lowers the peak": "met",
        "unreachable target 3.00 GiB": "met",
        "unreachable target 2.00 GiB": "met",
    }
    assert "plan 5: 101.5 ms = 1.015x" in goals["at full checkpointing's peak: step <= 1.05x"][
        "detail"]
    assert "least the plan reaches: 4.00 GiB predicted" in goals["unreachable target 3.00 GiB"][
        "detail"]


def test_goals_not_met_name_what_missed():
    points = _points(at_checkpoint_ms=110.0, save_on_cpu_peak=2 * GIB, unreachable_ms=120.0)
    goals = {g["goal"]: g for g in bench_memory.judge(points, saved_bytes=10 * GIB)}
    assert goals["at full checkpointing's peak: step <= 1.05x"]["verdict"] == "not met"
    rival = goals[f"dominates {SAVE_ON_CPU}"]
    assert rival["verdict"] == "not met" and "no plan point at that peak" in rival["detail"]
    unreachable = goals["unreachable target 3.00 GiB"]
    assert unreachable["verdict"] == "not met" and "110.0 ms" in unreachable["detail"]
    # Without a plan point at the halved peak the goal is missed, naming the least peak.
    high = [p for p in points if p.kind != "plan" or p.peak > 5 * GIB]
    halved = next(g for g in bench_memory.judge(high, saved_bytes=10 * GIB)
                  if g["goal"].startswith("saved activations halved"))
    assert halved["verdict"] == "not met" and "least measured is 9.00 GiB" in halved["detail"]
    # Without plan points the plan's goals are n/a; the offload scope's is judged still.
    no_plans = {g["goal"]: g["verdict"] for g in bench_memory.judge(high[:4], 10 * GIB)}
    assert no_plans == {f"{OFFLOAD} lowers the peak": "met", "the plan's goals": "n/a"}
    # The scope's peak as high as without it (within the 1% that counts as equal): missed.
    flat = [p if p.label != OFFLOAD else Point(OFFLOAD, "rival", 160.0, 9.95 * GIB)
            for p in points]
    lowered = next(g for g in bench_memory.judge(flat, saved_bytes=10 * GIB)
                   if g["goal"] == f"{OFFLOAD} lowers the peak")
    assert lowered["verdict"] == "not met" and "without it" in lowered["detail"], lowered


def test_the_curve_is_drawn_as_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = bench_memory.draw("tiny", "a tiny model", _points(), tmp_path / "img")
    assert path == tmp_path / "img" / "memory-tiny.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not (torch.cuda.is_available() and ferry.cuda_available()),
                    reason="needs a CUDA device")
def test_the_memory_bench_on_tiny_configs_on_a_gpu(monkeypatch, tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("timm")
    build = bench_memory.build
    monkeypatch.setattr(bench_memory, "build", lambda name, device: build(name, device, tiny=True))
    out_json = tmp_path / "memory.json"
    assert bench.main(["--memory", "--samples", "2", "--warmup", "1", "--json", str(out_json),
                       "--png", str(tmp_path / "img")]) == 0
    out = capsys.readouterr().out
    record = bench.json.loads(out_json.read_text())
    assert list(record["models"]) == list(bench_memory.MODELS)
    for name, result in record["models"].items():
        rows = result["rows"]
        assert all(r["status"] == "ok" for r in rows.values()), name
        # The small MLP's blocks save nothing but their boundaries: no plan rows, said why.
        unplanned = (bench_memory.PLAIN, *bench_memory.RIVALS, bench_memory.OFFLOAD,
                     bench_memory.SELECTIVE)
        planned = 0 if name == "mlp" else bench_memory.TARGETS + 1
        assert list(rows)[:len(unplanned)] == list(unplanned), name
        assert len(rows) == len(unplanned) + planned, (name, result.get("plan_refused"))
        assert (result.get("plan_refused") is not None) == (name == "mlp"), name
        assert all(p > 0 for r in rows.values() for p in r["peak_bytes"]), name
        assert result["goals"] and f"**{name}**" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "curves not drawn" in out
    else:
        assert sorted(p.name for p in (tmp_path / "img").iterdir()) == sorted(
            f"memory-{n}.png" for n in bench_memory.MODELS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the benchmark")
def test_without_cuda_the_memory_bench_says_so(capsys):
    assert bench.main(["--memory", "nanogpt"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_a_model_the_planner_refuses_is_measured_against_its_rivals(cpu_bench):
    # The small MLP's blocks save only their inputs and outputs, which the planner keeps
    # whatever it chooses: it has nothing to plan, says so, and the other rows still run.
    result = bench_memory.measure(bench_memory.build("mlp", "cpu", tiny=True), 1, 0)
    assert "save no tensors" in result["plan_refused"]
    assert [run["kind"] for run in result["rows"].values()] == ["plain"] + ["rival"] * 4
    goals = {g["goal"]: g["verdict"] for g in bench_memory.judge(bench_memory.curve(result),
                                                                  result["saved_bytes"])}
    assert goals["the plan's goals"] == "n/a" and f"{OFFLOAD} lowers the peak" in goals
    assert "no plan rows: " in "\n".join(bench_memory.table("mlp", result))


def test_the_small_mlp_is_four_regions_with_a_loss():
    from ferry.plan import find_regions

    work = bench_memory.build("mlp", "cpu", tiny=True)
    assert len(find_regions(work.model)) == 4
    loss = work.loss()
    loss.backward()
    assert loss.dim() == 0 and all(p.grad is not None for p in work.model.parameters())
