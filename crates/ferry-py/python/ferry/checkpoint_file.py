"""Reading the files ``ferry.save_async`` writes, from Python: safetensors (an 8-byte
little-endian header length, the JSON header, the tensors' bytes) with ferry's checksum record
in the header's ``__metadata__``.

The checks are those of the Rust reader (crates/ferry/src/checkpoint/read.rs): the header is
checked against the file's length before anything is allocated, every tensor's range and size
against its dtype and shape, and, when the file has ferry's record (``ferry.crc32``), the
header's CRC32 before any data is read and each tensor's as it is read. A damaged file is a
``FerryError`` naming the file, what is wrong and what to do; never a crash or an allocation
sized by a corrupt number. A plain safetensors file (no record) has its structure checked alone.

``ferry.load`` reads files of ferry's dtypes (every file ``save_async`` writes) through the
extension's reader (``_ferry.load_checkpoint``); this module reads their headers (for
``load_metadata``, for ``load`` to choose, for the DCP reader's byte ranges) and the tensors of
files with the dtypes only torch has (int32, bool, float8...), which ferry's tensors cannot
hold.
"""

from __future__ import annotations

import io
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any

from ._ferry import FerryError

CHECKSUM_KEY = "ferry.crc32"
# safetensors' own limit on the header.
MAX_HEADER_LEN = 100_000_000

# safetensors' dtype names: torch's name and the bytes of one element.
DTYPES = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F64": ("float64", 8),
    "C64": ("complex64", 8),
}


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name, safetensors dtype, shape, and byte range in the data
    section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    """A file's checked header: its entries in file order, its metadata (less ferry's record),
    and each tensor's recorded CRC32 when the file has the record."""

    path: str
    data_start: int
    entries: list[Entry]
    metadata: dict[str, str]
    checksums: dict[str, int] | None

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise FerryError(f"{self.path}: holds no tensor {name!r}: the file is not the one written")


def _format_error(path: str, reason: str) -> FerryError:
    return FerryError(f"{path}: not a valid safetensors file: {reason}")


def _entry(path: str, name: str, info: Any) -> Entry:
    def bad(what: str) -> FerryError:
        return _format_error(path, f"tensor {name!r} {what}; the header is damaged")

    if not isinstance(info, dict):
        raise bad("is described by no object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"has dtype {dtype!r}, which is none of safetensors' ({', '.join(DTYPES)})")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise bad(f"has shape {shape!r}, not a list of sizes")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int and o >= 0 for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise bad(f"has data_offsets {offsets!r}, not a [start, end] range")
    # Strides must be addressable (an empty tensor may declare any other dimension).
    reach, numel = 8, 1
    for d in shape:
        reach *= max(d, 1)
        numel *= d
    if reach >= 1 << 63:
        raise bad(f"has shape {shape}, whose strides are too large to address")
    nbytes = numel * DTYPES[dtype][1]
    if offsets[1] - offsets[0] != nbytes:
        raise bad(
            f"is {dtype} of shape {shape}, {nbytes} bytes, but its data_offsets {offsets} span "
            f"{offsets[1] - offsets[0]}"
        )
    return Entry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _checksums(
    path: str, record: str, entries: list[Entry], metadata: dict[str, str]
) -> dict[str, int]:
    """Parses ferry's record and checks the header against it (format.rs: the CRC32 of the
    names, dtypes, shapes and offsets in file order and the other metadata by key, as compact
    JSON)."""

    def damaged(what: str) -> FerryError:
        return _format_error(
            path,
            f"{what}; the header was damaged after the file was written, use another checkpoint",
        )

    def hex8(v: Any) -> int:
        if not (isinstance(v, str) and len(v) == 8):
            raise ValueError(v)
        return int(v, 16)

    try:
        doc = json.loads(record)
        header = hex8(doc["header"])
        sums = {k: hex8(v) for k, v in doc["tensors"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise damaged(f"its checksum record ({CHECKSUM_KEY!r}) cannot be read") from None
    described = [[e.name, e.dtype, list(e.shape), [e.start, e.end]] for e in entries]
    others = {k: metadata[k] for k in sorted(metadata)}
    text = json.dumps([described, others], separators=(",", ":"), ensure_ascii=False)
    found = zlib.crc32(text.encode("utf-8"))
    if found != header:
        raise damaged(
            f"its header (names, shapes, dtypes, metadata) has CRC32 {found:08x}, but "
            f"{header:08x} was recorded"
        )
    for e in entries:
        if e.name not in sums:
            raise damaged(f"tensor {e.name!r} has no checksum in the record")
    if len(sums) != len(entries):
        raise damaged(f"the checksum record lists {len(sums)} tensors, the header {len(entries)}")
    return sums


def read_header(f: io.BufferedIOBase, path: str) -> Header:
    """The checked header of the open file ``f`` (named ``path`` in errors)."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    if size < 8:
        raise _format_error(
            path,
            f"the file has {size} bytes, fewer than its header needs (it is truncated or not a "
            "safetensors file)",
        )
    n = int.from_bytes(f.read(8), "little")
    if n > MAX_HEADER_LEN:
        raise _format_error(
            path,
            f"its first 8 bytes declare a {n}-byte header, more than safetensors allows "
            f"({MAX_HEADER_LEN}); the file is damaged or not a safetensors file",
        )
    if n > size - 8:
        raise _format_error(
            path,
            f"its first 8 bytes declare a {n}-byte header, but the file has {size} bytes: it is "
            "truncated or not a safetensors file",
        )
    raw = f.read(n)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _format_error(path, f"its header is not UTF-8 text ({e})") from None
    except ValueError as e:
        raise _format_error(path, f"its header does not describe tensors: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise _format_error(path, "its header does not describe tensors: not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not (
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise _format_error(path, "its __metadata__ is not a map of strings to strings")
    # File order; empty tensors at one offset by name, as the header's CRC32 describes them.
    entries = sorted(
        (_entry(path, name, info) for name, info in doc.items()),
        key=lambda e: (e.start, e.end, e.name),
    )
    at = 0
    for entry in entries:
        if entry.start != at:
            raise _format_error(
                path,
                f"tensor {entry.name!r} starts at byte {entry.start} of the data section, where "
                f"{'the previous tensor ends at ' + str(at) if at else 'the first must start at 0'}"
                "; the header is damaged",
            )
        at = entry.end
    available = size - 8 - n
    if at > available:
        first = next(entry for entry in entries if entry.end > available)
        raise FerryError(
            f"{path}: the file is truncated: tensor {first.name!r} needs bytes "
            f"{first.start}..{first.end} of the data section, which holds {available} bytes; the "
            "write was probably interrupted, use an earlier checkpoint"
        )
    if at < available:
        raise _format_error(
            path,
            f"its data section has {available} bytes, {available - at} more than the header "
            "describes (trailing bytes: the file is damaged, or two writes were mixed)",
        )
    metadata = dict(metadata)
    record = metadata.pop(CHECKSUM_KEY, None)
    checksums = None if record is None else _checksums(path, record, entries, metadata)
    return Header(path, 8 + n, entries, metadata, checksums)


def read_bytes(f: io.BufferedIOBase, header: Header, entry: Entry) -> bytearray:
    """The bytes of ``entry``, checked against the record."""
    buf = bytearray(entry.end - entry.start)
    f.seek(header.data_start + entry.start)
    if f.readinto(buf) != len(buf):
        raise FerryError(f"{header.path}: the file shrank while it was read: read it again")
    if header.checksums is not None:
        expected, found = header.checksums[entry.name], zlib.crc32(buf)
        if found != expected:
            raise FerryError(
                f"{header.path}: tensor {entry.name!r} is corrupted: its bytes have CRC32 "
                f"{found:08x}, but {expected:08x} was recorded when the file was written; the "
                "file was damaged after it was saved (disk, copy or transfer), use another "
                "checkpoint"
            )
    return buf


def torch_dtype(header: Header, entry: Entry):
    import torch

    dtype = getattr(torch, DTYPES[entry.dtype][0], None)
    if dtype is None:
        raise FerryError(
            f"{header.path}: tensor {entry.name!r} has dtype {entry.dtype}, which this torch "
            f"({torch.__version__}) has no type for: load it with a newer torch"
        )
    return dtype


def as_tensor(buf: bytearray, dtype, shape: tuple[int, ...]):
    """A host tensor over ``buf`` (no copy) of ``dtype`` and ``shape``."""
    import torch

    if not buf:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


def read_tensor(f: io.BufferedIOBase, header: Header, entry: Entry):
    """The tensor of ``entry`` on the host, its bytes checked."""
    dtype = torch_dtype(header, entry)
    return as_tensor(read_bytes(f, header, entry), dtype, entry.shape)


def read_file(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Every tensor of the file at ``path`` on the host (in file order), and its metadata less
    ferry's record; a damaged file is a ``FerryError`` before any tensor is returned."""
    shown = os.fspath(path)
    with open(path, "rb") as f:
        header = read_header(f, shown)
        # Every dtype is known before the first byte is read.
        for e in header.entries:
            torch_dtype(header, e)
        tensors = {e.name: read_tensor(f, header, e) for e in header.entries}
    return tensors, header.metadata
