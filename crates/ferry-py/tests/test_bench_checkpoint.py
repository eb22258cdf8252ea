"""python -m ferry.bench --checkpoint on the CPU: both tiny Llamas trained and checkpointed every
way the bench has, each file read back and loaded, everything it wrote removed; and the stall
arithmetic on figures made up here. Skipped without transformers or torch.distributed."""

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

from ferry import bench, bench_checkpoint  # noqa: E402


def test_the_checkpoint_bench_runs_end_to_end_on_the_cpu(tmp_path, capsys):
    files = tmp_path / "checkpoints"
    files.mkdir()
    out = tmp_path / "out.json"
    assert bench.main(["--checkpoint", "--device", "cpu", "--saves", "2", "--every", "2",
                       "--samples", "2", "--warmup", "1", "--dir", str(files),
                       "--json", str(out)]) == 0
    assert list(files.iterdir()) == []
    record = json.loads(out.read_text())
    assert list(record["cases"]) == list(bench_checkpoint.CASES)
    for case, result in record["cases"].items():
        assert list(result["modes"]) == [name for name, _ in bench_checkpoint.MODES], case
        for name, row in result["modes"].items():
            assert row.get("check") == "ok", (case, name, row)
            assert len(row["saves"]) == 2
            for save in row["saves"]:
                # --every 2, and more only while the save was still being written.
                assert len(save["step_ms"]) >= 2 and all(save["in_flight"][2:]), (case, name)
                assert math.isfinite(save["stall_ms"]) and save["write_gbps"] > 0, (case, name)
            assert math.isfinite(row["loop_ms_per_checkpoint"]), (case, name)
        loads = [bench_checkpoint.FERRY_LOAD, bench_checkpoint.SAFETENSORS_LOAD,
                 bench_checkpoint.DCP_LOAD, bench_checkpoint.DCP_FERRY_LOAD]
        assert list(result["loads"]) == loads
        for name in loads:
            row = result["loads"][name]
            assert "skipped" in row or (len(row["s"]) == bench_checkpoint.LOADS
                                        and row["gbps"] > 0), name
        assert [g["goal"].split()[0] for g in result["goals"]] == [
            "ferry.save_async", "steps", "ferry.save_async", "ferry.load"]
        # On the CPU the reservation holds nothing: its row says so.
        assert result["modes"][bench_checkpoint.FERRY_RESERVED]["note"] == (
            "reserved 0.00 GB before the loop")
    printed = capsys.readouterr().out
    assert "| way | stall ms/ckpt median |" in printed and "| load | file of |" in printed
    # The 16 GB Llama is the 0.97 B one with more layers.
    assert "Llama, 3 layers" in record["cases"]["llama-16g"]["what"]


def test_the_stall_is_the_call_the_wait_and_what_steps_in_flight_took_beyond_the_baseline():
    records = [
        {"call_ms": 2.0, "step_ms": [130.0, 110.0, 100.0], "in_flight": [True, True, False],
         "wait_ms": 0.0, "durable_s": 2.0, "report": {"peak_pinned_bytes": 5}},
        {"call_ms": 4.0, "step_ms": [100.0, 100.0, 100.0], "in_flight": [True, True, True],
         "wait_ms": 50.0, "durable_s": 4.0, "report": {"peak_pinned_bytes": 7}},
    ]
    row = bench_checkpoint.summarise(records, loop_ms=700.0, baseline_ms=100.0,
                                     state_bytes=8_000_000_000, pinned_bytes=None)
    assert [r["stall_ms"] for r in row["saves"]] == [42.0, 54.0]
    assert row["stall_ms_median"] == 48.0 and row["stall_ms_max"] == 54.0
    assert row["loop_ms_per_checkpoint"] == 50.0  # (700 - 6 steps x 100) / 2
    assert [r["steps_during"] for r in row["saves"]] == [2, 3]
    assert row["during_mean_ratio"] == pytest.approx(540 / 5 / 100)
    assert [r["first_step_ratio"] for r in row["saves"]] == [1.3, 1.0]
    assert [r["write_gbps"] for r in row["saves"]] == [4.0, 2.0]
    assert row["pinned_bytes"] == 7
    assert bench_checkpoint.summarise(
        [{**records[0], "report": {}}], 300.0, 100.0, 1, pinned_bytes=3)["pinned_bytes"] == 3


def test_ways_picks_rows_by_words_and_keeps_ferrys_default_first():
    names = [name for name, _ in bench_checkpoint._chosen("dcp.async_save, pinned snapshot")]
    assert names[0] == bench_checkpoint.FERRY
    assert names[1:] == [bench_checkpoint.DCP, bench_checkpoint.DCP_PINNED,
                         bench_checkpoint.DCP_FERRY, bench_checkpoint.PINNED_THREAD]
    assert [n for n, _ in bench_checkpoint._chosen(None)] == [n for n, _ in bench_checkpoint.MODES]
    assert [n for n, _ in bench_checkpoint._chosen("nothing")] == [bench_checkpoint.FERRY]
