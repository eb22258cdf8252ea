"""ferry.optim.OffloadAdamW against torch.optim.AdamW: the same weights step after step (two
parameter groups, fp32 and bf16, on torch's default stream and inside ``torch.cuda.stream``),
the next forward ordered after the uploads, state dicts that go both ways, and arguments that
are refused with a message. The CUDA cases skip without a GPU (they run on the GPU machine)."""

import copy

import pytest

torch = pytest.importorskip("torch")

import ferry  # noqa: E402
from ferry.optim import OffloadAdamW  # noqa: E402

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and ferry.cuda_available()),
    reason="needs a CUDA device",
)


def _model(dtype=torch.float32):
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8)
    )
    return model.to("cuda", dtype)


def _groups(model, lr):
    # Two groups, each with its own learning rate and weight decay.
    return [
        {"params": list(model[0].parameters()), "lr": lr, "weight_decay": 0.1},
        {"params": list(model[2].parameters()), "lr": lr / 2, "weight_decay": 0.0},
    ]


def _loss(model, seed, batch=32):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dtype = next(model.parameters()).dtype
    x = torch.randn(batch, model[0].in_features, device="cuda", generator=g).to(dtype)
    return model(x).float().pow(2).mean()


def _close(a, b, rtol):
    for p, q in zip(a.parameters(), b.parameters()):
        p, q = p.detach().float(), q.detach().float()
        assert torch.allclose(p, q, rtol=rtol, atol=rtol * 1e-2), (p - q).abs().max().item()


def _train(reference, offloaded, steps, first_seed=0):
    ref_opt, off_opt = reference[1], offloaded[1]
    for step in range(steps):
        ref_opt.zero_grad()
        _loss(reference[0], first_seed + step).backward()
        ref_opt.step()
        off_opt.zero_grad()
        _loss(offloaded[0], first_seed + step).backward()
        # Backward's hooks sent every gradient down and let go of it.
        assert all(p.grad is None for p in offloaded[0].parameters())
        off_opt.step()


def _pair(dtype=torch.float32, lr=1e-2):
    a, b = _model(dtype), _model(dtype)
    ref = torch.optim.AdamW(_groups(a, lr), lr=lr, foreach=False)
    off = OffloadAdamW(_groups(b, lr), lr=lr)
    return (a, ref), (b, off)


@cuda
def test_offloaded_steps_follow_torch_adamw_in_two_groups():
    reference, offloaded = _pair()
    _train(reference, offloaded, 5)
    _close(reference[0], offloaded[0], rtol=1e-5)
    state = offloaded[1].state_dict()
    assert float(state["state"][0]["step"]) == 5.0
    assert state["param_groups"][1]["lr"] == 5e-3
    assert offloaded[1].pinned_bytes() >= 2 * sum(
        p.numel() * 4 for p in offloaded[0].parameters()
    )


@cuda
def test_inside_a_side_stream_the_steps_are_the_same():
    reference, offloaded = _pair()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _train(reference, offloaded, 4)
        _close(reference[0], offloaded[0], rtol=1e-5)
    torch.cuda.current_stream().wait_stream(side)


@cuda
def test_bf16_parameters_are_stepped_from_fp32_master_weights():
    _, (model, opt) = _pair(torch.bfloat16)
    # torch's AdamW on fp32 weights that start as the bf16 ones, fed the gradients a bf16 copy
    # of them computes: what master weights do.
    master = _model(torch.bfloat16).float()
    master_opt = torch.optim.AdamW(_groups(master, 1e-2), lr=1e-2, foreach=False)
    for step in range(3):
        rounded = copy.deepcopy(master).to(torch.bfloat16)
        _loss(rounded, step).backward()
        for p, q in zip(master.parameters(), rounded.parameters()):
            p.grad = q.grad.float()
        master_opt.step()
        _loss(model, step).backward()
        opt.step()
    state = opt.state_dict()["state"]
    for i, (p, q) in enumerate(zip(master.parameters(), model.parameters())):
        assert q.dtype == torch.bfloat16
        assert torch.allclose(state[i]["master"], p.detach().cpu(), rtol=1e-5, atol=1e-7)
        # The parameter is its master weights rounded to bf16 (one rounding apart at most).
        assert torch.allclose(q.detach().float(), p.detach(), rtol=8e-3, atol=1e-6)


@cuda
def test_the_next_read_waits_for_the_upload():
    # One large parameter: its upload takes milliseconds, a read queued at once microseconds.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64 << 20, device="cuda"))
    expected = p.detach().clone()
    grad = torch.randn_like(p)
    opt = OffloadAdamW([p], lr=0.5, weight_decay=0.0)
    ref = torch.optim.AdamW([torch.nn.Parameter(expected)], lr=0.5, weight_decay=0.0)
    for _ in range(2):
        p.grad = grad.clone()
        opt.step()
        read = p.detach().clone()  # queued right after step() returns
        ref.param_groups[0]["params"][0].grad = grad.clone()
        ref.step()
        assert torch.allclose(read, ref.param_groups[0]["params"][0].detach(), rtol=1e-5, atol=1e-6)


@cuda
def test_state_dicts_go_both_ways_with_torch_adamw():
    reference, offloaded = _pair()
    _train(reference, offloaded, 3)
    # ferry's state dict into torch's AdamW (the extra master weights are carried along).
    follower = copy.deepcopy(offloaded[0])
    torch_opt = torch.optim.AdamW(_groups(follower, 1e-2), lr=1e-2, foreach=False)
    torch_opt.load_state_dict(offloaded[1].state_dict())
    # torch's AdamW state dict into a fresh OffloadAdamW.
    resumed_model = copy.deepcopy(reference[0])
    resumed = OffloadAdamW(_groups(resumed_model, 1e-2), lr=1e-2)
    resumed.load_state_dict(reference[1].state_dict())
    assert float(resumed.state_dict()["state"][0]["step"]) == 3.0
    _train(reference, offloaded, 2, first_seed=10)
    _train((follower, torch_opt), (resumed_model, resumed), 2, first_seed=10)
    _close(reference[0], offloaded[0], rtol=1e-5)
    _close(reference[0], follower, rtol=1e-5)
    _close(reference[0], resumed_model, rtol=1e-5)


@cuda
def test_frozen_parameters_are_skipped_as_torch_adamw_skips_them():
    # The first layer's weight frozen: it keeps its values, gets no state, and the state dict's
    # indices are torch's (every parameter of the groups counted).
    a, b = _model(), _model()
    for model in (a, b):
        model[0].weight.requires_grad_(False)
    ref = torch.optim.AdamW(_groups(a, 1e-2), lr=1e-2, foreach=False)
    off = OffloadAdamW(_groups(b, 1e-2), lr=1e-2)
    frozen = b[0].weight.detach().clone()
    _train((a, ref), (b, off), 4)
    _close(a, b, rtol=1e-5)
    assert torch.equal(b[0].weight, frozen)
    ours, theirs = off.state_dict(), ref.state_dict()
    assert sorted(ours["state"]) == sorted(theirs["state"]) == [1, 2, 3]
    assert ours["param_groups"][0]["params"] == theirs["param_groups"][0]["params"]
    resumed_model = copy.deepcopy(a)
    resumed = OffloadAdamW(_groups(resumed_model, 1e-2), lr=1e-2)
    resumed.load_state_dict(theirs)
    _train((a, ref), (resumed_model, resumed), 2, first_seed=10)
    _close(a, resumed_model, rtol=1e-5)


@cuda
def test_groups_come_through_the_constructor():
    model = _model()
    off = OffloadAdamW(model[0].parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="pass every group to OffloadAdamW"):
        off.add_param_group({"params": list(model[2].parameters())})
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter requires grad"):
        OffloadAdamW(model.parameters(), lr=1e-3)


@cuda
def test_a_state_dict_of_other_parameters_is_refused():
    _, offloaded = _pair()
    other = OffloadAdamW(_model().parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="parameter groups"):
        other.load_state_dict(offloaded[1].state_dict())
    state = offloaded[1].state_dict()
    state["state"][0]["master"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        offloaded[1].load_state_dict(state)


def test_parameters_on_the_cpu_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="move the model to the GPU"):
        OffloadAdamW(torch.nn.Linear(4, 4).parameters())


def test_unsupported_arguments_are_refused():
    params = list(torch.nn.Linear(4, 4).parameters())
    with pytest.raises(ValueError, match="amsgrad"):
        OffloadAdamW(params, amsgrad=True)
    with pytest.raises(ValueError, match="invalid lr"):
        OffloadAdamW(params, lr=-1.0)
    with pytest.raises(ValueError, match="invalid beta 1"):
        OffloadAdamW(params, betas=(0.9, 1.0))


@cuda
def test_the_delayed_update_computes_with_weights_one_step_behind():
    # Reference: torch's AdamW applying the gradients the delayed run computes, at its weights.
    torch.manual_seed(0)
    model = _model()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, delayed_update=True)
    history = [[p.detach().clone() for p in reference.parameters()]]
    for step in range(4):
        behind = history[max(step - 1, 0)]
        for p, q in zip(behind, model.parameters()):
            assert torch.allclose(p, q.detach(), rtol=1e-5, atol=1e-7), step
        scratch = copy.deepcopy(model)
        _loss(scratch, step).backward()
        for p, q in zip(reference.parameters(), scratch.parameters()):
            p.grad = q.grad
        ref_opt.step()
        history.append([p.detach().clone() for p in reference.parameters()])
        _loss(model, step).backward()
        opt.step()
    opt.flush()
    for p, q in zip(history[-1], model.parameters()):
        assert torch.allclose(p, q.detach(), rtol=1e-5, atol=1e-7)
    assert float(opt.state_dict()["state"][0]["step"]) == 4.0


@cuda
def test_the_delayed_update_never_lands_a_gradient_on_one_not_yet_stepped():
    # A wide model at a tiny batch: the CPU's passes take longer than forward and backward, so
    # the step thread runs a step behind and the next gradient of a parameter comes while the
    # last one still waits in its landing tensor. Run back to back, each gradient must still
    # be applied once, as torch's AdamW applies the gradients at the delayed run's weights.
    def wide():
        torch.manual_seed(5)
        return torch.nn.Sequential(
            torch.nn.Linear(1024, 2048), torch.nn.Tanh(),
            torch.nn.Linear(2048, 2048), torch.nn.Tanh(),
            torch.nn.Linear(2048, 8),
        ).to("cuda")

    steps = 6
    model = wide()
    opt = OffloadAdamW(model.parameters(), lr=1e-3, delayed_update=True)
    for step in range(steps):
        _loss(model, step, batch=4).backward()
        opt.step()
    opt.flush()

    reference, scratch = wide(), wide()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    history = [[p.detach().clone() for p in reference.parameters()]]
    for step in range(steps):
        with torch.no_grad():
            for s, w in zip(scratch.parameters(), history[max(step - 1, 0)]):
                s.copy_(w)
        scratch.zero_grad()
        _loss(scratch, step, batch=4).backward()
        for p, q in zip(reference.parameters(), scratch.parameters()):
            p.grad = q.grad.clone()
        ref_opt.step()
        history.append([p.detach().clone() for p in reference.parameters()])
    _close(reference, model, rtol=1e-5)


@cuda
def test_held_gradients_accumulate_clip_and_skip_an_overflow_as_torch_adamw_does():
    # Two backward passes a step, the global norm clipped (small enough that steps clip), and a
    # step whose loss is infinite skipped after unscaling: torch's AdamW on .grad beside it.
    torch.manual_seed(0)
    model = _model()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, hold_gradients=True)
    scale, clipped = 256.0, 0
    for step in range(4):
        ref_opt.zero_grad()
        opt.zero_grad()
        overflow = float("inf") if step == 2 else 1.0
        for m in (reference, model):
            for k in range(2):
                (_loss(m, 10 * step + k) * overflow * scale).backward()
        assert all(p.grad is None for p in model.parameters())
        found = opt.scale_grads_(1 / scale)
        for p in reference.parameters():
            p.grad.div_(scale)
        ref_found = not all(torch.isfinite(p.grad).all() for p in reference.parameters())
        assert found == ref_found == (step == 2)
        if found:
            continue
        norm = opt.clip_grad_norm_(0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05).item()
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)
        clipped += ref_norm > 0.05
        ref_opt.step()
        opt.step()
        _close(reference, model, rtol=1e-5)
    assert clipped > 0
    assert float(opt.state_dict()["state"][0]["step"]) == 3.0


@cuda
def test_clipping_without_held_gradients_names_the_fix():
    opt = OffloadAdamW(_model().parameters(), lr=1e-3)
    with pytest.raises(ferry.FerryError, match="hold_gradients=True"):
        opt.clip_grad_norm_(1.0)


@cuda
def test_staged_buffers_stay_within_the_pinned_limit_and_step_as_torch_adamw():
    # Four 16 KiB weights: a limit of 64 KiB holds two weights' landing and upload buffers,
    # not a pair for every parameter, so they are staged.
    def model():
        torch.manual_seed(5)
        layers = [m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())]
        return torch.nn.Sequential(*layers).cuda()

    limit = 64 << 10
    a, b, c = model(), model(), model()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    per_parameter = OffloadAdamW(b.parameters(), lr=1e-2)
    off = OffloadAdamW(c.parameters(), lr=1e-2, pinned_limit=limit)
    assert per_parameter.staging is None
    assert off.staging is not None and "staged" in off.staging
    for step in range(4):
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for m, opt in ((a, ref), (b, per_parameter), (c, off)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
        assert off.pinned_bytes() <= limit
    for p, q, r in zip(a.parameters(), b.parameters(), c.parameters()):
        # Staged or not, the same host steps; torch's AdamW on the GPU rounds a little apart.
        assert torch.allclose(q, r, rtol=1e-6, atol=1e-8), (q - r).abs().max().item()
        assert torch.allclose(p, r, rtol=1e-5, atol=1e-6), (p - r).abs().max().item()
    with pytest.raises(ValueError, match="delayed_update"):
        OffloadAdamW(model().parameters(), lr=1e-2, pinned_limit=limit, delayed_update=True)
    with pytest.raises(ferry.FerryError, match="at least"):
        OffloadAdamW(model().parameters(), lr=1e-2, pinned_limit=1 << 10)
