"""torch.distributed.checkpoint through ferry's writer and reader, in one process with no
process group: a model's and AdamW's state comes back as from torch's own FileSystemWriter and
FileSystemReader, with the same DCP metadata; async_save stages through ferry (writes after it
do not reach the file); the rank's tensors are a ferry file; damage is found. Skips where torch
lacks torch.distributed.checkpoint."""

import os
import pickle
import warnings

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)
dcp = pytest.importorskip("torch.distributed.checkpoint")
state_dict_api = pytest.importorskip("torch.distributed.checkpoint.state_dict")

import ferry  # noqa: E402
import ferry.dcp  # noqa: E402

# DCP reports a failure inside a step as a CheckpointException, a BaseException.
_FAILS = (Exception, getattr(dcp, "CheckpointException", Exception))


def _load_keeps_the_readers_error() -> bool:
    """Whether this torch's dcp.load says why the reader found no metadata: torch 2.11's
    catches the reader's error and raises "metadata is None" alone; later ones add the
    reader's message to it."""
    import inspect

    from torch.distributed.checkpoint import state_dict_loader

    return "global metadata read failed" in inspect.getsource(state_dict_loader)

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and ferry.cuda_available()),
    reason="needs a CUDA device",
)

# DCP warns that it saves in a single process: that is the case tested here.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _model(device="cpu"):
    torch.manual_seed(11)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    # Buffers of dtypes ferry's files lack.
    model.register_buffer("mask", torch.tensor([True, False, True]))
    model.register_buffer("ids", torch.arange(5, dtype=torch.int32))
    return model.to(device)


def _trained(steps=2, device="cpu"):
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        model(torch.randn(8, 16, device=device)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model, opt):
    msd, osd = state_dict_api.get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"epoch": 3, "name": "run-a", "lr": [0.1, 0.2]}}


def _blank(device="cpu"):
    """A fresh model and optimizer's state to load into (AdamW's state initialised)."""
    model = _model(device)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    return model, opt, _state(model, opt) | {"extra": {"epoch": 0, "name": "", "lr": [0.0, 0.0]}}


def _assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        # Values, wherever each is: AdamW keeps its step counts on the host beside GPU state.
        assert torch.equal(a.cpu(), b.cpu()), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def _snapshot(state):
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_snapshot(v) for v in state)
    return state


def test_a_round_trip_matches_torchs_own_writer_and_reader(tmp_path):
    model, opt = _trained()
    state = _state(model, opt)
    expected = _snapshot(state)
    ours = dcp.save(state, storage_writer=ferry.dcp.FerryStorageWriter(tmp_path / "ferry"))
    theirs = dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "torch"))
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert sorted(os.listdir(tmp_path / "ferry")) == [
        ".metadata",
        "__0_0.bytes",
        "__0_0.safetensors",
    ]

    loaded = {}
    for name, reader in (
        ("ferry", ferry.dcp.FerryStorageReader(tmp_path / "ferry")),
        ("torch", dcp.FileSystemReader(tmp_path / "torch")),
    ):
        model2, opt2, target = _blank()
        dcp.load(target, storage_reader=reader)
        state_dict_api.set_state_dict(
            model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"]
        )
        loaded[name] = _state(model2, opt2) | {"extra": target["extra"]}
    _assert_same(expected, loaded["ferry"])
    _assert_same(loaded["torch"], loaded["ferry"])
    assert loaded["ferry"]["optim"]["param_groups"][0]["lr"] == 3e-3


def test_the_ranks_tensors_are_a_ferry_file_under_dcps_names(tmp_path):
    model, opt = _trained()
    dcp.save(_state(model, opt), storage_writer=ferry.dcp.FerryStorageWriter(tmp_path))
    flat = ferry.load(tmp_path / "__0_0.safetensors")
    assert torch.equal(flat["model.0.weight"], model.state_dict()["0.weight"])
    # get_state_dict keys the optimizer's state by parameter name: "3.weight" is parameter 4.
    assert torch.equal(
        flat["optim.state.3.weight.exp_avg"], opt.state_dict()["state"][4]["exp_avg"]
    )
    # int32 and bool are stored as their bytes; .metadata says what they were.
    assert flat["model.ids"].dtype == torch.uint8 and flat["model.ids"].numel() == 20
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    infos = {index.fqn: info for index, info in metadata.storage_data.items()}
    assert infos["model.ids"].raw == ("int32", (5,))
    assert infos["model.0.weight"].name == "model.0.weight" and infos["model.0.weight"].raw is None
    assert (
        infos["extra.name"].relative_path == "__0_0.bytes" and infos["extra.name"].crc32 is not None
    )


def test_async_save_stages_through_ferry(tmp_path):
    model, opt = _trained()
    state = _state(model, opt)
    expected = _snapshot(state)
    writer = ferry.dcp.FerryStorageWriter(tmp_path)
    response = dcp.async_save(state, storage_writer=writer)
    # Staged before async_save returned: training goes on and does not reach the checkpoint.
    for _ in range(3):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    getattr(response, "upload_completion", response).result()
    assert not torch.equal(model.state_dict()["0.weight"], expected["model"]["0.weight"])
    _, _, target = _blank()
    dcp.load(target, storage_reader=ferry.dcp.FerryStorageReader(tmp_path))
    _assert_same(expected, target)


def test_the_stager_copies_every_tensor_and_keeps_the_rest():
    t = torch.arange(4.0)
    state = {"a": t, "b": [t, {"c": "x", "d": None}], "e": (1, t)}
    staged = ferry.dcp.FerryStager().stage(state)
    _assert_same(state, staged)
    assert staged["a"].data_ptr() != t.data_ptr() and isinstance(staged["e"], tuple)


@cuda
def test_a_gpu_state_is_staged_to_the_host_through_ferry_and_loaded_back_onto_the_gpu(tmp_path):
    model, opt = _trained(device="cuda")
    state = _state(model, opt)
    expected = _snapshot(state)
    staged = ferry.dcp.FerryStager().stage(state)
    assert staged["model"]["0.weight"].device.type == "cpu"
    assert staged["model"]["mask"].device.type == "cpu"  # a dtype ferry does not move
    _assert_same(expected, _to(staged, "cuda"))
    response = dcp.async_save(state, storage_writer=ferry.dcp.FerryStorageWriter(tmp_path))
    for _ in range(3):
        model(torch.randn(8, 16, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
    getattr(response, "upload_completion", response).result()
    _, _, target = _blank("cuda")
    dcp.load(target, storage_reader=ferry.dcp.FerryStorageReader(tmp_path))
    assert target["model"]["0.weight"].device.type == "cuda"
    _assert_same(expected, target)


def _to(state, device):
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to(v, device) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to(v, device) for v in state)
    return state


def test_a_damaged_checkpoint_is_an_error_naming_the_file(tmp_path):
    model, opt = _trained()
    dcp.save(_state(model, opt), storage_writer=ferry.dcp.FerryStorageWriter(tmp_path))
    data = tmp_path / "__0_0.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x10
    data.write_bytes(bytes(raw))
    _, _, target = _blank()
    with pytest.raises(_FAILS, match="is corrupted"):
        dcp.load(target, storage_reader=ferry.dcp.FerryStorageReader(tmp_path))

    values = tmp_path / "__0_0.bytes"
    values.write_bytes(values.read_bytes()[:-3])
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(_FAILS, match="truncated|damaged"):
        dcp.load(target, storage_reader=ferry.dcp.FerryStorageReader(tmp_path))


def test_what_is_not_a_ferry_checkpoint_is_refused(tmp_path):
    _, _, target = _blank()
    (tmp_path / "empty").mkdir()
    told = _load_keeps_the_readers_error()
    with pytest.raises(
        _FAILS, match="holds no checkpoint: it has no .metadata" if told else "metadata is None"
    ):
        dcp.load(target, storage_reader=ferry.dcp.FerryStorageReader(tmp_path / "empty"))
    model, opt = _trained()
    dcp.save(_state(model, opt), storage_writer=dcp.FileSystemWriter(tmp_path / "torch"))
    with pytest.raises(
        _FAILS,
        match="not written by ferry.dcp.FerryStorageWriter.*FileSystemReader"
        if told
        else "metadata is None",
    ):
        dcp.load(target, storage_reader=ferry.dcp.FerryStorageReader(tmp_path / "torch"))


def test_overwriting_is_refused_on_request_and_never_mixes_two_saves(tmp_path):
    model, opt = _trained()
    dcp.save(_state(model, opt), storage_writer=ferry.dcp.FerryStorageWriter(tmp_path))
    with pytest.raises(_FAILS, match="overwrite=False"):
        dcp.save(
            _state(model, opt),
            storage_writer=ferry.dcp.FerryStorageWriter(tmp_path, overwrite=False),
        )
    # An overwrite that fails midway (a value DCP cannot pickle reaches the writer after the
    # tensors are written) leaves no .metadata that points at the new files.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(_FAILS):
            dcp.save(
                _state(model, opt) | {"bad": {"lock": __import__("threading").Lock()}},
                storage_writer=ferry.dcp.FerryStorageWriter(tmp_path),
            )
    assert ".metadata" not in os.listdir(tmp_path)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_directory_is_an_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(_FAILS, match="ermission"):
            dcp.save({"w": torch.zeros(3)}, storage_writer=ferry.dcp.FerryStorageWriter(ro))
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o755)
