"""The bench harness and the models benchmark's tables, from figures made up here: they need
torch and ferry only, so they run in CI (the rest of the benchmark's tests need transformers and
timm)."""

import math
import statistics

import pytest

torch = pytest.importorskip("torch")

from ferry import bench_harness, bench_models  # noqa: E402


def test_the_harness_tables_medians_and_saved_activations():
    assert bench_harness.table(["a", "b"], [["1", ""]]) == ["| a | b |", "|---|---|", "| 1 | |"]
    assert bench_harness.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert math.isnan(bench_harness.median([], empty=math.nan))
    with pytest.raises(statistics.StatisticsError):
        bench_harness.median([])
    x = torch.ones(1000, requires_grad=True)
    # tanh saves its output (4000 bytes); x * 2 saves nothing (the factor is a Python scalar).
    assert bench_harness.saved_storages(torch, lambda: (x * 2).tanh().sum()) == (4000, 1)
    assert bench_harness.saved_storages(torch, lambda: x.tanh().sum(), lambda t: False) == (0, 0)


def test_timed_steps_synchronize_after_each_and_reset_the_peak_after_the_warmup(monkeypatch):
    calls = []
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda name=name: calls.append(name))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 7)
    times, peak = bench_harness.timed_steps(torch, lambda: calls.append("step"), 1, 2)
    assert len(times) == 2 and peak == 7
    assert calls == ["step", "synchronize", "synchronize", "reset_peak_memory_stats", "step",
                     "synchronize", "step", "synchronize"]
    rows, note = bench_harness.optimizer_rows(torch, 1e-3)
    assert [name for name, _ in rows[:2]] == ["AdamW on the GPU (fused)", "simple offload"]
    assert (note is None) == (len(rows) == 4)


def test_the_table_says_whether_the_goals_are_met():
    run = lambda ms, *peaks: {"status": "ok", "ms": [ms], "forward_ms": [ms / 3],  # noqa: E731
                              "backward_ms": [2 * ms / 3], "peak_bytes": list(peaks)}
    result = {"name": "m", "what": "w", "batch": "b", "parameters": 1e6, "saved_bytes": 3 << 30,
              "saved_storages": 9, "forward_ms": 100.0, "backward_ms": 200.0,
              "offloaded_bytes": 3 << 30, "kept_over_budget": 0, "pinned_budget": 4 << 30,
              "bound_ms": 1000.0,
              "rows": {"no offload": run(300, 4 << 30), "ferry.offload_saved()": run(1100, 1 << 30),
                       "learning": run(600, 3 << 30, 2 << 30), "t": {"status": "OOM"}}}
    table = bench_models._offload_table(result)
    assert any("ferry step 1.10x it (goal <= 1.15x): met." in line for line in table)
    assert "| ferry.offload_saved() | 1100 | 3.67x | 367 | 733 | 1.00 | 1.00 | 100% |" in table
    # The highest peak of the samples, and the last step's.
    assert "| learning | 600 | 2.00x | 200 | 400 | 3.00 | 2.00 | 33% |" in table
    assert "| t | OOM | | | | | | |" in table
    result["bound_ms"] = 900.0
    assert any("1.22x it (goal <= 1.15x): not met." in line
               for line in bench_models._offload_table(result))


def test_the_state_dict_table_gives_the_spread_of_paired_samples():
    row = {"model": "m float32", "tensors": 3, "bytes": 100 << 20,
           "ms": {"ferry": [9.0, 10.0, 11.0], "non_blocking": [10.0, 10.0, 10.0], "cpu": [300.0]},
           "median_ms": {"ferry": 10.0, "non_blocking": 10.0, "cpu": 300.0},
           "link_share": {"ferry": 0.95, "non_blocking": 0.95, "cpu": 0.03}}
    table = bench_models._state_dict_table([row])
    assert table[2] == ("| m float32 | 3 | 100 | 10.00 | 10.00 | 300 | 1.000 (0.900-1.100) | "
                        "95% / 95% / 3% | met |")
    row["median_ms"]["ferry"] = 10.1
    assert bench_models._state_dict_table([row])[2].endswith("| not met |")
