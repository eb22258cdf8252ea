"""Fixtures the test files share."""

import pytest

torch = pytest.importorskip("torch")


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Stream:
    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


@pytest.fixture
def host_offload(monkeypatch):
    """offload_saved's bookkeeping on host tensors: streams and events stubbed out, host
    tensors offloadable, plain torch memory in place of ferry's pinned pool."""
    import contextlib
    import types

    from ferry import offload

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    pinned = types.SimpleNamespace(empty_pinned=lambda shape, dtype, ordered: torch.empty(shape))
    monkeypatch.setattr(offload, "_ferry", pinned)
    monkeypatch.setattr(offload, "to_torch", lambda block: block)

    def movable(self, t):
        return t.numel() * t.element_size() >= self.min_bytes

    monkeypatch.setattr(offload.offload_saved, "_movable", movable)
