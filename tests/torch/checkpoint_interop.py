#!/usr/bin/env python3
"""Checkpoint interop between ferry and Python's safetensors, both ways, for an MLP 64-128-10
(`nn.Sequential(Linear(64, 128), ReLU(), Linear(128, 10))`, keys 0.weight, 0.bias, 2.weight,
2.bias). Driven by the ferry test `checkpoint_interop` (tests/tests/checkpoint_interop.rs):

    python3 tests/torch/checkpoint_interop.py DIR [--torch] [--device cuda]

1. Reads DIR/ferry_model.safetensors and DIR/ferry_io.safetensors (input `x`, ferry's `logits`)
   written by ferry: checks keys, dtypes and shapes, runs the model on `x` and compares with
   ferry's logits.
2. Writes DIR/python_model.safetensors (a freshly initialised model) and
   DIR/python_io.safetensors (an input and this side's logits) for ferry to load and check.

Without --torch only numpy and safetensors are needed (the forward pass is written out in
numpy); with --torch the model is a real torch.nn.Sequential, loaded with
load_state_dict(strict=True) and saved with safetensors.torch.save_file. Exits 1 on a mismatch.
"""
import os
import sys

import numpy as np
from safetensors.numpy import load_file, save_file

KEYS = {"0.weight": (128, 64), "0.bias": (128,), "2.weight": (10, 128), "2.bias": (10,)}


def numpy_forward(state, x):
    h = np.maximum(x @ state["0.weight"].T + state["0.bias"], 0.0)
    return h @ state["2.weight"].T + state["2.bias"]


def check_ferry_file(directory, use_torch, device):
    state = load_file(os.path.join(directory, "ferry_model.safetensors"))
    io = load_file(os.path.join(directory, "ferry_io.safetensors"))
    if set(state) != set(KEYS):
        sys.exit(f"keys {sorted(state)} != {sorted(KEYS)}")
    for key, shape in KEYS.items():
        if state[key].dtype != np.float32 or state[key].shape != shape:
            sys.exit(f"{key}: {state[key].dtype} {state[key].shape}, want float32 {shape}")
    if use_torch:
        import torch

        model = make_torch_model(torch).to(device)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
        with torch.no_grad():
            logits = model(torch.from_numpy(io["x"]).to(device)).cpu().numpy()
    else:
        logits = numpy_forward(state, io["x"])
    err = np.abs(logits - io["logits"]).max() / max(np.abs(io["logits"]).max(), 1e-12)
    if not err < 1e-5:
        sys.exit(f"logits of ferry's checkpoint differ: relative error {err:.3g}")
    print(f"ferry checkpoint opened in Python: keys, dtypes, shapes ok; logits rel. error {err:.2g}")


def make_torch_model(torch):
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def write_python_files(directory, use_torch, device):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    if use_torch:
        import torch
        from safetensors.torch import save_file as torch_save

        torch.manual_seed(7)
        model = make_torch_model(torch).to(device)
        with torch.no_grad():
            logits = model(torch.from_numpy(x).to(device)).cpu().numpy()
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        torch_save(state, os.path.join(directory, "python_model.safetensors"))
    else:
        state = {
            k: (rng.standard_normal(shape) * 0.1).astype(np.float32) for k, shape in KEYS.items()
        }
        logits = numpy_forward(state, x).astype(np.float32)
        save_file(state, os.path.join(directory, "python_model.safetensors"))
    save_file({"x": x, "logits": logits}, os.path.join(directory, "python_io.safetensors"))
    print(f"wrote python_model.safetensors ({'torch' if use_torch else 'numpy'})")


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    use_torch = "--torch" in args
    device = args[args.index("--device") + 1] if "--device" in args else "cpu"
    directory = args[0]
    check_ferry_file(directory, use_torch, device)
    write_python_files(directory, use_torch, device)


if __name__ == "__main__":
    main()
