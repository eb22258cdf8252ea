#!/usr/bin/env python3
"""Checks ferry's values and gradients against PyTorch's, on the same inputs, for expressions
covering every op. Reads the JSON written by `cargo run -p ferry-tests --example parity`.

    python3 tests/torch/parity.py parity.json [--device cuda]
    python3 tests/torch/parity.py --check-names    (no torch needed)

The expressions are the parity cases of ferry's op registry (tests/src/registry), whose names
this script reads from tests/torch/registry.json (written from the registry and kept up to date
by the suite). Each is mirrored here in PyTorch (float32, TF32 off), backward of sum(out * probe)
gives the gradients; both are compared by ||ferry - torch|| / ||torch||. Exits 1 on a mismatch,
and when the mirrors here, the registry and the report do not name the same cases.
"""
import json
import pathlib
import sys

REGISTRY = pathlib.Path(__file__).with_name("registry.json")

CASES = {
    "add_broadcast": lambda x: x[0] + x[1],
    "sub_broadcast": lambda x: x[0] - x[1],
    "mul_transposed": lambda x: x[0].t() * x[1],
    "div_abs": lambda x: x[0] / (x[1].abs() + 1.0),
    "scalar_ops": lambda x: (x[0] * 2.5 - 1.5) / 3.0,
    "neg_exp": lambda x: (-x[0]).exp(),
    "log": lambda x: (x[0].abs() + 0.5).log(),
    "relu": lambda x: x[0].relu(),
    "tanh": lambda x: x[0].tanh(),
    "sigmoid": lambda x: x[0].sigmoid(),
    "sqrt": lambda x: (x[0].abs() + 0.1).sqrt(),
    "powf": lambda x: (x[0].abs() + 0.5) ** 2.5,
    "sum_all": lambda x: x[0].sum(),
    "mean_all": lambda x: x[0].mean(),
    "sum_axis_keepdim": lambda x: x[0].sum(1, keepdim=True),
    "mean_axis": lambda x: x[0].mean(-1),
    "max_axis": lambda x: x[0].max(1).values,
    "argmax": lambda x: x[0].argmax(0).float(),
    "matmul": lambda x: x[0] @ x[1],
    "matmul_batched_broadcast": lambda x: x[0] @ x[1],
    "matmul_transposed": lambda x: x[0].t() @ x[1].t(),
    "linear": lambda x: torch.nn.functional.linear(x[0], x[1], x[2]),
    "linear_relu": lambda x: torch.nn.functional.linear(x[0], x[1], x[2]).relu(),
    "transpose_reshape_narrow": lambda x: x[0].transpose(0, 1).reshape(3, 8).narrow(1, 2, 4),
    "chunk_cat": lambda x: torch.cat([x[0].chunk(3, 0)[2], x[0].chunk(3, 0)[0]], 1),
    "unsqueeze_broadcast_squeeze": lambda x: x[0].unsqueeze(0).expand(3, 5).sum(0, keepdim=True).squeeze(0),
    "cast_f16_round_trip": lambda x: x[0].half().float() * x[1],
    "to_dtype_square": lambda x: (x[0].double() * x[0].double()).float(),
    "softmax": lambda x: x[0].softmax(1),
    "log_softmax_axis0": lambda x: x[0].log_softmax(0),
    "cross_entropy": lambda x: torch.nn.functional.cross_entropy(x[0], x[1]),
    "index_select": lambda x: x[0].index_select(0, x[1]),
    "index_add": lambda x: x[0].index_add(0, x[1], x[2]),
    "gather": lambda x: x[0].gather(1, x[1]),
    # src larger than the index: only the covered part counts (PyTorch's backward wants src cut
    # to the index's shape, which gives the same gradient, zero outside).
    "scatter_add": lambda x: x[0].scatter_add(1, x[1], x[2][tuple(slice(0, n) for n in x[1].shape)]),
    "embedding": lambda x: torch.nn.functional.embedding(x[1], x[0]),
    "layer_norm_affine": lambda x: torch.nn.functional.layer_norm(x[0], (16,), x[1], x[2], 1e-5),
    "attention_causal_gqa": lambda x: torch.nn.functional.scaled_dot_product_attention(
        x[0], x[1], x[2], is_causal=True, enable_gqa=True),
    "attention_cross_scaled": lambda x: torch.nn.functional.scaled_dot_product_attention(
        x[0], x[1], x[2], scale=0.3),
    "layer_norm_plain_3d": lambda x: torch.nn.functional.layer_norm(x[0], (3, 8), eps=1e-5),
    "cross_entropy_ignore_index": lambda x: torch.nn.functional.cross_entropy(x[0], x[1], ignore_index=2),
    "comparisons": lambda x: (x[0] > x[1]).float() * 4.0 + (x[0] <= x[1]).float() * 2.0 + (x[0] == x[0]).float(),
    "gelu": lambda x: torch.nn.functional.gelu(x[0] * 2.0),
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x[0] * 2.0, approximate="tanh"),
    "silu": lambda x: torch.nn.functional.silu(x[0] * 2.0),
    "sin_cos": lambda x: (x[0] * 3.0).sin() + x[0].cos() * x[1],
    "clamp": lambda x: (x[0] * 2.0).clamp(-1.0, 0.5),
    "maximum_broadcast": lambda x: torch.maximum(x[0], x[1]),
    "minimum_ties": lambda x: torch.minimum(x[0], x[0].clamp(-0.5, 0.5)),
    "maximum_ties": lambda x: torch.maximum(x[0], x[0].clamp(-0.5, 0.5)),
    "where_broadcast": lambda x: torch.where(x[0] > 0, x[0] * x[1], x[2]),
    "masked_fill": lambda x: x[0].masked_fill(x[1] > 2, -2.0),
    "copy": lambda x: x[0].clone(),
    "contiguous": lambda x: x[0].t().contiguous(),
    "permute": lambda x: x[0].permute(2, 0, 1) * x[1],
    "stack": lambda x: torch.stack([x[0], x[1].t()], 1),
    "conv2d_stride_pad_dilation_groups": lambda x: torch.nn.functional.conv2d(
        x[0], x[1], x[2], stride=2, padding=1, dilation=2, groups=2),
    "conv2d_plain": lambda x: torch.nn.functional.conv2d(x[0], x[1]),
    "max_pool2d": lambda x: torch.nn.functional.max_pool2d(x[0], 3, 2, 1),
    "avg_pool2d": lambda x: torch.nn.functional.avg_pool2d(x[0], 3, 2, 1, count_include_pad=True),
    # ferry's mask (the zeros of its output) applied the PyTorch way; the fraction kept is
    # checked in main().
    "dropout": lambda x: x[0] * (FERRY_OUTPUT["dropout"] != 0) / 0.75,
    "rms_norm_weighted": lambda x: torch.nn.functional.rms_norm(x[0], (16,), x[1], 1e-5),
    "rms_norm_plain": lambda x: torch.nn.functional.rms_norm(x[0], (8,), eps=1e-3),
}


# Each case's output as ferry computed it, for the cases that need it (dropout's mask).
FERRY_OUTPUT = {}


def tensor(entry, device, dtype):
    return torch.tensor(entry["data"], dtype=torch.float64).reshape(entry["shape"]).to(device=device, dtype=dtype)


def rel(a, b):
    denom = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / denom if denom > 0 else diff


def registry_names(path=REGISTRY):
    """The names of the registry's parity cases, in its order."""
    with open(path) as f:
        return [c["name"] for c in json.load(f)["cases"] if c["parity"]]


def name_mismatches(registry, mirrored, reported=None):
    """What differs between the registry's parity cases, the mirrors here and (if given) a
    report's cases: one line each, empty when all agree."""
    problems = []
    for name in sorted(set(registry) - set(mirrored)):
        problems.append(f"{name}: a parity case of the registry with no PyTorch mirror here")
    for name in sorted(set(mirrored) - set(registry)):
        problems.append(f"{name}: mirrored here but not a parity case of the registry")
    if reported is not None:
        for name in sorted(set(registry) ^ set(reported)):
            problems.append(f"{name}: in one of the registry and the report only (rerun the example)")
    return problems


def check_names():
    problems = name_mismatches(registry_names(), CASES)
    for line in problems:
        print(line)
    print(f"{len(registry_names())} parity cases in {REGISTRY.name}, {len(CASES)} mirrored here; "
          f"{len(problems)} mismatch(es)")
    return 1 if problems else 0


def main():
    if "--check-names" in sys.argv:
        return check_names()
    global torch
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = sys.argv[1] if len(sys.argv) > 1 else "parity.json"
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
    report = json.load(open(path))
    problems = name_mismatches(registry_names(), CASES, [c["name"] for c in report["cases"]])
    if problems:
        print("\n".join(problems))
        return 1
    tol = 2e-5
    worst, failures = 0.0, []
    print(f"ferry on {report['device']} vs torch {torch.__version__} on {device}, float32, TF32 off")
    print(f"{'expression':32} {'value rel err':>14} {'grad rel err':>14}")
    for case in report["cases"]:
        xs = []
        for entry, is_float in zip(case["inputs"], case["input_is_float"]):
            t = tensor(entry, device, torch.float32 if is_float else torch.int64)
            xs.append(t.requires_grad_() if is_float else t)
        FERRY_OUTPUT[case["name"]] = tensor(case["output"], device, torch.float32)
        if case["name"] == "dropout":
            kept = (FERRY_OUTPUT["dropout"] != 0).double().mean().item()
            if abs(kept - 0.75) > 0.1:
                print(f"dropout kept {kept:.3f} of the elements, expected about 0.75")
                failures.append("dropout (kept fraction)")
        out = CASES[case["name"]](xs)
        ours = tensor(case["output"], device, torch.float64)
        value_err = rel(ours, out.detach())
        grad_err = 0.0
        if out.requires_grad:
            (out * tensor(case["probe"], device, torch.float32)).sum().backward()
            for x, g in zip(xs, case["grads"]):
                if x.dtype.is_floating_point:
                    if g is None:
                        grad_err = float("inf")
                        continue
                    grad_err = max(grad_err, rel(tensor(g, device, torch.float64), x.grad))
        worst = max(worst, value_err, grad_err)
        flag = "" if max(value_err, grad_err) <= tol else "  <-- MISMATCH"
        if flag:
            failures.append(case["name"])
        print(f"{case['name']:32} {value_err:14.2e} {grad_err:14.2e}{flag}")
    print(f"{len(report['cases'])} expressions, worst relative error {worst:.2e} (tolerance {tol:.0e}); "
          f"{len(report['cases']) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
