"""``ferry.optim.OffloadAdamW``: torch's AdamW with its state in host memory, stepped on the CPU
by ferry while backward still runs on the GPU.

A ``torch.optim.Optimizer`` for models larger than the GPU would hold with their optimizer
state: the fp32 master weights and Adam's two moments (12 bytes per parameter) live in host
memory, and the GPU keeps only the parameters (fp32, bf16 or f16). How a step runs:

- Each parameter's gradient leaves for a pinned landing buffer the moment backward has
  accumulated it (``register_post_accumulate_grad_hook``), on ferry's gradient stream, after the
  work queued on torch's current stream; ``p.grad`` is then ``None`` and torch's allocator reuses
  its memory once the copy has read it (``record_stream``).
- ferry's threads step it on all cores but one (AVX-512 or AVX2, torch.optim.AdamW's update with
  ``amsgrad=False``, within a few ulp of it) as soon as it lands, and write the new weights in
  the parameter's dtype; another thread queues their upload on a second copy stream, so the link
  carries gradients down and weights up at once, while backward computes. Nothing here holds the
  GIL while it waits or computes.
- ``step()`` waits for the CPU steps of the gradients backward produced, steps parameters whose
  ``.grad`` was set some other way, and makes torch's current stream wait on the device for the
  uploads: the next forward reads the new weights, and the host never waits for the copies.

What differs from ``torch.optim.AdamW``: gradients are consumed by backward, so
``torch.nn.utils.clip_grad_norm_`` and torch's ``GradScaler`` after ``backward()`` see no
gradients. For clipping, loss scaling or accumulating gradients over several backward passes,
build it with ``hold_gradients=True``: each gradient is then added (in f32) to one held in host
memory for the step, and ``clip_grad_norm_(max_norm)`` and ``scale_grads_(factor)`` (unscaling:
``1 / scale``; it returns whether a gradient holds an infinity or a NaN, so the step can be
skipped, as ``GradScaler`` does) act on the held gradients, their global norm taken on the host
as they landed; the CPU steps run at ``step()`` (after backward, or beside the next step's with
the delayed update) and cost 4 host bytes per parameter. Without it, a second gradient in one
step raises at ``step()``. The learning rate and other hyperparameters
of a group are read when its gradients arrive, so a scheduler's change applies from the next
backward, as it does for torch's AdamW; bias correction counts the optimizer's steps (torch
counts each parameter's: they differ for a parameter left without a gradient in some step).
``state_dict()`` has torch AdamW's layout plus
``master`` (the fp32 weights) in each parameter's state; ``load_state_dict`` takes that or a
torch AdamW state dict (the master weights then come from the parameters).
"""

from __future__ import annotations

import functools
import math
import weakref

from . import _ferry, _source, _torch, to_torch

__all__ = ["OffloadAdamW"]


def _hyper(group):
    """A parameter group's ``(lr, betas, eps, weight_decay)``, as the engine takes them."""
    betas = tuple(float(b) for b in group["betas"])
    return float(group["lr"]), betas, float(group["eps"]), float(group["weight_decay"])


def _optimizer_base():
    return _torch().optim.Optimizer


class OffloadAdamW(_optimizer_base()):
    """AdamW over ``params`` (CUDA tensors on one GPU, contiguous, float32, bfloat16 or float16)
    with its state in host memory; arguments as ``torch.optim.AdamW``'s (``amsgrad`` and
    ``maximize`` are not supported). See the module docs for what a step does.

    ``delayed_update=True``: ``step()`` returns without waiting for the CPU, whose steps run
    beside the next forward and backward; those compute with the weights of one step earlier
    (ZeRO-Offload's delayed parameter update). ``flush()`` brings the weights up to date.

    ``hold_gradients=True``: gradients add up in host memory until ``step()``, for clipping
    (``clip_grad_norm_``), loss scaling (``scale_grads_``) and accumulation over several
    backward passes (see the module docs).

    ``pinned_limit=N``: at most N bytes of pinned memory. When a landing and an upload buffer per
    parameter would take more (or, without a limit, more than ferry's pinned budget has left),
    they are staged: taken as each gradient goes down and each parameter is stepped, given back
    once used; ``staging`` then says so. Staging rules out ``delayed_update``."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        delayed_update: bool = False,
        hold_gradients: bool = False,
        pinned_limit: int | None = None,
    ):
        torch = _torch()
        if amsgrad or maximize:
            raise ValueError(
                "OffloadAdamW steps torch.optim.AdamW's update with amsgrad=False and "
                "maximize=False; use torch.optim.AdamW for the others"
            )
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not float(value) >= 0.0:
                raise ValueError(f"OffloadAdamW: invalid {name} {value}: it must be >= 0")
        for i, beta in enumerate(betas):
            if not 0.0 <= float(beta) < 1.0:
                raise ValueError(f"OffloadAdamW: invalid beta {i} {beta}: it must be in [0, 1)")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            amsgrad=False, maximize=False,
        )
        super().__init__(params, defaults)
        every = [p for group in self.param_groups for p in group["params"]]
        if len({id(p) for p in every}) != len(every):
            raise ValueError("OffloadAdamW: a parameter appears twice")
        # Frozen parameters (requires_grad=False) stay in the groups, as torch's AdamW keeps
        # them, but never get state: the engine steps the others. `_index[k]` is the position
        # among every parameter (the state dict's index) of the engine's parameter k.
        self._index = [i for i, p in enumerate(every) if p.requires_grad]
        if not self._index:
            raise ValueError(
                "OffloadAdamW: no parameter requires grad, so none would ever be stepped"
            )
        self._params = [every[i] for i in self._index]
        groups = [group for group in self.param_groups for _ in group["params"]]
        self._group = [groups[i] for i in self._index]
        first = self._params[0]
        for k, p in enumerate(self._params):
            i = self._index[k]
            problem = None
            if not p.is_cuda:
                problem = (
                    f"is on {p.device}; optimizer offload keeps the state of GPU parameters on "
                    "the host: move the model to the GPU first, or use torch.optim.AdamW"
                )
            elif p.device != first.device:
                problem = f"is on {p.device} and parameter 0 on {first.device}: one GPU per optimizer"
            elif p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                problem = f"is {p.dtype}; offload steps float32, bfloat16 or float16 parameters"
            elif not p.is_contiguous():
                problem = "is not contiguous; offload copies whole parameters"
            if problem:
                raise ValueError(f"OffloadAdamW: parameter {i} {problem}")
        self._device = first.device
        self._engine = _ferry.OffloadAdamW(
            [_source(p)[0] for p in self._params],
            *_hyper(self.param_groups[0]),
            delayed_update=bool(delayed_update),
            hold_gradients=bool(hold_gradients),
            stream=torch.cuda.current_stream(self._device).cuda_stream,
            pinned_limit=None if pinned_limit is None else int(pinned_limit),
        )
        # Staged buffers are taken per gradient (see `_send`); else each parameter has its own.
        self._landing = None
        if self._engine.staging() is None:
            self._landing = [to_torch(self._engine.landing(i)) for i in range(len(self._params))]
        self._down = torch.cuda.ExternalStream(self._engine.gradient_stream(), device=self._device)
        # The hooks hold the optimizer weakly: parameters outlive it, and it ends with its
        # last reference (its engine waits for its copies and threads then).
        this = weakref.ref(self)

        def send(p, i):
            optimizer = this()
            if optimizer is not None:
                optimizer._send(p, i)

        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(send, i=i))
            for i, p in enumerate(self._params)
        ]

    def __del__(self):
        for hook in getattr(self, "_hooks", ()):
            hook.remove()

    def add_param_group(self, param_group):
        """Groups come only through the constructor: the host state (master weights, moments,
        pinned buffers) of every parameter is laid out there, so a group added later is refused
        rather than silently left unstepped."""
        if hasattr(self, "_engine"):
            raise ValueError(
                "OffloadAdamW.add_param_group: the host state is laid out when the optimizer is "
                "made; pass every group to OffloadAdamW([...]) (make a new optimizer to add one)"
            )
        super().add_param_group(param_group)

    def _send(self, p, i):
        """Sends parameter ``i``'s gradient down and hands it to ferry's step thread."""
        torch = _torch()
        grad = p.grad
        if grad is None:
            return
        # With the delayed update the CPU may still be stepping this parameter's last gradient
        # out of the landing tensor: the copy waits until it has been read.
        self._engine.wait_landing(i)
        if self._landing is None:
            landing = to_torch(self._engine.landing(i))
        else:
            landing = self._landing[i]
        self._down.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._down):
            landing.copy_(grad, non_blocking=True)
        # A staged buffer is given back once read; this view must not keep it.
        del landing
        grad.record_stream(self._down)
        p.grad = None
        self._engine.gradient_queued(i, *_hyper(self._group[i]))

    def _send_set_gradients(self):
        """Gradients that came without a backward (set by hand) go down now."""
        for i, p in enumerate(self._params):
            if p.grad is not None:
                self._send(p, i)

    def step(self, closure=None):
        """Waits for the CPU steps of this step's gradients; the next forward reads the new
        weights (torch's current stream waits for their uploads on the device)."""
        torch = _torch()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._send_set_gradients()
        self._engine.step(torch.cuda.current_stream(self._device).cuda_stream)
        return loss

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scales the gradients held for this step (``hold_gradients=True``) to a global L2 norm
        of at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does to ``.grad``s, and
        returns their norm before (``inf`` or ``nan`` leave them as they are)."""
        self._send_set_gradients()
        return self._engine.clip_grad_norm(float(max_norm))

    def scale_grads_(self, factor: float) -> bool:
        """Multiplies the gradients held for this step (``hold_gradients=True``) by ``factor``
        and returns whether any of them holds an infinity or a NaN: with a loss scaled by ``s``,
        ``if opt.scale_grads_(1 / s): opt.zero_grad()`` (skip the step) ``else: opt.step()``."""
        self._send_set_gradients()
        return self._engine.scale_grads(float(factor))

    def zero_grad(self, set_to_none: bool = True):
        """Drops the gradients: those on the parameters, and those held for this step."""
        super().zero_grad(set_to_none=set_to_none)
        self._engine.zero_grad()

    def flush(self):
        """Waits for the CPU's steps and uploads the weights the delayed update holds back (after
        the work queued on torch's current stream, which then waits for them): call it before
        evaluating or saving the model. Nothing to do without the delayed update."""
        torch = _torch()
        self._engine.flush(torch.cuda.current_stream(self._device).cuda_stream)

    def pinned_bytes(self) -> int:
        """Pinned host bytes held: a landing and an upload buffer per parameter, or those staged
        buffers taken now (see ``staging``)."""
        return self._engine.pinned_bytes()

    @property
    def staging(self) -> str | None:
        """A sentence saying the pinned buffers are staged (within ``pinned_limit`` or ferry's
        pinned budget), with the limit and the peak so far; ``None`` when each parameter has
        its own."""
        return self._engine.staging()

    def state_bytes(self) -> int:
        """Host bytes of the optimizer state: master weights and both moments."""
        return self._engine.state_bytes()

    def state_dict(self):
        """torch.optim.AdamW's layout (``state`` by parameter index, ``param_groups``), every
        state tensor an fp32 host copy, plus ``master`` in each parameter's state."""
        torch = _torch()
        named = dict(self._engine.state())
        steps = float(self._engine.steps())
        state = {}
        for k, i in enumerate(self._index):
            entry = {"step": torch.tensor(steps)}
            for name in ("exp_avg", "exp_avg_sq", "master"):
                if f"{k}.{name}" in named:
                    entry[name] = to_torch(named[f"{k}.{name}"])
            state[i] = entry
        groups, start = [], 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Takes what :meth:`state_dict` gives, or torch.optim.AdamW's state dict of the same
        parameters (master weights then come from the parameters)."""
        torch = _torch()
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in groups]
        ours = [len(g["params"]) for g in self.param_groups]
        if sizes != ours:
            raise ValueError(
                f"OffloadAdamW.load_state_dict: the state dict's parameter groups hold {sizes} "
                f"parameters and this optimizer's {ours}"
            )
        saved_ids = [pid for g in groups for pid in g["params"]]
        entries, steps = [], 0
        for k, p in enumerate(self._params):
            i = self._index[k]
            entry = state_dict["state"].get(saved_ids[i], {})

            def host(t, name, i=i, p=p):
                t = t.detach().to("cpu", torch.float32).contiguous()
                if t.shape != p.shape:
                    raise ValueError(
                        f"OffloadAdamW.load_state_dict: parameter {i}'s {name} has shape "
                        f"{tuple(t.shape)}, the parameter {tuple(p.shape)}"
                    )
                return t

            master = entry.get("master")
            entries.append((f"{k}.master", host(p if master is None else master, "master")))
            if "exp_avg" in entry:
                entries.append((f"{k}.exp_avg", host(entry["exp_avg"], "exp_avg")))
                entries.append((f"{k}.exp_avg_sq", host(entry["exp_avg_sq"], "exp_avg_sq")))
            if "step" in entry:
                steps = max(steps, int(float(entry["step"])))
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        lr = float(self.param_groups[0]["lr"])
        if not math.isfinite(lr):
            raise ValueError(f"OffloadAdamW.load_state_dict: lr {lr} is not finite")
        entries.append(("step", torch.tensor(steps, dtype=torch.int64)))
        entries.append(("lr", torch.tensor(lr, dtype=torch.float64)))
        self._engine.load_state(entries)
