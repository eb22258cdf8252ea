"""python -m ferry.bench --models on the CPU: tiny versions of its models (2 layers, small widths,
batch 2 x 16) through its steps, the saved-activation count and the gradient comparison, with
ferry's offload scope on host tensors (streams stubbed) and CUDA's timers and memory counters
stubbed, so everything but the GPU's figures runs here. Skipped without transformers and timm."""

import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("timm")
# Imported before the fixtures stub torch.cuda.Stream: transformers' lazy imports read it.
from transformers import GPT2LMHeadModel, LlamaForCausalLM  # noqa: E402,F401

import ferry  # noqa: E402
from ferry import bench, bench_models  # noqa: E402


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
def cuda_stubbed(monkeypatch, host_offload):
    """The bench's CUDA calls made harmless on the CPU: timed events, memory counters at 0."""
    monkeypatch.setattr(torch.cuda, "Event", _TimedEvent)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *device: None)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                 "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda *device: 0)
    budget = [1 << 30]
    monkeypatch.setattr(ferry, "pinned_budget", lambda: budget[0])
    monkeypatch.setattr(ferry, "set_pinned_budget", lambda b: budget.__setitem__(0, b))


class _OffloadEverything(ferry.offload_saved):
    """The scope with no minimum size: the tiny models' tensors are all under 1 MiB."""

    def __init__(self, **options):
        super().__init__(min_bytes=0, **options)


@pytest.mark.parametrize("name", bench_models.MODELS)
def test_offload_on_a_tiny_model_gives_the_same_gradients(name, host_offload):
    work = bench_models.build(name, "cpu", tiny=True)
    assert work.parameters == sum(p.numel() for p in work.model.parameters()) > 0
    saved, storages = bench_models.saved_activations(work)
    assert saved > 0 and storages > 0
    plain = bench_models.gradients(work)
    assert all(g is not None for g in plain)
    # On the CPU the same step gives the same bits, dropout included (seeded alike).
    assert bench_models.gradient_difference(plain, bench_models.gradients(work)) == (0.0, 0.0)
    scopes = []

    def scope():
        scopes.append(_OffloadEverything())
        return scopes[-1]

    offloaded = bench_models.gradients(work, scope)
    assert bench_models.gradient_difference(plain, offloaded) == (0.0, 0.0)
    stats = scopes[0].stats
    assert stats["offloaded"] > 0
    assert stats["prefetched"] + stats["fetched_on_demand"] == stats["offloaded"]


def test_gradient_difference_is_the_max_and_the_relative_norm():
    a = [torch.tensor([3.0, 4.0]), None]
    b = [torch.tensor([3.0, 4.5]), None]
    assert bench_models.gradient_difference(a, b) == pytest.approx((0.5, 0.1))
    assert bench_models.gradient_difference(a, [b[0], torch.zeros(1)])[0] == float("inf")


def test_the_tables_come_out_of_a_tiny_run(cuda_stubbed, monkeypatch):
    monkeypatch.setattr(ferry, "offload_saved", _OffloadEverything)
    link = {"d2h": 50e9, "h2d": 50e9}
    work = bench_models.build("llama", "cpu", tiny=True)
    result = {"name": "llama", **bench_models.measure_offload(work, link, samples=2, warmup=1)}
    result["gradients"] = bench_models.compare_gradients(work)
    rows = result["rows"]
    assert len(rows["no offload"]["ms"]) == 2 and len(rows) == 5
    assert result["offloaded_bytes"] > 0 and result["bound_ms"] > 0
    assert result["gradients"]["ferry_vs_plain"] == (0.0, 0.0)
    table = bench_models._offload_table(result)
    assert any(line.startswith("| ferry.offload_saved() | ") for line in table)
    assert any("link bound" in line for line in table)
    state_dicts = bench_models.measure_state_dicts(work, link, samples=1, warmup=0)
    assert [r["model"] for r in state_dicts] == ["llama float32", "llama bfloat16"]
    assert next(work.model.parameters()).dtype == torch.bfloat16
    assert len(bench_models._state_dict_table(state_dicts)) == 4


def test_a_row_that_runs_out_of_memory_is_dropped(cuda_stubbed):
    work = bench_models.build("gpt2", "cpu", tiny=True)

    class OutOfMemory:
        def __enter__(self):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        def __exit__(self, *exc):
            return False

    assert bench_models._measured_step(work, OutOfMemory) is None
    assert all(p.grad is None for p in work.model.parameters())
    assert bench_models._measured_step(work, bench_models.contextlib.nullcontext) is not None


def test_target_rows_are_absolute_and_between_start_and_peak(host_offload):
    base, peak, saved = 5 << 30, 4 << 30, 3 << 30
    rows = bench_models._offload_rows(peak, saved, base)
    targets = [make().max_device_bytes for label, make in rows if "max_device_bytes" in label]
    assert targets == [base + (3 << 30), base + (2 << 30)]
    # A target cannot go below the step's start.
    assert [make().max_device_bytes for label, make in bench_models._offload_rows(1, saved, base)
            if "max_device_bytes" in label] == [base, base]


def test_the_models_bench_runs_end_to_end_on_tiny_models(cuda_stubbed, monkeypatch, tmp_path,
                                                         capsys):
    build = bench_models.build

    def tiny(name, device):
        work = build(name, "cpu", tiny=True)
        if name == "vit":  # a model whose first step does not fit
            work.loss_of = lambda *_: (_ for _ in ()).throw(torch.OutOfMemoryError("out of memory"))
        return work

    monkeypatch.setattr(bench_models, "build", tiny)
    monkeypatch.setattr(bench_models, "link_bandwidth", lambda: {"d2h": 5e10, "h2d": 5e10})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "a stub")
    monkeypatch.setattr(ferry, "offload_saved", _OffloadEverything)
    monkeypatch.setattr(ferry, "empty_cache", lambda device: None)
    out_json = tmp_path / "models.json"
    args = bench.argparse.Namespace(models="gpt2,vit", profile="llama", samples=1, warmup=0,
                                    json=str(out_json))
    assert bench_models.run(args) == 0
    out = capsys.readouterr().out
    tables = out[out.index("## Activation offload"):]
    assert "**gpt2**: GPT-2, 2 layers" in tables and "| no offload | " in tables
    assert "**vit**: timm vit_base_patch16_224" in tables and "OOM before its rows" in tables
    assert "| gpt2 float32 | " in tables
    assert "memcpy DtoH" in out[:out.index("## Activation offload")]  # the profile came first
    record = bench.json.loads(out_json.read_text())
    assert set(record["models"]) == {"gpt2", "vit"} and record["device"] == "a stub"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the benchmark")
def test_without_cuda_the_models_bench_says_so(capsys):
    assert bench.main(["--models", "gpt2"]) == 0
    assert "no CUDA device" in capsys.readouterr().out
