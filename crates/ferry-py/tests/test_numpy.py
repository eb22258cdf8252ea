"""ferry's extension module against numpy alone (no torch): DLPack both ways, lifetimes, host
casts, state dicts and the errors. CI runs this file; test_torch.py needs torch."""

import gc

import numpy as np
import pytest

from ferry import _ferry
import ferry


def test_exchange_shares_memory_both_ways():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = _ferry.from_dlpack(a)
    assert x.shape == [3, 4] and x.dtype == "float32" and x.device == "cpu"
    back = np.from_dlpack(x)
    a[1, 2] = 100.0  # a write through numpy is seen through ferry's view
    assert back[1, 2] == 100.0
    assert back.__array_interface__["data"][0] == a.__array_interface__["data"][0]


def test_a_ferry_tensor_keeps_the_numpy_memory_alive():
    a = np.full((256, 256), 7.0, dtype=np.float32)
    x = _ferry.from_dlpack(a)
    del a
    gc.collect()
    np.zeros((256, 256), dtype=np.float32) + 1  # would likely reuse freed memory
    assert np.array_equal(np.from_dlpack(x), np.full((256, 256), 7.0, dtype=np.float32))


def test_strided_views_cross_without_a_copy():
    a = np.arange(24, dtype=np.float64).reshape(4, 6)
    view = a.T[1:, ::2]
    back = np.from_dlpack(_ferry.from_dlpack(view))
    assert np.array_equal(back, view)
    assert back.strides == view.strides


def test_host_moves_cast_like_numpy():
    a = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    for dtype in ("float16", "float64"):
        out, report = _ferry.to(a, "cpu", dtype)
        assert out.dtype == dtype
        assert np.array_equal(np.from_dlpack(out), a.astype(dtype))
        assert report.path == "same_device" and report.grad_bytes_copied == 0


def test_state_dicts_keep_names_and_values():
    rng = np.random.default_rng(1)
    sd = {
        "0.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "0.bias": rng.standard_normal(16).astype(np.float32),
        "2.weight": rng.standard_normal((2, 16)).astype(np.float64),
    }
    moved, report = _ferry.move_state_dict(sd, "cpu")
    assert list(moved) == list(sd)
    for name, value in sd.items():
        assert np.array_equal(np.from_dlpack(moved[name]), value)


def test_errors_name_the_fix():
    a = np.ones(3, dtype=np.float32)
    with pytest.raises(ValueError, match="cuda:N"):
        _ferry.to(a, "tpu")
    with pytest.raises(TypeError, match="convert to float32"):
        _ferry.from_dlpack(np.ones(3, dtype=np.int32))
    with pytest.raises(ValueError, match="not both"):
        _ferry.to_chunked(a, "cpu", 2, 64)
    with pytest.raises(ValueError, match="float16"):
        _ferry.to(a, "cpu", "complex64")
    assert issubclass(ferry.FerryError, RuntimeError)


def test_cuda_queries_answer_without_a_gpu():
    assert isinstance(ferry.cuda_available(), bool)
    if not ferry.cuda_available():
        with pytest.raises(ferry.FerryError, match="CUDA"):
            ferry.pinned_budget()


def test_a_host_array_streams_in_order():
    a = np.arange(4096 * 256, dtype=np.float32).reshape(4096, 256)
    stream = _ferry.stream_to(a, 4)
    n = len(stream)
    assert n >= 4
    rows = []
    for index, start, stop, chunk in stream:
        assert np.array_equal(np.from_dlpack(chunk), a[start:stop])
        rows.append((index, start, stop))
    assert [r[0] for r in rows] == list(range(n))
    assert rows[0][1] == 0 and rows[-1][2] == 4096
    assert all(rows[i][2] == rows[i + 1][1] for i in range(n - 1))
    with pytest.raises(ValueError, match="not both"):
        _ferry.stream_to(a, 2, 64)


def test_memory_stats_are_about_a_gpu():
    with pytest.raises(ValueError, match="pinned_stats"):
        _ferry.memory_stats("cpu")
    if not ferry.cuda_available():
        with pytest.raises(ferry.FerryError):
            _ferry.memory_stats("cuda:0")
