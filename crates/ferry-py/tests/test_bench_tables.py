"""The models benchmark's tables, from figures made up here: they need torch and ferry only, so
they run in CI (the rest of the benchmark's tests need transformers and timm)."""

import pytest

pytest.importorskip("torch")

from ferry import bench_models  # noqa: E402


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
