#!/usr/bin/env python3
"""PyTorch's rows of `ferry bench checkpoint --async --compare-pytorch`: the same GPT (from
tests/torch/gpt.py, the model of `ferry train gpt`, heads of 128) trains with AdamW (fused) under
bf16 autocast on the GPU, and is checkpointed (model and optimizer state in one file) while it
trains, the two ways PyTorch programs do it:

  torch.save from the GPU   torch.save({"model": ..., "optimizer": ...}) of the GPU tensors, then
                            fsync: the training loop waits for all of it.
  pinned snapshot + thread  the expert pattern: pinned host buffers for the whole state,
                            allocated once; each save copies every tensor into them
                            (non_blocking, then a synchronize: the next step writes them), then
                            torch.save and fsync run on a thread while training goes on.

Where the ferry wheel is importable, two more rows show what a PyTorch program gets from it:

  ferry.save_async          ferry.save_async(path, state) of the same state (flattened to
                            names): the snapshot reads what torch queued before the call, the
                            optimizer's step waits only for the copies not yet taken.
  ... + device copy         device_copy=True: the GPU tensors are copied on the GPU in the call,
                            so the steps wait for nothing.

Each mode saves twice ("first", "again"): the second finds its pinned buffers and page cache
warm, as every periodic checkpoint after the first does.

    python3 checkpoint_async.py --layers 16 --width 2048 --batch 8 --seq 1024 --dir /tmp

(`--device cpu` runs it on the host with pageable buffers, to try the script without a GPU.)

Prints one JSON object: params, bytes, the steps without a save (ms) before and after the
saves, and per save: mode, stall_ms (the training thread's wait; ferry's rows also call_ms, the
call alone), snapshot_s (until the state is safe to change), elapsed_s (until the file is
durable), overlapped_step_ms (each step run while the save was in flight), peak_pinned_bytes
(and ferry's rows, peak_extra_host_bytes).
"""

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (the shared helpers, beside this script)

VOCAB = 256
BASELINE_STEPS = 6
MAX_OVERLAP_STEPS = 200


class Training:
    def __init__(self, torch, args):
        self.torch = torch
        torch.manual_seed(0)
        self.model = harness.load_gpt().Gpt(VOCAB, args.seq, args.width, args.layers, args.width // 128)
        self.device = torch.device(args.device)
        self.model.to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        n = args.batch * args.seq
        ids = torch.tensor([(i * 2_654_435_761) % VOCAB for i in range(n + 1)], dtype=torch.int64)
        self.x = ids[:n].view(args.batch, args.seq).to(self.device)
        self.y = ids[1:].to(self.device)

    def step(self):
        """One training step, waited for: milliseconds."""
        torch = self.torch
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.model(self.x)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), self.y)
        loss.backward()
        self.opt.step()
        self.synchronize()
        return (time.perf_counter() - start) * 1e3

    def synchronize(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def state(self):
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}


def tensors(tree):
    """Every tensor of a nested state dict, in a fixed order."""
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from tensors(tree[key])
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from tensors(item)
    elif hasattr(tree, "data_ptr"):
        yield tree


def replace(tree, swap):
    """The state dict with each tensor swapped for swap(tensor)."""
    if isinstance(tree, dict):
        return {key: replace(value, swap) for key, value in tree.items()}
    if isinstance(tree, list):
        return [replace(item, swap) for item in tree]
    if isinstance(tree, tuple):
        return tuple(replace(item, swap) for item in tree)
    if hasattr(tree, "data_ptr"):
        return swap(tree)
    return tree


def write_durably(torch, obj, path):
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_from_gpu(torch, training, path):
    start = time.perf_counter()
    write_durably(torch, training.state(), path)
    seconds = time.perf_counter() - start
    return {"stall_ms": seconds * 1e3, "snapshot_s": seconds, "elapsed_s": seconds,
            "overlapped_step_ms": [], "peak_pinned_bytes": 0}


class PinnedSnapshot:
    """Pinned host buffers for every tensor of the state, allocated once."""

    def __init__(self, torch, state):
        # In the order `replace` walks the state (a state dict's order is the same each time).
        self.buffers = []

        def alloc(t):
            pinned = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self.buffers.append(pinned)
            return pinned

        replace(state, alloc)
        self.bytes = sum(b.numel() * b.element_size() for b in self.buffers if b.is_pinned())

    def save(self, torch, training, path):
        start = time.perf_counter()
        state = training.state()
        buffers = iter(self.buffers)

        def copy(t):
            buffer = next(buffers)
            buffer.copy_(t, non_blocking=True)
            return buffer

        host = replace(state, copy)
        training.synchronize()
        stall = time.perf_counter() - start
        done = {}

        def write():
            write_durably(torch, host, path)
            done["at"] = time.perf_counter()

        writer = threading.Thread(target=write)
        writer.start()
        overlapped = []
        while writer.is_alive() and len(overlapped) < MAX_OVERLAP_STEPS:
            overlapped.append(training.step())
        writer.join()
        return {"stall_ms": stall * 1e3, "snapshot_s": stall,
                "elapsed_s": done["at"] - start, "overlapped_step_ms": overlapped,
                "peak_pinned_bytes": self.bytes}


def named(tree, prefix=""):
    """(name, tensor) for every tensor of a nested state dict, the name its path of keys."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from named(value, f"{prefix}{key}.")
    elif isinstance(tree, (list, tuple)):
        for i, item in enumerate(tree):
            yield from named(item, f"{prefix}{i}.")
    elif hasattr(tree, "data_ptr"):
        yield prefix[:-1], tree


def save_with_ferry(ferry, training, path, device_copy):
    """ferry.save_async of the state while training goes on; the optimizer's step pre-hook
    makes each step wait for the copies it would overwrite."""
    start = time.perf_counter()
    state = dict(named(training.state()))
    called = time.perf_counter()
    pending = ferry.save_async(path, state, device_copy=device_copy)
    stall = time.perf_counter() - start
    call = time.perf_counter() - called
    del state
    overlapped = []
    while not pending.done() and len(overlapped) < MAX_OVERLAP_STEPS:
        overlapped.append(training.step())
    report = pending.wait()
    return {"stall_ms": stall * 1e3, "call_ms": call * 1e3, "snapshot_s": report["snapshot_s"],
            "elapsed_s": report["elapsed_s"], "overlapped_step_ms": overlapped,
            "peak_pinned_bytes": report["peak_pinned_bytes"],
            "peak_extra_host_bytes": report["peak_extra_host_bytes"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ferry-only", action="store_true",
                        help="only the ferry.save_async rows (PyTorch's own take a minute)")
    args = parser.parse_args()
    torch = harness.require_torch(cuda=args.device != "cpu")
    training = Training(torch, args)
    for _ in range(3):
        training.step()
    state = training.state()
    nbytes = sum(t.numel() * t.element_size() for t in tensors(state))
    params = sum(p.numel() for p in training.model.parameters())
    baseline = [training.step() for _ in range(BASELINE_STEPS)]
    path = os.path.join(args.dir, f"ferry-bench-async-torch-{os.getpid()}.pt")
    saves = []
    try:
        if not args.ferry_only:
            for round_ in ("first", "again"):
                print(f"torch.save from the GPU ({round_}) ...", file=sys.stderr, flush=True)
                saves.append({"mode": f"PyTorch torch.save from GPU ({round_})",
                              **save_from_gpu(torch, training, path)})
                os.remove(path)
            pinned = PinnedSnapshot(torch, state)
            for round_ in ("first", "again"):
                print(f"pinned snapshot + thread ({round_}) ...", file=sys.stderr, flush=True)
                saves.append({"mode": f"PyTorch pinned snapshot + thread ({round_})",
                              **pinned.save(torch, training, path)})
                os.remove(path)
            del pinned
        del state
        try:
            import ferry
        except ImportError as e:
            print(f"no ferry.save_async rows: {e}", file=sys.stderr, flush=True)
            ferry = None
        if ferry is not None and args.device == "cuda":
            for device_copy in (False, True):
                for round_ in ("first", "again"):
                    mode = "ferry.save_async from PyTorch" + (" + device copy" if device_copy else "")
                    print(f"{mode} ({round_}) ...", file=sys.stderr, flush=True)
                    saves.append({"mode": f"{mode} ({round_})",
                                  **save_with_ferry(ferry, training, path, device_copy)})
                    os.remove(path)
    finally:
        if os.path.exists(path):
            os.remove(path)
    # Steps without a save again: whether the step itself moved during the run.
    after = [training.step() for _ in range(BASELINE_STEPS)]
    harness.emit({"torch": torch.__version__, "params": params, "bytes": nbytes,
                  "baseline_step_ms": baseline,
                  "baseline_median_ms": statistics.median(baseline),
                  "after_step_ms": after, "after_median_ms": statistics.median(after),
                  "saves": saves})


if __name__ == "__main__":
    main()
