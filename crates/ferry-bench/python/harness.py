"""The harness every PyTorch side of `ferry bench` imports: ferry's Python bench harness
(crates/ferry-py/python/ferry/bench_harness.py: importing torch, the `--serve` loop and its
protocol, timing, medians, the optimizer rows), plus what only these scripts need (`load_gpt`).

The harness is loaded by its path in this repository, so a script runs with only torch
installed and always with the harness of its own commit; a script run outside the source tree
takes the installed ferry wheel's. A script imports this module after putting its own directory
first on sys.path, so it works when run by path from any directory:

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness
"""

import importlib.util
import pathlib

_REPO = pathlib.Path(__file__).resolve().parent.joinpath("..", "..", "..").resolve()


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_harness():
    path = _REPO / "crates" / "ferry-py" / "python" / "ferry" / "bench_harness.py"
    if path.is_file():
        return _load("ferry_bench_harness", path)
    try:
        from ferry import bench_harness
    except ImportError as err:
        # The Rust side reads JSON lines: say why this script cannot serve, where it reads.
        import json
        import sys

        print(json.dumps({"error": f"the bench harness is not at {path} and ferry is not "
                                   f"installed ({err}): run the script from ferry's source tree"}),
              flush=True)
        sys.exit(1)
    return bench_harness


_shared = _bench_harness()
globals().update({name: getattr(_shared, name) for name in _shared.__all__})


def load_gpt():
    """tests/torch/gpt.py as a module: the GPT of `ferry train gpt` in PyTorch, the model the
    benches that train ferry's GPT build on PyTorch's side."""
    return _load("ferry_gpt", _REPO / "tests" / "torch" / "gpt.py")
