"""Nested states through ferry.save_async and back through ferry.load: a model's and AdamW's
state dicts come back exactly (every tensor, every value, every container's type), a flat dict
is written byte for byte as before, the key scheme refuses what it cannot name, and a file that
is damaged, truncated or not ferry's is an error naming the problem. The CUDA case skips
without a GPU."""

import json
import math
import os

import pytest

torch = pytest.importorskip("torch")

import ferry  # noqa: E402
from ferry import _ferry  # noqa: E402

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and ferry.cuda_available()),
    reason="needs a CUDA device",
)


def _trained(steps=2):
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for _ in range(steps):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _assert_same_tree(a, b, path="state"):
    """Equal values of equal types all the way down (a tensor: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.cpu(), b.cpu()), path
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert type(k) is type(list(b)[list(a).index(k)]), f"{path}: key {k!r}"
            _assert_same_tree(a[k], b[k], f"{path}.{k}")
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} came back {type(b).__name__}"
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{path}.{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def _header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def test_a_model_and_adamw_state_come_back_exactly(tmp_path):
    model, opt = _trained()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 2, "loss": 0.25}
    path = tmp_path / "ckpt.safetensors"
    report = ferry.save_async(path, state, metadata={"run": "a"}).wait()
    # 4 + 3 (BatchNorm's weight, bias... and its three buffers) tensors of the model, 3 per
    # parameter of AdamW.
    assert report["tensors"] == len(state["model"]) + 3 * len(list(model.parameters()))
    back = ferry.load(path)
    _assert_same_tree(state, back)
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert ferry.load_metadata(path) == {"run": "a"}
    names = set(_header(path)) - {"__metadata__"}
    assert "optim.state.0.exp_avg" in names and "model.1.num_batches_tracked" in names

    # What came back drives a model and optimizer exactly as the originals.
    twin, twin_opt = _trained(steps=0)
    twin.load_state_dict(back["model"])
    twin_opt.load_state_dict(back["optim"])
    x = torch.randn(8, 16)
    for m, o in ((model, opt), (twin, twin_opt)):
        m(x).square().mean().backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_the_key_scheme_names_paths_and_keeps_every_container(tmp_path):
    t = torch.arange(6.0).reshape(2, 3)
    state = {
        "layers.0": {"weight": t},  # a key with dots keeps them
        3: [t + 1, (t + 2, None), {"deep": [t + 3]}],
        "values": {"nan": float("nan"), "inf": -math.inf, "big": 2**70, "flag": True, "s": "é"},
        "empty": {"list": [], "dict": {}, "tuple": ()},
    }
    path = tmp_path / "tree.safetensors"
    ferry.save_async(path, state).wait()
    names = sorted(set(_header(path)) - {"__metadata__"})
    assert names == ["3.0", "3.1.0", "3.2.deep.0", "layers.0.weight"]
    _assert_same_tree(state, ferry.load(path))


def test_a_flat_dict_is_written_as_before(tmp_path):
    state = {"b": torch.randn(3, 4), "a": torch.arange(5), "c": torch.randn(7).half()}
    ferry.save_async(tmp_path / "new", state, metadata={"k": "v"}).wait()
    # What save_async wrote before nested states: the extension called with the dict's pairs.
    capsules = [torch._C._to_dlpack(t) for t in state.values()]
    _ferry.save_async(
        str(tmp_path / "old"), list(state), capsules, [], "pageable", None, metadata={"k": "v"}
    ).wait()
    new, old = (tmp_path / "new").read_bytes(), (tmp_path / "old").read_bytes()
    n = int.from_bytes(new[:8], "little")
    # The same header (the Rust writer orders __metadata__'s entries as a HashMap does, so
    # compared parsed) and the same bytes after it.
    assert _header(tmp_path / "new") == _header(tmp_path / "old")
    assert len(new) == len(old) and new[8 + n :] == old[8 + n :]
    assert set(_header(tmp_path / "new")["__metadata__"]) == {"k", "ferry.crc32"}
    back = ferry.load(tmp_path / "new")
    assert list(back) == ["a", "b", "c"]  # file order
    _assert_same_tree({k: back[k] for k in state}, state)


def test_safetensors_reads_a_nested_save(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    model, opt = _trained()
    path = tmp_path / "ckpt.safetensors"
    ferry.save_async(path, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
    flat = st.load_file(str(path))
    assert torch.equal(flat["model.0.weight"], model.state_dict()["0.weight"])
    assert torch.equal(flat["optim.state.3.exp_avg_sq"], opt.state_dict()["state"][3]["exp_avg_sq"])


def _refused(tmp_path, exc, match, state, **kw):
    with pytest.raises(exc, match=match):
        ferry.save_async(tmp_path / "x.safetensors", state, **kw)
    assert os.listdir(tmp_path) == [], "nothing is written"


def test_what_the_scheme_cannot_hold_is_refused_naming_the_path(tmp_path):
    t = torch.zeros(2)
    _refused(
        tmp_path,
        ValueError,
        r"\('a\.b',\) and \('a', 'b'\) would both be stored as 'a\.b'",
        {"a.b": t, "a": {"b": t}},
    )
    _refused(
        tmp_path,
        TypeError,
        r"'optim\.param_groups\.0\.lr' is a builtins\.object, not a torch",
        {"optim": {"param_groups": [{"lr": object()}]}},
    )
    _refused(
        tmp_path,
        TypeError,
        r"'model\.mask' is a torch\.bool tensor.*uint8",
        {"model": {"mask": torch.ones(2, dtype=torch.bool)}, "n": 1},
    )
    _refused(
        tmp_path,
        TypeError,
        r"key \(1, 2\) under 'a' is a tuple: only str and int keys",
        {"a": {(1, 2): t}},
    )
    loop: dict = {"t": t}
    loop["self"] = loop
    _refused(tmp_path, ValueError, "'self' holds itself", loop)
    _refused(
        tmp_path,
        ValueError,
        "'ferry.structure' is reserved",
        {"a": {"b": t}},
        metadata={"ferry.structure": "mine"},
    )
    with pytest.raises(
        TypeError, match=r"path first, then the state: ferry\.save_async\(path, state\)"
    ):
        ferry.save_async({"a": t}, tmp_path / "x.safetensors")
    assert os.listdir(tmp_path) == []


def test_a_missing_directory_leaves_no_file(tmp_path):
    with pytest.raises(ferry.FerryError, match="No such file"):
        ferry.save_async(tmp_path / "missing" / "x.safetensors", {"a": {"b": torch.zeros(2)}})
    assert os.listdir(tmp_path) == []


_SAVE_ON_A_FULL_DISK = """
import os, resource, signal, sys, torch, ferry
path = sys.argv[1]
ferry.save_async(path, {"w": torch.ones(1000)}).wait()
# The disk fills at 1 MiB: a write beyond it fails (EFBIG, as ENOSPC would, on the same path),
# with the signal that would kill the process ignored.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
pending = ferry.save_async(path, {"model": {"w": torch.full((1 << 20,), 2.0)}})
try:
    pending.wait()
    print("saved")
except ferry.FerryError as e:
    print("refused:", e)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="resource limits are POSIX")
def test_a_full_disk_is_an_error_and_keeps_the_earlier_file(tmp_path):
    # In a child process: its file-size limit stands in for a disk that fills mid-save (a small
    # tmpfs needs privileges the test may not have).
    import subprocess
    import sys

    path = tmp_path / "x.safetensors"
    out = subprocess.run([sys.executable, "-c", _SAVE_ON_A_FULL_DISK, str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    # Named by the target, with what is kept and what to do.
    assert out.stdout.startswith(f"refused: {path}: no room on the disk"), out.stdout
    assert "previous file, if any, is kept" in out.stdout and "free space" in out.stdout
    # Nothing partial: the earlier file alone, whole.
    assert os.listdir(tmp_path) == ["x.safetensors"]
    assert torch.equal(ferry.load(path)["w"], torch.ones(1000))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_directory_leaves_no_file(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ferry.FerryError, match="ermission"):
            ferry.save_async(ro / "x.safetensors", {"a": {"b": torch.zeros(2)}}).wait()
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o755)


def _plain_safetensors(entries, metadata=None, data=b""):
    """A safetensors file by hand: {name: (dtype, shape, [start, end])}."""
    header = {k: {"dtype": d, "shape": s, "data_offsets": o} for k, (d, s, o) in entries.items()}
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def test_ferrys_files_are_read_by_ferrys_reader_and_others_here(tmp_path, monkeypatch):
    # save_async's files (ferry's dtypes) go through the extension's reader, which hashes as it
    # reads and streams onto a GPU; a file with torch-only dtypes is read by the package.
    from ferry import _ferry, checkpoint

    calls = []
    inner = _ferry.load_checkpoint

    def spy(path, device, *args):
        calls.append(device)
        return inner(path, device, *args)

    monkeypatch.setattr(checkpoint._ferry, "load_checkpoint", spy, raising=False)
    state = {"w": torch.randn(3, 5), "n": torch.arange(4), "h": torch.randn(2).bfloat16(),
             "empty": torch.zeros(0, 3)}
    path = tmp_path / "f.safetensors"
    ferry.save_async(path, state).wait()
    back = ferry.load(path)
    assert calls == ["cpu"]
    assert set(back) == set(state)
    for k, t in state.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    plain = tmp_path / "plain.safetensors"
    plain.write_bytes(_plain_safetensors({"i": ("I32", [1], [0, 4])}, data=bytes(4)))
    assert ferry.load(plain)["i"].tolist() == [0]
    assert calls == ["cpu"], "the int32 file was read by the package"


def test_a_plain_safetensors_file_loads_with_torchs_dtypes(tmp_path):
    data = torch.tensor([1, -2, 3], dtype=torch.int32).numpy().tobytes() + bytes([1, 0])
    path = tmp_path / "plain.safetensors"
    path.write_bytes(
        _plain_safetensors({"i": ("I32", [3], [0, 12]), "m": ("BOOL", [2], [12, 14])}, data=data)
    )
    back = ferry.load(path)
    assert back["i"].dtype == torch.int32 and back["i"].tolist() == [1, -2, 3]
    assert back["m"].tolist() == [True, False]


def test_damaged_files_are_refused_with_the_problem_and_the_fix(tmp_path):
    model, opt = _trained()
    good = tmp_path / "good.safetensors"
    ferry.save_async(good, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
    raw = good.read_bytes()
    n = int.from_bytes(raw[:8], "little")

    def damaged(name, content, match):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ferry.FerryError, match=match):
            ferry.load(path)

    damaged("short", raw[:5], "fewer than its header needs")
    damaged("truncated", raw[:-10], "is truncated: tensor .* use an earlier checkpoint")
    damaged("trailing", raw + b"\0" * 4, "4 more than the header describes")
    damaged(
        "text",
        b"hello, this is not a checkpoint at all",
        "more than safetensors allows|but the file has",
    )
    damaged("json", raw[:8] + b"x" + raw[9:], "not JSON")
    damaged("utf8", raw[:8] + b"\xff" + raw[9:], "not UTF-8")
    flipped = bytearray(raw)
    flipped[-1] ^= 0x40
    damaged(
        "flipped", bytes(flipped), "is corrupted: its bytes have CRC32 .* use another checkpoint"
    )
    # The description rewritten with valid JSON: the header's CRC32 catches it.
    text = raw[8 : 8 + n].replace(b'\\"lr\\",0.003', b'\\"lr\\",0.009')
    assert text != raw[8 : 8 + n] and len(text) == n
    damaged("edited", raw[:8] + text + raw[8 + n :], "header .* has CRC32 .* was recorded")
    # A tensor whose range lies beyond the file, in a file without ferry's record.
    beyond = _plain_safetensors({"w": ("F32", [4], [0, 16])}, data=b"\0" * 8)
    damaged(
        "beyond",
        beyond,
        "truncated: tensor 'w' needs bytes 0..16 of the data section, which holds 8",
    )
    sized = _plain_safetensors({"w": ("F32", [4], [0, 8])}, data=b"\0" * 8)
    damaged("sized", sized, "16 bytes, but its data_offsets")
    with pytest.raises(FileNotFoundError):
        ferry.load(tmp_path / "nowhere.safetensors")
    # The good file still loads.
    _assert_same_tree({"model": model.state_dict(), "optim": opt.state_dict()}, ferry.load(good))


def test_a_damaged_description_is_an_error_not_a_crash(tmp_path):
    # Written by hand with a valid header (no checksum record): the description alone is bad.
    path = tmp_path / "desc.safetensors"
    bad = json.dumps({"format": 1, "tree": {"dict": [["w", {"tensor": "nope"}]]}})
    path.write_bytes(
        _plain_safetensors({"w": ("F32", [1], [0, 4])}, {"ferry.structure": bad}, b"\0" * 4)
    )
    with pytest.raises(ferry.FerryError, match="refers to a tensor 'nope' the file does not hold"):
        ferry.load(path)
    newer = json.dumps({"format": 99, "tree": None})
    path.write_bytes(_plain_safetensors({}, {"ferry.structure": newer}))
    with pytest.raises(ferry.FerryError, match="format 99.*newer ferry"):
        ferry.load(path)


def test_the_device_is_checked(tmp_path):
    path = tmp_path / "d.safetensors"
    ferry.save_async(path, {"a": {"b": torch.zeros(2)}}).wait()
    with pytest.raises(ValueError, match="device='mps'"):
        ferry.load(path, "mps")
    assert ferry.load(path, torch.device("cpu"))["a"]["b"].device.type == "cpu"


@cuda
def test_load_puts_the_tensors_on_the_gpu(tmp_path):
    model, opt = _trained()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    path = tmp_path / "gpu.safetensors"
    ferry.save_async(path, state).wait()
    for device in ("cuda", 0, torch.device("cuda:0")):
        back = ferry.load(path, device)
        assert back["model"]["0.weight"].device == torch.device("cuda:0")
        _assert_same_tree(state, back)


def test_empty_tensors_at_one_offset_load_every_time(tmp_path):
    # Several empty tensors share offsets; their names run against their file order. The
    # header's CRC32 orders them by name, and the reader must too.
    state = {name: torch.empty(0, 3) for name in ("z", "q", "c", "m")}
    state["w"] = torch.arange(6, dtype=torch.float32)
    for i in range(4):
        path = tmp_path / f"empty-{i}.safetensors"
        ferry.save_async(str(path), state).wait()
        back = ferry.load(str(path))
        assert sorted(back) == sorted(state)
        assert torch.equal(back["w"], state["w"])
        assert all(back[k].shape == (0, 3) for k in "zqcm")
