"""ferry's extension module against numpy alone (no torch): DLPack both ways, lifetimes, host
casts, state dicts and the errors. CI runs this file; test_torch.py needs torch."""

import ctypes
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
    # A dtype ferry does not have is a TypeError, as torch's `t.to(dtype=...)` raises.
    with pytest.raises(TypeError, match="float16"):
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
        # As torch.cuda's: an int, "cuda" or nothing name a GPU (here there is none to read).
        for device in (0, "cuda", None):
            with pytest.raises(ferry.FerryError):
                ferry.memory_stats(device)
            with pytest.raises(ferry.FerryError):
                ferry.reset_peak_memory_stats(device)


def misaligned_f32(n):
    """n float32 values one byte into a byte buffer: numpy allows it, typed reads must not."""
    a = np.zeros(4 * n + 4, np.uint8)[1 : 4 * n + 1].view(np.float32)
    a[:] = np.arange(n, dtype=np.float32)
    assert not a.flags.aligned
    return a


def test_misaligned_memory_is_copied_by_moves_and_refused_by_the_exchange():
    a = misaligned_f32(1024)
    out, report = _ferry.to(a, "cpu", "float16")
    assert np.array_equal(np.from_dlpack(out), a.astype(np.float16))
    assert report.realigned_bytes == a.nbytes
    # Aligned data is not copied on the way.
    _, plain = _ferry.to(np.arange(8, dtype=np.float32), "cpu", "float16")
    assert plain.realigned_bytes == 0
    # Sharing misaligned memory would hand out misaligned typed views: refused, naming the fix.
    with pytest.raises(ValueError, match=r"not aligned.*\.copy\(\)"):
        _ferry.from_dlpack(a)
    # Every move path takes it.
    moved, _ = _ferry.move_state_dict({"w": a}, "cpu")
    assert np.array_equal(np.from_dlpack(moved["w"]), a)


def test_an_exception_in_flight_survives_a_capsule_being_freed():
    x = _ferry.from_dlpack(np.arange(4, dtype=np.float32))

    class Once:
        """Hands numpy a capsule made beforehand, so the caller keeps it after it is consumed."""

        def __init__(self, capsule):
            self.capsule = capsule

        def __dlpack__(self, **kwargs):
            return self.capsule

        def __dlpack_device__(self):
            return x.__dlpack_device__()

    def consumed():
        capsule = x.__dlpack__()
        np.from_dlpack(Once(capsule))  # renamed used_dltensor
        return capsule

    def unused():
        return x.__dlpack__()

    for make in (consumed, unused):
        # The capsule sits only on the value stack when 1 / 0 raises: the interpreter frees it
        # while the ZeroDivisionError is in flight (a destructor that cleared errors turned this
        # into "SystemError: error return without exception set").
        with pytest.raises(ZeroDivisionError):
            [make(), 1 / 0]  # noqa: B018


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


def _capsule(data, shape, strides=None, ndim=None, dtype=(2, 32, 1), device=(1, 0), keep=None):
    """A hand-made legacy DLPack capsule over `data` (a numpy array kept in `keep`)."""
    shape_arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    strides_arr = None if strides is None else (ctypes.c_int64 * len(strides))(*strides)
    managed = _DLManagedTensor(
        _DLTensor(
            data.ctypes.data,
            _DLDevice(*device),
            len(shape) if ndim is None else ndim,
            _DLDataType(*dtype),
            shape_arr,
            strides_arr,
            0,
        ),
        None,
        None,
    )
    keep.extend([data, shape_arr, strides_arr, managed])
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(managed), b"dltensor", None)


def test_corrupt_dlpack_capsules_are_errors_not_crashes():
    keep = []
    data = np.arange(6, dtype=np.float32)
    # The hand-made capsule is right: a well-formed one reads back.
    good = _ferry.from_dlpack(_capsule(data, [2, 3], keep=keep))
    assert np.array_equal(np.from_dlpack(good), data.reshape(2, 3))
    bad = [
        (dict(shape=[6], ndim=-1), ValueError, "dimensions"),
        (dict(shape=[6], ndim=1000), ValueError, "dimensions"),
        (dict(shape=[1 << 62, 1 << 62]), ValueError, "address space"),
        (dict(shape=[2, 3], strides=[-3, 1]), ValueError, "negative stride"),
        (dict(shape=[6], dtype=(5, 64, 1)), TypeError, "no dtype"),
        (dict(shape=[6], device=(7, 0)), BufferError, "device type 7"),
    ]
    for kwargs, error, message in bad:
        with pytest.raises(error, match=message):
            _ferry.from_dlpack(_capsule(data, keep=keep, **kwargs))
    # A consumed capsule cannot be used twice.
    capsule = _capsule(data, [6], keep=keep)
    _ferry.from_dlpack(capsule)
    with pytest.raises(ValueError, match="unused"):
        _ferry.from_dlpack(capsule)


def test_sizes_too_large_to_allocate_are_errors():
    with pytest.raises(ValueError, match="too large"):
        _ferry.empty_pinned([1 << 62, 1 << 62], "float32")
