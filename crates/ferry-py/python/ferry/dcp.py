"""``torch.distributed.checkpoint`` (DCP) through ferry's writer::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import ferry.dcp

    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.save(state, storage_writer=ferry.dcp.FerryStorageWriter("ckpt/step-100"))

    dcp.load(state, storage_reader=ferry.dcp.FerryStorageReader("ckpt/step-100"))  # in place
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    # the writer also stages (ferry.dcp.FerryStager): GPU tensors cross to the host by
    # ferry.move_state_dict, the write runs on DCP's thread while training goes on
    dcp.async_save(state, storage_writer=ferry.dcp.FerryStorageWriter("ckpt/step-200"))

A checkpoint is a directory; for each rank r (a process without a process group is rank 0):

``__r_0.safetensors``
    rank r's tensors, written by ``ferry.save_async`` (ferry's CRC32s in the header, fsynced,
    renamed into place whole), each under DCP's name for it (``model.layers.0.weight``,
    ``optim.state.layers.0.weight.exp_avg``); a shard of a larger tensor under
    ``NAME@O0,O1,...`` (its offsets). ``ferry.load`` and safetensors read it. A tensor of a
    dtype ferry's files lack (int32, bool, ...) is stored as its bytes (uint8), its dtype and
    shape in ``.metadata``.
``__r_0.bytes``
    rank r's other values (the ints, floats and strings DCP pickles, ``param_groups`` say), one
    after another; each one's offset, length and CRC32 are in ``.metadata``. Written to a
    temporary file, fsynced and renamed.
``.metadata``
    DCP's ``Metadata``, pickled as torch's ``FileSystemWriter`` pickles it, its
    ``storage_data`` mapping every item to a :class:`StorageInfo`. Written last (temporary,
    fsync, rename): a directory without it holds no checkpoint. Overwriting a checkpoint
    removes its old ``.metadata`` first, so an interrupted save leaves no checkpoint there
    rather than one mixing two saves.

The reader checks what it reads: each safetensors file's header (and its CRC32) before any
data, each tensor's and each value's CRC32, and sizes against what DCP asks for; a damaged
checkpoint is a ``FerryError`` naming the file. Written for torch 2.11 and later (tested with
2.15 in one process, on the CPU).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import move_state_dict
from ._ferry import FerryError
from .checkpoint import WRITABLE_DTYPES, start_save
from .checkpoint_file import Header, as_tensor, read_bytes, read_header, torch_dtype

__all__ = ["FerryStager", "FerryStorageReader", "FerryStorageWriter", "StorageInfo"]

_METADATA = ".metadata"


@dataclass(frozen=True)
class StorageInfo:
    """Where one DCP item is: a file of the checkpoint directory, the byte range in it, and the
    tensor's name in that safetensors file (``None`` for a value in a ``.bytes`` file, whose
    CRC32 is ``crc32``). ``raw`` is ``(dtype, shape)`` for a tensor stored as its bytes."""

    relative_path: str
    offset: int
    length: int
    name: str | None = None
    crc32: int | None = None
    raw: tuple[str, tuple[int, ...]] | None = None


@dataclass(frozen=True)
class _FilePrefix:
    prefix: str


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _plain_tensors(tree: Any) -> bool:
    """Whether every tensor in ``tree`` is a plain one (no DTensor or other subclass)."""
    if isinstance(tree, torch.Tensor):
        return type(tree) in (torch.Tensor, torch.nn.Parameter)
    if isinstance(tree, dict):
        return all(_plain_tensors(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(_plain_tensors(v) for v in tree)
    return True


class FerryStager(AsyncStager):
    """Stages a state dict for ``dcp.async_save``: a copy on the host, safe from the training
    step that follows. GPU tensors of ferry's dtypes cross in one batch by
    :func:`ferry.move_state_dict` (into ferry's pinned pool, within its budget), other GPU
    tensors by ``.to("cpu")``, host tensors are cloned; other values are kept as they are (DCP
    pickles them). A state holding tensor subclasses (DTensor) is staged by torch's
    ``BlockingAsyncStager`` instead. Staging is done when ``stage`` returns."""

    _synchronize_after_execute: bool = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if not _plain_tensors(state_dict):
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            return BlockingAsyncStager().stage(state_dict)
        gpu: dict[str, torch.Tensor] = {}

        def collect(node: Any, path: str) -> None:
            if isinstance(node, torch.Tensor):
                if node.is_cuda and _dtype_name(node.dtype) in WRITABLE_DTYPES:
                    gpu[path] = node
            elif isinstance(node, dict):
                for k, v in node.items():
                    collect(v, f"{path}/{k!r}")
            elif isinstance(node, (list, tuple)):
                for i, v in enumerate(node):
                    collect(v, f"{path}/{i}")

        collect(state_dict, "")
        moved = move_state_dict(gpu, "cpu") if gpu else {}

        def copy(node: Any, path: str) -> Any:
            if isinstance(node, torch.Tensor):
                if path in moved:
                    return moved[path]
                return node.detach().to("cpu") if node.is_cuda else node.detach().clone()
            if isinstance(node, dict):
                return {k: copy(v, f"{path}/{k!r}") for k, v in node.items()}
            if isinstance(node, (list, tuple)):
                items = [copy(v, f"{path}/{i}") for i, v in enumerate(node)]
                return items if isinstance(node, list) else tuple(items)
            return node

        return copy(state_dict, "")

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copies have landed."""

    def close(self) -> None:
        """Nothing to release: the staged tensors go when DCP drops them."""


def _writable_parent(checkpoint_id: str | os.PathLike[str]) -> bool:
    # As torch's FileSystem decides whether a checkpoint id is a local path.
    if "://" in str(checkpoint_id):
        return False
    path = os.path.abspath(os.fspath(checkpoint_id))
    while True:
        parent = os.path.dirname(path)
        if os.path.isdir(parent):
            return os.access(parent, os.W_OK)
        if parent == path:
            return False
        path = parent


def _durable_write(path: str, chunks: list[memoryview]) -> None:
    """Writes ``chunks`` to ``path`` whole or not at all: a temporary beside it, fsynced, renamed
    over it, and the directory fsynced."""
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shard_name(index: MetadataIndex) -> str:
    offsets = tuple(index.offset or ())
    if any(offsets):
        return f"{index.fqn}@{','.join(str(o) for o in offsets)}"
    return index.fqn


class FerryStorageWriter(StorageWriter, FerryStager):
    """A DCP ``StorageWriter`` writing the directory ``path`` (created with its parents) as the
    module docs lay out: tensors through ``ferry.save_async``, one safetensors file per rank.
    ``memory`` and ``staging_bytes`` are ``save_async``'s. ``overwrite=False`` refuses a
    directory that holds a checkpoint already (torch's writer's option)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = True,
        memory: str | int = "auto",
        staging_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.overwrite = overwrite
        self.memory = memory
        self.staging_bytes = staging_bytes
        self.save_id = uuid.uuid4().hex
        # Whether the next write_data writes what this writer staged: private copies.
        self._staged = False
        self.is_coordinator = True
        self.rank: int | None = None
        self.use_collectives = True

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged = super().stage(state_dict)
        self._staged = True
        return staged

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def _metadata_path(self) -> str:
        # Without collectives each rank writes its own index, as torch's writer does.
        if not self.use_collectives and self.rank is not None:
            return os.path.join(self.path, f"__{self.rank}{_METADATA}")
        return os.path.join(self.path, _METADATA)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        os.makedirs(self.path, exist_ok=True)
        index = self._metadata_path()
        if os.path.exists(index):
            if not self.overwrite:
                raise FerryError(
                    f"{self.path} holds a checkpoint already and overwrite=False: save to "
                    "another directory, or pass overwrite=True"
                )
            if self.is_coordinator or not self.use_collectives:
                os.remove(index)
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_FilePrefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            (
                dataclasses.replace(plan, storage_data=_FilePrefix(f"__{i}_"))
                if plan.storage_data is None
                else plan
            )
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        # Staged copies are nobody else's: optimizer steps on the training thread need not wait
        # for their snapshot.
        owned, self._staged = self._staged, False
        results = self._write_tensors(f"{prefix}0.safetensors", plan, planner, owned)
        results += self._write_values(f"{prefix}0.bytes", plan, planner)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_tensors(
        self, name: str, plan: SavePlan, planner: SavePlanner, owned: bool
    ) -> list[WriteResult]:
        items = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        if not items:
            return []
        named: list[tuple[str, torch.Tensor]] = []
        raw: dict[str, tuple[str, tuple[int, ...]]] = {}
        for item in items:
            key = _shard_name(item.index)
            t = cast(torch.Tensor, planner.resolve_data(item)).detach()
            if _dtype_name(t.dtype) not in WRITABLE_DTYPES:
                raw[key] = (_dtype_name(t.dtype), tuple(t.shape))
                t = t.contiguous().reshape(-1).view(torch.uint8)
            named.append((key, t))
        path = os.path.join(self.path, name)
        start_save(path, named, {}, self.memory, self.staging_bytes, owned=owned).wait()
        with open(path, "rb") as f:
            header = read_header(f, path)
        where = {e.name: e for e in header.entries}
        results = []
        for item, (key, _) in zip(items, named):
            e = where[key]
            info = StorageInfo(
                name, header.data_start + e.start, e.end - e.start, key, raw=raw.get(key)
            )
            results.append(
                WriteResult(index=item.index, size_in_bytes=info.length, storage_data=info)
            )
        return results

    def _write_values(self, name: str, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        if not items:
            return []
        chunks, results, at = [], [], 0
        for item in items:
            data = cast(io.BytesIO, planner.resolve_data(item)).getbuffer()
            info = StorageInfo(name, at, len(data), crc32=zlib.crc32(data))
            results.append(
                WriteResult(index=item.index, size_in_bytes=len(data), storage_data=info)
            )
            chunks.append(data)
            at += len(data)
        _durable_write(os.path.join(self.path, name), chunks)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        from torch.distributed.checkpoint import filesystem

        version = getattr(filesystem, "CURRENT_DCP_VERSION", None)
        if version is not None and hasattr(metadata, "version"):
            metadata.version = version
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_meta = self.storage_meta()
        _durable_write(self._metadata_path(), [memoryview(pickle.dumps(metadata))])

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _writable_parent(checkpoint_id)


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if length < t.size(dim):
            t = t.narrow(dim, start, length)
    return t


class FerryStorageReader(StorageReader):
    """A DCP ``StorageReader`` of a directory :class:`FerryStorageWriter` wrote, checking every
    byte it reads (see the module docs). Tensors are read into host memory and copied into the
    tensors DCP asks to fill (``copy_``, onto their device)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.storage_data: dict[MetadataIndex, StorageInfo] = {}
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = _METADATA if rank is None else f"__{rank}{_METADATA}"
        path = os.path.join(self.path, name)
        if not os.path.exists(path):
            raise FerryError(
                f"{self.path} holds no checkpoint: it has no {name} (the save did not finish, "
                "or this is not a checkpoint directory)"
            )
        with open(path, "rb") as f:
            try:
                metadata = pickle.load(f)
            except Exception as e:
                raise FerryError(
                    f"{path}: cannot be read ({type(e).__name__}: {e}); the file is damaged, use "
                    "another checkpoint"
                ) from None
        if not isinstance(metadata, Metadata):
            raise FerryError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata")
        foreign = [
            v for v in (metadata.storage_data or {}).values() if not isinstance(v, StorageInfo)
        ]
        if foreign:
            raise FerryError(
                f"{self.path} was not written by ferry.dcp.FerryStorageWriter (its items are "
                f"stored as {type(foreign[0]).__name__}): read it with torch's FileSystemReader"
            )
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            path = os.path.join(self.path, relative_path)
            with open(path, "rb") as f:
                header: Header | None = None
                # A tensor read by several requests (resharding) is read once.
                read: dict[str, torch.Tensor] = {}
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(self._value(f, path, req, info)))
                        continue
                    header = header or read_header(f, path)
                    name = info.name or ""
                    if name not in read:
                        read[name] = self._tensor(f, header, info)
                    self._fill(header, req, read[name], planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @staticmethod
    def _tensor(f: Any, header: Header, info: StorageInfo) -> torch.Tensor:
        entry = header.entry(info.name or "")
        buf = read_bytes(f, header, entry)
        if info.raw is None:
            return as_tensor(buf, torch_dtype(header, entry), entry.shape)
        dtype, shape = info.raw
        return as_tensor(buf, getattr(torch, dtype), shape)

    @staticmethod
    def _fill(header: Header, req: Any, stored: torch.Tensor, planner: LoadPlanner) -> None:
        t = _narrow(stored, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != t.size():
            raise FerryError(
                f"{header.path}: {req.storage_index.fqn!r} holds {tuple(t.size())} where "
                f"{tuple(target.size())} is asked for: the state does not match the checkpoint"
            )
        target.copy_(t)
        planner.commit_tensor(req, target)

    @staticmethod
    def _value(f: Any, path: str, req: Any, info: StorageInfo) -> bytes:
        f.seek(info.offset)
        data = f.read(info.length)
        if len(data) != info.length or zlib.crc32(data) != info.crc32:
            raise FerryError(
                f"{path}: the value of {req.storage_index.fqn!r} is damaged (bytes "
                f"{info.offset}..{info.offset + info.length} are missing or differ from the "
                "CRC32 recorded at save time); use another checkpoint"
            )
        return data

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _writable_parent(checkpoint_id)
