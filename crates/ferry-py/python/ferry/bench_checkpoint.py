"""``python -m ferry.bench --checkpoint``: checkpoints taken while a PyTorch training loop runs,
and the stall the loop feels, for each way to take them.

The loop trains a transformers Llama (random weights, nothing downloaded; bf16 autocast, fp32
weights, ``torch.optim.AdamW(fused=True)``), each step waited for and timed. ``--cases`` picks
``llama`` (``bench_models``' 0.97 B Llama, batch 4 x 1024: model and AdamW state 11.6 GB) and
``llama-16g`` (the same Llama with 28 layers: 1.36 B parameters, 16.4 GB). Each way (a row)
saves the state ``{"model": model.state_dict(), "optim": opt.state_dict()}`` ``--saves`` times
to one path under ``--dir`` (each save replaces the last), at least ``--every`` steps apart and
no sooner than the last save is durable (the steps go on meanwhile: a loop cannot checkpoint
more often than the disk writes its state, which the write column tells); a save still in
flight after ``MAX_STEPS_PER_SAVE`` steps is waited for. The rows:

* ``ferry.save_async(path, state)``, also with ``memory="pinned"``, and with
  ``device_copy=False, memory="pageable"`` (read in place through the drained ring: the default
  before the device copy and the automatic memory); the default after
  ``ferry.reserve_device_copy(state)`` before the loop (the first save's device memory taken in
  setup, not in its call);
* ``dcp.async_save(state, checkpoint_id=dir)`` (torch's ``FileSystemWriter``), and with torch's
  ``DefaultStager`` staging into pinned memory on its own thread (the step waits for the staging
  before the optimizer writes the state), where this torch has it;
* ``dcp.async_save(state, storage_writer=ferry.dcp.FerryStorageWriter(dir))``;
* PyTorch's expert pattern: pinned host buffers for the whole state, allocated once; each save
  copies the state into them (``non_blocking``, then a synchronize) and writes them with
  ``torch.save``, flush and fsync on a thread.

Per save: the call's ms; the first step after it against the baseline step (the median of steps
without a save, taken before and after each row); the steps run while the save was in flight;
the wait for it at the next save point or at the end; and the loop's stall, call + wait + what
the steps in flight took beyond the baseline. Per row also the whole loop's figure, (the loop's
time - its steps x the baseline) / saves, which includes building the state dicts, and the write
rate: state bytes / (call to file durable; ferry's rows take it from ``pending.wait()``'s
report, which the JSON holds too). Each row's last file is read back and a few tensors compared
with the state at its call. Loading rows read the files just written (page cache warm):
``ferry.load`` and safetensors' ``load_file`` of ferry's file, ``dcp.load`` of torch's and of
ferry's DCP directories, onto the training device. Every file written is removed.

``--device cpu`` runs it all on the host, ``--tiny`` implied (Llamas of 2 and 3 layers, 64 wide,
batch 2 x 16).
"""

from __future__ import annotations

import copy
import datetime
import functools
import gc
import glob
import inspect
import json
import os
import shutil
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import torch
from torch.torch_version import TorchVersion

import ferry

from . import bench_harness, bench_models

GB = 1e9
MIB = 1 << 20
CASES = ("llama", "llama-16g")
DEEPER_LAYERS = 28  # llama-16g: bench_models' Llama with 28 layers, 1.36 B parameters
SAMPLES, WARMUP = 8, 3  # baseline steps before and after each row; steps before the first
LOADS = 3  # samples of each loading row
MAX_STEPS_PER_SAVE = 400  # steps run while one save is written before the loop waits for it
STALL_GOAL_MS = 10.0  # ferry's default save, per checkpoint
STEP_GOAL = 1.03  # steps while ferry's default save is in flight / the baseline
FERRY = "ferry.save_async"
FERRY_RESERVED = "ferry.save_async after ferry.reserve_device_copy(state)"
FERRY_PINNED = "ferry.save_async, memory='pinned'"
FERRY_PAGEABLE = "ferry.save_async, device_copy=False, memory='pageable'"
# The device copies drained into pageable memory by all cores but two (the default before the
# snapshot of device copies went at the disk's pace).
FERRY_DRAINED = "ferry.save_async, memory='pageable' (device copies drained)"
DCP = "dcp.async_save, torch's FileSystemWriter"
DCP_PINNED = "dcp.async_save, DefaultStager(pinned, async staging)"
DCP_FERRY = "dcp.async_save, ferry.dcp.FerryStorageWriter"
PINNED_THREAD = "pinned snapshot + torch.save on a thread"
FERRY_LOAD = "ferry.load(path, device)"
SAFETENSORS_LOAD = "safetensors.torch.load_file(path, device)"
DCP_LOAD = "dcp.load, torch's FileSystemReader"
DCP_FERRY_LOAD = "dcp.load, ferry.dcp.FerryStorageReader"


class _Skip(Exception):
    """A row this torch or this environment cannot run; the message says why."""


# -- the state -----------------------------------------------------------------------------------


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``tree`` with each tensor replaced by ``fn(tensor)``, dicts, lists and tuples rebuilt, the
    other values kept."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(v, fn) for v in tree)
    return tree


def _tensors(tree: Any) -> List[torch.Tensor]:
    """The tensors of ``tree`` in the order ``_map_tensors`` visits them."""
    found: List[torch.Tensor] = []
    _map_tensors(tree, found.append)
    return found


def _bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(tree))


def _empty_like(tree: Any, device: str) -> Any:
    return _map_tensors(tree, lambda t: torch.empty_like(t, device=device))


def _leaf(tree: Any, path: Tuple[Any, ...]) -> torch.Tensor:
    return functools.reduce(lambda node, key: node[key], path, tree)


def _workload(case: str, device: str, tiny: bool) -> bench_models.Workload:
    """The case's Llama on ``device``: ``llama`` is bench_models' own, ``llama-16g`` its
    configuration with ``DEEPER_LAYERS`` layers (one more than the tiny one's with ``tiny``)."""
    if case == "llama":
        return bench_models.build("llama", device, tiny)
    from transformers import LlamaForCausalLM

    # bench_models' Llama on the meta device: its configuration, batch and loss, no memory.
    shape = bench_models.build("llama", "meta", tiny)
    config: Any = copy.deepcopy(shape.model.config)
    layers = config.num_hidden_layers
    config.num_hidden_layers = layers + 1 if tiny else DEEPER_LAYERS
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.train()
    batch, seq = shape.inputs[0].shape
    ids = bench_models._token_ids(config.vocab_size, batch, seq, device)
    what = shape.what.replace(f"{layers} layers", f"{config.num_hidden_layers} layers")
    return bench_models.Workload(case, what, shape.batch, model, (ids,), shape.loss_of,
                                 shape.autocast)


class Training:
    """The loop being checkpointed: the workload's model, fused AdamW, one step at a time."""

    def __init__(self, work: bench_models.Workload) -> None:
        self.work = work
        self.device = str(work.device)
        self.cuda = work.device.type == "cuda"
        self.opt = torch.optim.AdamW(work.model.parameters(), lr=1e-4, fused=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step(self, before_update: Callable[[], None] = lambda: None) -> float:
        """One step, waited for: its ms. ``before_update`` runs between backward and the
        optimizer's step."""
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.work.loss().backward()
        before_update()
        self.opt.step()
        self.sync()
        return (time.perf_counter() - start) * 1e3

    def steps(self, n: int) -> List[float]:
        return [self.step() for _ in range(n)]

    def state(self) -> Dict[str, Any]:
        return {"model": self.work.model.state_dict(), "optim": self.opt.state_dict()}

    def checked(self) -> List[Tuple[Any, ...]]:
        """Where a file is compared with the state: the smallest parameter, its first AdamW
        moment and its step count (all three change at every step)."""
        params = list(self.work.model.named_parameters())
        i = min(range(len(params)), key=lambda k: params[k][1].numel())
        return [("model", params[i][0]), ("optim", "state", i, "exp_avg"),
                ("optim", "state", i, "step")]


# -- saves in flight -----------------------------------------------------------------------------


class _Save:
    """A save in flight: ``done()``; ``finish()`` waits for the file and gives (the save's
    report, seconds from the call to the file durable)."""

    def before_update(self) -> None:
        """What the step waits for before the optimizer writes the state: nothing here."""

    def done(self) -> bool:
        raise NotImplementedError

    def finish(self) -> Tuple[Dict[str, Any], float]:
        raise NotImplementedError


class _FerrySave(_Save):
    # before_update waits for nothing: ferry's optimizer step pre-hook waits for its copies.
    def __init__(self, pending: Any) -> None:
        self.pending = pending

    def done(self) -> bool:
        return bool(self.pending.done())

    def finish(self) -> Tuple[Dict[str, Any], float]:
        report = self.pending.wait()
        return report, report["elapsed_s"]


class _FutureSave(_Save):
    """``dcp.async_save``'s: a Future, or an AsyncSaveResponse when staging runs on a thread."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.started = time.perf_counter()
        response = call()
        self.staged = getattr(response, "staging_completion", None)
        self.upload = getattr(response, "upload_completion", response)
        # The callback runs after the Future's waiters are woken: the Event, not result(), says
        # that the time is recorded.
        self.written = threading.Event()
        self.upload.add_done_callback(self._written)

    def _written(self, _: Any) -> None:
        self.finished = time.perf_counter()
        self.written.set()

    def before_update(self) -> None:
        # DCP's staging thread reads the state: the optimizer may write it once staging is done.
        if self.staged is not None:
            self.staged.result()

    def done(self) -> bool:
        return self.written.is_set()

    def finish(self) -> Tuple[Dict[str, Any], float]:
        self.written.wait()
        self.upload.result()
        return {}, self.finished - self.started


class _ThreadSave(_Save):
    """``write()`` on a thread of its own."""

    def __init__(self, started: float, write: Callable[[], None]) -> None:
        self.started = started
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(write,), daemon=True)
        self.thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # raised on the training thread by finish()
            self.error = e
        self.finished = time.perf_counter()

    def done(self) -> bool:
        return not self.thread.is_alive()

    def finish(self) -> Tuple[Dict[str, Any], float]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return {}, self.finished - self.started


def _write_durably(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


class PinnedSnapshot:
    """PyTorch's expert pattern (``PinnedSnapshot`` of crates/ferry-bench/python/
    checkpoint_async.py): pinned host buffers for every tensor of the state, allocated once;
    each save copies the state into them (``non_blocking``, then a synchronize, since the next
    step writes the tensors), then ``torch.save``, flush and fsync run on a thread."""

    def __init__(self, state: Any, cuda: bool) -> None:
        self.cuda = cuda
        self.buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda and t.is_cuda)
                        for t in _tensors(state)]
        self.pinned_bytes = _bytes(self.buffers) if cuda else 0

    def start(self, path: str, state: Any) -> _ThreadSave:
        started = time.perf_counter()
        buffers = iter(self.buffers)

        def copy(t: torch.Tensor) -> torch.Tensor:
            return next(buffers).copy_(t, non_blocking=True)

        host = _map_tensors(state, copy)
        if self.cuda:
            torch.cuda.synchronize()
        return _ThreadSave(started, lambda: _write_durably(host, path))


# -- the rows ------------------------------------------------------------------------------------

# A loading row: (path, a state of the right structure, device) -> the load to time.
LoadMaker = Callable[[str, Any, str], Callable[[], Any]]


@dataclass
class Mode:
    """A way to checkpoint: ``start(path, state)`` begins a save (a ``_Save``); ``read(path,
    state)`` reads its file back on the host for the check; ``loads``: its loading rows.
    ``suffix``: of the path (none for a directory). ``pinned_bytes``: what it pins, where no
    report says (None: unknown)."""

    suffix: str
    start: Callable[[str, Any], _Save]
    read: Callable[[str, Any], Any]
    loads: List[Tuple[str, LoadMaker]] = field(default_factory=list)
    pinned_bytes: Optional[int] = 0
    close: Callable[[], None] = lambda: None
    note: str = ""


def _safetensors_load(path: str, like: Any, device: str) -> Callable[[], Any]:
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise _Skip(f"safetensors is not importable ({e})") from None
    return lambda: load_file(path, device=device)


def _ferry_mode(loads: bool = False, reserve: bool = False,
                **options: Any) -> Callable[[Training], Mode]:
    """``ferry.save_async(path, state, **options)``; with ``loads``, the loading rows of its
    file (ferry's and safetensors'); with ``reserve``, the device copies' memory reserved before
    the loop (``ferry.reserve_device_copy``), where a setup step would do it."""
    rows: List[Tuple[str, LoadMaker]] = [
        (FERRY_LOAD, lambda path, like, device: lambda: ferry.load(path, device)),
        (SAFETENSORS_LOAD, _safetensors_load)] if loads else []

    def make(training: Training) -> Mode:
        note = ""
        if reserve:
            held = ferry.reserve_device_copy(training.state(), device_copy=options.get(
                "device_copy"))
            note = f"reserved {held / GB:.2f} GB before the loop"
        return Mode(
            ".safetensors",
            lambda path, state: _FerrySave(ferry.save_async(path, state, **options)),
            lambda path, like: ferry.load(path), rows, pinned_bytes=None, note=note)

    return make


def _dcp() -> Any:
    """torch.distributed.checkpoint with ``async_save``, or _Skip. No process group is needed:
    without one, DCP saves and loads as the only rank (torch 2.11 to 2.15 at least)."""
    if not torch.distributed.is_available():
        raise _Skip(f"torch {torch.__version__} has no torch.distributed")
    import torch.distributed.checkpoint as dcp

    if not hasattr(dcp, "async_save"):
        raise _Skip(f"torch {torch.__version__}'s DCP has no async_save")
    return dcp


# Where dcp.load finds a checkpoint: the path as checkpoint_id (torch's reader), or ferry's reader.
def _by_id(path: str) -> Dict[str, Any]:
    return {"checkpoint_id": path}


def _by_ferry(path: str) -> Dict[str, Any]:
    import ferry.dcp

    return {"storage_reader": ferry.dcp.FerryStorageReader(path)}


def _dcp_read(dcp: Any, where: Callable[[str], Dict[str, Any]]) -> Callable[[str, Any], Any]:
    """Reads a DCP directory into a host state of the right shapes."""

    def read(path: str, like: Any) -> Any:
        target = _empty_like(like, "cpu")
        dcp.load(target, **where(path))
        return target

    return read


def _dcp_load(dcp: Any, where: Callable[[str], Dict[str, Any]]) -> LoadMaker:
    """A loading row: dcp.load into a state of the right shapes on the device, made once."""

    def make(path: str, like: Any, device: str) -> Callable[[], Any]:
        target = _empty_like(like, device)
        return lambda: dcp.load(target, **where(path))

    return make


def _torch_dcp(training: Training) -> Mode:
    dcp = _dcp()
    return Mode("", lambda path, state: _FutureSave(
        lambda: dcp.async_save(state, checkpoint_id=path)), _dcp_read(dcp, _by_id),
        [(DCP_LOAD, _dcp_load(dcp, _by_id))])


def _torch_dcp_pinned(training: Training) -> Mode:
    dcp = _dcp()
    from torch.distributed.checkpoint import staging

    if not (hasattr(staging, "DefaultStager") and hasattr(staging, "StagingOptions")
            and "async_stager" in inspect.signature(dcp.async_save).parameters):
        raise _Skip(f"torch {torch.__version__}'s DCP has no DefaultStager, StagingOptions or "
                    "async_save(async_stager=)")
    # Pinned memory and non-blocking copies need CUDA: DefaultStager refuses them without.
    cuda = training.cuda
    options = staging.StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                     use_async_staging=True, use_non_blocking_copy=cuda)
    # torch 2.11 and 2.12 close a DefaultStager's copier after each staging, its pinned buffers
    # with it, and a second staging fails (KeyError: <class 'type'>): a new stager per save
    # there. Later ones keep the buffers for the next save.
    reuse = TorchVersion(torch.__version__) >= "2.13"
    stagers: List[Any] = []

    def start(path: str, state: Any) -> _Save:
        if not (reuse and stagers):
            stagers.append(staging.DefaultStager(options))
        stager = stagers[-1]
        return _FutureSave(lambda: dcp.async_save(state, checkpoint_id=path, async_stager=stager))

    def close() -> None:
        for stager in stagers:
            stager.close()

    return Mode("", start, _dcp_read(dcp, _by_id),
                # It stages a copy of every tensor into memory it pins.
                pinned_bytes=_bytes(training.state()) if cuda else 0, close=close,
                note="" if cuda else "on the CPU: staged in pageable memory by blocking copies")


def _ferry_dcp(training: Training) -> Mode:
    dcp = _dcp()
    import ferry.dcp

    return Mode("", lambda path, state: _FutureSave(lambda: dcp.async_save(
        state, storage_writer=ferry.dcp.FerryStorageWriter(path))), _dcp_read(dcp, _by_ferry),
        [(DCP_FERRY_LOAD, _dcp_load(dcp, _by_ferry))], pinned_bytes=None)


def _pinned_thread(training: Training) -> Mode:
    snapshot = PinnedSnapshot(training.state(), training.cuda)
    return Mode(".pt", snapshot.start,
                lambda path, like: torch.load(path, map_location="cpu", weights_only=True),
                pinned_bytes=snapshot.pinned_bytes)


# The rows in the order they run: (name, maker of its Mode, which may raise _Skip).
MODES: List[Tuple[str, Callable[[Training], Mode]]] = [
    (FERRY, _ferry_mode(loads=True)),
    (FERRY_RESERVED, _ferry_mode(reserve=True)),
    (FERRY_PINNED, _ferry_mode(memory="pinned")),
    (FERRY_PAGEABLE, _ferry_mode(device_copy=False, memory="pageable")),
    (FERRY_DRAINED, _ferry_mode(memory="pageable")),
    (DCP, _torch_dcp),
    (DCP_PINNED, _torch_dcp_pinned),
    (DCP_FERRY, _ferry_dcp),
    (PINNED_THREAD, _pinned_thread),
]


# -- measuring -----------------------------------------------------------------------------------


def _saves(training: Training, mode: Mode, path: str, saves: int, every: int,
           checked: List[Tuple[Any, ...]]) -> Tuple[List[Dict[str, Any]], float, List[Any]]:
    """``saves`` saves to ``path``, ``every`` steps after each; a save in flight is waited for at
    the next save point and at the end. Returns each save's raw figures, the loop's ms (its
    calls, steps and waits, and building the state dicts) and the checked tensors as they were
    at the last save's call."""
    records: List[Dict[str, Any]] = []
    save: Optional[_Save] = None
    aside = 0.0  # the bench's own copies of the checked tensors, not the loop's
    started = time.perf_counter()
    for k in range(saves + 1):
        if save is not None:
            waited = time.perf_counter()
            report, durable_s = save.finish()
            records[-1].update(wait_ms=(time.perf_counter() - waited) * 1e3,
                               durable_s=durable_s, report=report)
        if k == saves:
            break
        state = training.state()
        captured = time.perf_counter()
        expected = [_leaf(state, p).detach().to("cpu", copy=True) for p in checked]
        aside += time.perf_counter() - captured
        called = time.perf_counter()
        save = mode.start(path, state)
        call_ms = (time.perf_counter() - called) * 1e3
        del state
        # At least `every` steps, and on while the save is being written: a loop checkpoints no
        # more often than the disk writes its state (the write column), so the next save never
        # waits on this one unless the disk is that slow.
        step_ms, in_flight = [], []
        while len(step_ms) < every or (not save.done() and len(step_ms) < MAX_STEPS_PER_SAVE):
            in_flight.append(not save.done())
            step_ms.append(training.step(save.before_update))
        records.append({"call_ms": call_ms, "step_ms": step_ms, "in_flight": in_flight})
    return records, (time.perf_counter() - started - aside) * 1e3, expected


def summarise(records: List[Dict[str, Any]], loop_ms: float, baseline_ms: float,
              state_bytes: int, pinned_bytes: Optional[int]) -> Dict[str, Any]:
    """A row's figures from its saves' raw ones (each gets its own added)."""
    for r in records:
        during = [ms for ms, flying in zip(r["step_ms"], r["in_flight"]) if flying]
        r.update(stall_ms=r["call_ms"] + r["wait_ms"] + sum(ms - baseline_ms for ms in during),
                 first_step_ratio=r["step_ms"][0] / baseline_ms, steps_during=len(during),
                 during_mean_ratio=statistics.mean(during) / baseline_ms if during else None,
                 write_gbps=state_bytes / r["durable_s"] / GB)
    steps = sum(len(r["step_ms"]) for r in records)
    during = [ms for r in records for ms, flying in zip(r["step_ms"], r["in_flight"]) if flying]
    pinned = [r["report"]["peak_pinned_bytes"] for r in records
              if "peak_pinned_bytes" in r["report"]]

    def median(key: str) -> float:
        return bench_harness.median([r[key] for r in records])

    return {"saves": records, "baseline_ms": baseline_ms, "loop_ms": loop_ms,
            "stall_ms_median": median("stall_ms"),
            "stall_ms_max": max(r["stall_ms"] for r in records),
            "loop_ms_per_checkpoint": (loop_ms - steps * baseline_ms) / len(records),
            "call_ms_median": median("call_ms"),
            "first_step_ratio_median": median("first_step_ratio"),
            "steps_during_median": median("steps_during"),
            "during_mean_ratio": statistics.mean(during) / baseline_ms if during else None,
            "write_gbps_median": median("write_gbps"),
            "pinned_bytes": max(pinned) if pinned else pinned_bytes}


def _check(loaded: Any, checked: List[Tuple[Any, ...]], expected: List[Any]) -> str:
    """"ok", or which checked tensor of the file differs from the state at the save's call."""
    for path, want in zip(checked, expected):
        if not torch.equal(_leaf(loaded, path).detach().cpu(), want):
            return f"{'.'.join(map(str, path))} differs from the state at the call"
    return "ok"


def _loads(training: Training, mode: Mode, path: str, state_bytes: int) -> Dict[str, Any]:
    """The mode's loading rows: ``LOADS`` samples each, synchronized, of its file."""
    rows: Dict[str, Any] = {}
    for name, make in mode.loads:
        try:
            load = make(path, training.state(), training.device)
        except _Skip as why:
            rows[name] = {"skipped": str(why)}
            print(f"{name}: skipped, {why}")
            continue
        seconds = []
        for _ in range(LOADS):
            training.sync()
            start = time.perf_counter()
            loaded = load()
            if not training.cuda:
                _touch(loaded)
            training.sync()
            seconds.append(time.perf_counter() - start)
            del loaded
        rows[name] = {"s": seconds,
                      "gbps": state_bytes / bench_harness.median(seconds) / GB}
    return rows


def _touch(tree: Any) -> None:
    """Reads a byte of every page of every host tensor: safetensors' ``load_file`` onto the
    host maps the file and reads nothing until used, where the others have read it all."""
    for t in _tensors(tree):
        flat = t.detach().reshape(-1)
        if flat.numel():
            flat[:: max(1, 4096 // t.element_size())].sum()


def _failures() -> Tuple[Type[BaseException], ...]:
    """What a failed row raises: DCP reports a failure as a CheckpointException, which is a
    BaseException."""
    dcp = sys.modules.get("torch.distributed.checkpoint")
    return (Exception, getattr(dcp, "CheckpointException", Exception))


def _remove(prefix: str) -> None:
    """Every file and directory whose path starts with ``prefix``."""
    for path in glob.glob(glob.escape(prefix) + "*"):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def _free(cuda: bool) -> None:
    """Between rows: what a row cached (ferry's device blocks, its pinned pool, torch's cache)
    goes back, so each row's first save starts as a fresh process's would."""
    gc.collect()
    if cuda:
        bench_models._free_memory()
        ferry.empty_cache()
        ferry.empty_cache("cpu")


def _chosen(ways: Optional[str]) -> List[Tuple[str, Callable[[Training], Mode]]]:
    """The rows ``--ways`` names (words any of which a row's name contains), ferry's default
    first whatever it says: the goals are judged on it."""
    if not ways:
        return MODES
    wanted = [w.strip() for w in ways.split(",") if w.strip()]
    return MODES[:1] + [(n, m) for n, m in MODES[1:] if any(w in n for w in wanted)]


def measure(work: bench_models.Workload, args: Any) -> Dict[str, Any]:
    """Every row on ``work``'s loop, with ``args``' saves, steps, samples and directory."""
    training = Training(work)
    samples = SAMPLES if args.samples is None else args.samples
    training.steps(WARMUP if args.warmup is None else args.warmup)
    checked = training.checked()
    state_bytes = _bytes(training.state())
    print(f"{work.name}: {work.what}; {work.parameters / 1e6:.1f} M parameters; {work.batch}; "
          f"model + AdamW state {state_bytes / GB:.2f} GB ({state_bytes} bytes)", flush=True)
    result: Dict[str, Any] = {
        "what": work.what, "batch": work.batch, "parameters": work.parameters,
        "state_bytes": state_bytes, "baselines_ms": [training.steps(samples)], "modes": {},
        "loads": {}}
    prefix = os.path.join(args.dir, f"ferry-bench-checkpoint-{os.getpid()}-")
    for k, (name, make) in enumerate(_chosen(getattr(args, "ways", None))):
        try:
            mode = make(training)
        except _Skip as why:
            print(f"{name}: skipped, {why}")
            result["modes"][name] = {"skipped": str(why)}
            continue
        path = f"{prefix}{k}{mode.suffix}"
        pinned, note = mode.pinned_bytes, mode.note
        print(f"{work.name}: {name} ...", flush=True)
        try:
            records, loop_ms, expected = _saves(training, mode, path, args.saves, args.every,
                                                checked)
            check = _check(mode.read(path, training.state()), checked, expected)
            loads = _loads(training, mode, path, state_bytes)
        except _failures() as e:  # one failed row must not end the others
            result["modes"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: failed, {type(e).__name__}: {e}")
            continue
        finally:
            mode.close()
            del mode  # its buffers, before the steps without a save
            _remove(prefix)
            _free(training.cuda)
        before, after = result["baselines_ms"][-1], training.steps(samples)
        result["baselines_ms"].append(after)
        row = result["modes"][name] = {
            **summarise(records, loop_ms, bench_harness.median(before + after), state_bytes,
                        pinned), "check": check, "note": note}
        # Each row as it lands: a run cut short still leaves the rows it finished.
        print(f"{work.name}: {name}: stall {row['stall_ms_median']:.1f} ms/ckpt median (max "
              f"{row['stall_ms_max']:.1f}), call {row['call_ms_median']:.1f} ms, first step "
              f"{row['first_step_ratio_median']:.3f}x, steps during "
              f"{_cell(row['during_mean_ratio'], '.3f', 'x')}, file {check}", flush=True)
        for load, figures in loads.items():
            result["loads"][load] = {"file": name, **figures}
    return result


# -- the report ----------------------------------------------------------------------------------


def _cell(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def judge(result: Dict[str, Any]) -> List[Dict[str, str]]:
    """The goals on one case's figures: each ``{"goal", "verdict", "detail"}``, the verdict
    "met", "not met" or "n/a" (not measured)."""
    goals = []

    def add(goal: str, verdict: str, detail: str) -> None:
        goals.append({"goal": goal, "verdict": verdict, "detail": detail})

    row = result["modes"].get(FERRY, {})
    stall_goal = f"{FERRY} stall <= {STALL_GOAL_MS:.0f} ms per checkpoint"
    step_goal = f"steps while it is in flight <= {STEP_GOAL}x the baseline"
    if "stall_ms_median" not in row:
        add(stall_goal, "n/a", f"the row did not run ({row.get('error') or row.get('skipped')})")
        add(step_goal, "n/a", "the row did not run")
    else:
        stall = row["stall_ms_median"]
        add(stall_goal, "met" if stall <= STALL_GOAL_MS else "not met",
            f"median {stall:.1f} ms, max {row['stall_ms_max']:.1f} ms over "
            f"{len(row['saves'])} saves; the whole loop: {row['loop_ms_per_checkpoint']:.1f} ms "
            "per checkpoint")
        ratio = row["during_mean_ratio"]
        if ratio is None:
            add(step_goal, "met", "every save was durable before the step after its call")
        else:
            add(step_goal, "met" if ratio <= STEP_GOAL else "not met",
                f"{ratio:.3f}x over {sum(r['steps_during'] for r in row['saves'])} steps")
    reserved = result["modes"].get(FERRY_RESERVED, {})
    if "stall_ms_max" in reserved:
        worst = reserved["stall_ms_max"]
        add(f"{FERRY_RESERVED}: every save's stall <= {STALL_GOAL_MS:.0f} ms, the first included",
            "met" if worst <= STALL_GOAL_MS else "not met",
            f"max {worst:.1f} ms, median {reserved['stall_ms_median']:.1f} ms over "
            f"{len(reserved['saves'])} saves")
    ours, theirs = (result["loads"].get(name, {}).get("gbps")
                    for name in (FERRY_LOAD, SAFETENSORS_LOAD))
    load_goal = "ferry.load >= safetensors' load_file, GB/s"
    if ours is None or theirs is None:
        add(load_goal, "n/a", "one of the two loading rows did not run")
    else:
        add(load_goal, "met" if ours >= theirs else "not met",
            f"{ours:.2f} GB/s against {theirs:.2f} GB/s")
    return goals


def table(name: str, result: Dict[str, Any], args: Any) -> List[str]:
    """A case's lines: what it is, the saving rows, the loading rows, the goals."""
    if "modes" not in result:
        return [f"**{name}**: {result['note']}", ""]
    baselines = [ms for sample in result["baselines_ms"] for ms in sample]
    lines = [f"**{name}**: {result['what']}; {result['parameters'] / 1e6:.1f} M parameters; "
             f"{result['batch']}; model + AdamW state {result['state_bytes'] / GB:.2f} GB "
             f"({result['state_bytes']} bytes). "
             f"{args.saves} saves per way, {args.every} steps apart, into {args.dir}; baseline "
             f"step {bench_harness.median(baselines):.1f} ms (median of all "
             f"{len(baselines)} steps without a save; each row's own: before and after it).", ""]
    cells = []
    for mode, row in result["modes"].items():
        if "stall_ms_median" not in row:
            cells.append([mode, row.get("skipped") or row.get("error", "")] + [""] * 10)
            continue
        pinned = row["pinned_bytes"]
        cells.append([
            mode + (f" ({row['note']})" if row["note"] else ""), f"{row['stall_ms_median']:.1f}",
            f"{row['stall_ms_max']:.1f}", f"{row['loop_ms_per_checkpoint']:.1f}",
            f"{row['call_ms_median']:.1f}", f"{row['first_step_ratio_median']:.3f}x",
            f"{row['steps_during_median']:g}", _cell(row["during_mean_ratio"], ".3f", "x"),
            f"{row['write_gbps_median']:.2f}",
            _cell(None if pinned is None else pinned / MIB, ".0f"),
            f"{row['baseline_ms']:.1f}", row["check"]])
    lines += bench_harness.table(
        ["way", "stall ms/ckpt median", "max", "whole loop ms/ckpt", "call ms", "first step",
         "steps during", "their mean", "write GB/s", "pinned MiB", "baseline ms", "file"], cells)
    lines += ["", f"Loading the files just written (page cache warm), onto {result['device']}, "
              f"median of {LOADS}:", ""]
    lines += bench_harness.table(
        ["load", "file of", "GB/s", "ms"],
        [[load, row["file"], f"skipped: {row['skipped']}", ""] if "skipped" in row else
         [load, row["file"], f"{row['gbps']:.2f}", f"{bench_harness.median(row['s']) * 1e3:.1f}"]
         for load, row in result["loads"].items()])
    lines += [""] + [f"- {g['goal']}: **{g['verdict']}**: {g['detail']}"
                     for g in result["goals"]] + [""]
    return lines


def run(args: Any) -> int:
    """The checkpoint benchmark for bench.py's parsed arguments (``cases``, ``saves``,
    ``every``, ``dir``, ``device``, ``tiny``, ``samples``, ``warmup``, ``json``)."""
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not (torch.cuda.is_available() and ferry.cuda_available()):
        print("no CUDA device: the checkpoint benchmark trains on one (--device cpu runs it "
              "on the host)")
        return 0
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case {', '.join(unknown)}: choose from {', '.join(CASES)}")
        return 2
    if args.saves < 1 or args.every < 1:
        print("--saves and --every must be >= 1")
        return 2
    if not os.path.isdir(args.dir):
        print(f"--dir {args.dir} is not a directory")
        return 2
    tiny = args.tiny or not cuda
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device = torch.cuda.get_device_name(0) if cuda else f"CPU, {torch.get_num_threads()} threads"
    record: Dict[str, Any] = {
        "date": date, "torch": torch.__version__, "ferry": ferry.__version__, "device": device,
        "tiny": tiny, "saves": args.saves, "every": args.every, "dir": args.dir, "cases": {}}
    with warnings.catch_warnings():
        # DCP says, at each save and load, that without a process group it runs as one rank,
        # and at each save after a row's first that it overwrites the row's directory.
        warnings.filterwarnings("ignore", message=".*in a single process")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        for name in names:
            try:
                work = _workload(name, args.device, tiny)
            except ImportError as e:
                print(f"{name}: skipped, {e}")
                record["cases"][name] = {"note": f"skipped: {e}"}
                continue
            result = measure(work, args)
            result["device"] = str(work.device)
            result["goals"] = judge(result)
            record["cases"][name] = result
            del work
            _free(cuda)
    print(f"\n## Checkpoints while training, {date}, torch {record['torch']}, ferry "
          f"{record['ferry']}, {device}{' (tiny models)' if tiny else ''}\n")
    for name, result in record["cases"].items():
        print("\n".join(table(name, result, args)))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)
    return 0
