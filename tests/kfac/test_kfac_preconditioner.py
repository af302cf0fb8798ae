"""KFACPreconditioner on one process: schedules, state, unused branches, AMP, bad arguments."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac import KFACPreconditioner


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 5)
        self.side = nn.Linear(4 * 6 * 6, 5)  # only used when asked

    def forward(self, x: torch.Tensor, use_side: bool = False) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        return self.fc(h) + (self.side(h) if use_side else 0)


def _setup(seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    model = Branchy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, optimizer, KFACPreconditioner(model, **{"inv_update_freq": 2, **kwargs})


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)


def _train(model, optimizer, pre, steps, start=0, use_side=False):
    for step in range(start, start + steps):
        x, y = _batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x, use_side), y).backward()
        pre.step()
        optimizer.step()


def _stop_and_resume(stop: int, total: int, **kwargs) -> tuple[nn.Module, nn.Module]:
    """The model after ``total`` steps uninterrupted, and after a save at ``stop`` loaded into fresh objects."""
    model, optimizer, pre = _setup(**kwargs)
    _train(model, optimizer, pre, stop)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": optimizer.state_dict(), "kfac": pre.state_dict()}, buffer)
    _train(model, optimizer, pre, total - stop, start=stop)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model2, optimizer2, pre2 = _setup(seed=1, **kwargs)
    model2.load_state_dict(saved["model"])
    optimizer2.load_state_dict(saved["opt"])
    pre2.load_state_dict(saved["kfac"])
    assert pre2.steps == stop
    _train(model2, optimizer2, pre2, total - stop, start=stop)
    return model, model2


@pytest.mark.parametrize("stop", [3, 4, 5])  # the next step an inverse update (every 3rd), one or two after it
@pytest.mark.parametrize("kwargs", [{}, {"late_decompositions": True}, {"method": "inverse"},
                                    {"factor_update_freq": 2, "late_decompositions": True},
                                    {"method": "newton"}, {"method": "newton", "late_decompositions": True}],
                         ids=["eigen", "late", "inverse", "factors-every-2nd-late", "newton", "newton-late"])
def test_a_resume_at_any_step_ends_bit_identical(stop: int, kwargs: dict) -> None:
    """The state holds the factors the installed (and pending late) decompositions came from, so a resume
    between inverse updates uses the same decompositions as the run never stopped, to the last bit."""
    model, model2 = _stop_and_resume(stop, 11, inv_update_freq=3, **kwargs)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_newton_s_warm_starts_travel_in_the_state() -> None:
    """newton's decompositions depend on the previous ones (its warm start), so its state carries them; recomputed
    cold from their factors alone they would agree only to the Newton tolerance."""
    model, optimizer, pre = _setup(method="newton", inv_update_freq=3)
    _train(model, optimizer, pre, 7)
    state = pre.state_dict()
    assert state["decompositions"]["method"] == "newton"
    held = state["decompositions"]["held"]
    assert sorted(held) == [i for i, d in enumerate(pre._held.pairs) if d is not None] and held
    for i, (a, g) in held.items():
        assert all(torch.equal(s, t) for s, t in zip((*a, *g), (*pre._held.pairs[i][0], *pre._held.pairs[i][1])))
    assert "decompositions" not in _setup(method="inverse")[2].state_dict()


def test_a_state_without_the_decompositions_sources_still_loads() -> None:
    """A state saved before the sources were kept recomputes from the running factors (exact at an inverse update)."""
    model, optimizer, pre = _setup()
    _train(model, optimizer, pre, 4)
    state = pre.state_dict()
    del state["decomposed_from"], state["late_from"]
    fresh = _setup(seed=1)[2]
    fresh.load_state_dict(state)
    assert fresh.steps == 4 and not any(fresh._held.decomposed)


def test_loading_state_for_another_model_is_refused() -> None:
    _, _, pre = _setup()
    state = pre.state_dict()
    state["layers"] = ["conv", "head"]
    with pytest.raises(ValueError, match="K-FAC state is for layers"):
        pre.load_state_dict(state)


def test_an_unused_branch_keeps_its_gradient_and_joins_once_it_is_used() -> None:
    model, optimizer, pre = _setup(inv_update_freq=10)
    _train(model, optimizer, pre, 2)
    side = [layer.name for layer in pre.layers].index("side")
    assert pre.a_factors[side] is None and model.side.weight.grad is None
    # used at step 2, not an inverse-update step: it is decomposed on first use and preconditioned
    x, y = _batch(2)
    optimizer.zero_grad()
    F.cross_entropy(model(x, use_side=True), y).backward()
    raw = model.side.weight.grad.clone()
    pre.step()
    assert pre.a_factors[side] is not None and pre._held.decomposed[side]
    assert not torch.allclose(model.side.weight.grad, raw)


def test_factors_only_change_on_factor_update_steps() -> None:
    model, optimizer, pre = _setup(factor_update_freq=3, inv_update_freq=3)
    snapshots = []
    for step in range(4):
        _train(model, optimizer, pre, 1, start=step)
        snapshots.append(pre.a_factors[0].clone())
    assert torch.equal(snapshots[0], snapshots[1]) and torch.equal(snapshots[1], snapshots[2])
    assert not torch.equal(snapshots[2], snapshots[3])


def test_schedules_may_be_callables_of_the_step() -> None:
    seen = {"lr": [], "damping": [], "decay": []}

    def record(name, value):
        def schedule(step):
            seen[name].append(step)
            return value

        return schedule

    model, optimizer, pre = _setup(
        lr=record("lr", 0.05), damping=record("damping", 0.01), factor_decay=record("decay", 0.9)
    )
    _train(model, optimizer, pre, 3)
    assert set(seen["lr"]) == set(seen["damping"]) == set(seen["decay"]) == {0, 1, 2}


def test_kl_clip_none_is_unclipped_and_a_tiny_clip_shrinks_the_step() -> None:
    norms = {}
    for clip in (None, 1e-8):
        model, optimizer, pre = _setup(kl_clip=clip)
        x, y = _batch(0)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        norms[clip] = model.fc.weight.grad.norm()
    assert norms[1e-8] < 0.01 * norms[None]


def test_amp_grad_scaler_scale_is_divided_out_of_g() -> None:
    plain_model, _, plain = _setup()
    scaled_model, _, scaled = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaled.grad_scaler = scaler
    x, y = _batch(0)
    F.cross_entropy(plain_model(x), y).backward()
    plain.step()
    optimizer = torch.optim.SGD(scaled_model.parameters(), lr=0.1)
    scaler.scale(F.cross_entropy(scaled_model(x), y)).backward()
    scaler.unscale_(optimizer)  # unscale before K-FAC reads the gradients, as with gradient clipping
    scaled.step()
    for a, b in zip(plain.g_factors + plain.a_factors, scaled.g_factors + scaled.a_factors, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(plain_model.fc.weight.grad, scaled_model.fc.weight.grad, rtol=1e-4, atol=1e-7)


def test_an_overflowing_amp_step_leaves_the_factors_alone() -> None:
    model, optimizer, pre = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    pre.grad_scaler = scaler
    _train(model, optimizer, pre, 1)
    before = [f.clone() for f in pre.g_factors if f is not None]
    x, y = _batch(1)
    optimizer.zero_grad()
    scaler.scale(F.cross_entropy(model(x), y) * float("inf")).backward()
    scaler.unscale_(optimizer)
    pre.step()
    scaler.step(optimizer)  # skipped: the gradients are not finite
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, [f for f in pre.g_factors if f is not None], strict=False))
    assert scaler.get_scale() < 2.0**10


def test_bfloat16_autocast_keeps_float32_factors() -> None:
    model, optimizer, pre = _setup()
    x, y = _batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    pre.step()
    assert all(f.dtype == torch.float32 for f in pre.a_factors + pre.g_factors if f is not None)


def test_works_with_any_optimizer() -> None:
    torch.manual_seed(0)
    model = Branchy()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    pre = KFACPreconditioner(model)
    _train(model, optimizer, pre, 2)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(factor_update_freq=0), "factor_update_freq"),
        (dict(inv_update_freq=1.5), "inv_update_freq"),
        (dict(damping=0.0), "damping"),
        (dict(damping=float("nan")), "damping must be > 0 or a callable"),  # hpcdl.runtime.numbers.Range's words
        (dict(factor_decay=-0.1), r"factor_decay must be \[0, 1\) or a callable"),
        (dict(factor_decay=1.0), "factor_decay"),
        (dict(kl_clip=-1.0), "kl_clip"),
        (dict(grad_worker_fraction=0.0), "grad_worker_fraction"),
        (dict(method="cholesky"), "method"),
        (dict(loss_reduction="none"), "loss_reduction"),
        (dict(eigen_dtype=torch.float16), "eigen_dtype"),
        (dict(backward_passes_per_step=0), "backward_passes_per_step"),
        (dict(factor_examples=0), "factor_examples"),
        (dict(factor_examples=2.5), "factor_examples"),
    ],
)
def test_bad_arguments_say_what_is_wrong(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        KFACPreconditioner(Branchy(), **kwargs)


def test_a_model_without_supported_layers_warns() -> None:
    with pytest.warns(UserWarning, match="no nn.Linear or nn.Conv2d"):
        pre = KFACPreconditioner(nn.Sequential(nn.ReLU()))
    pre.step()


def test_gradient_accumulation_gives_the_factors_of_the_whole_batch() -> None:
    """Two passes of 4 examples, each loss halved (backward_passes_per_step=2), equal one pass of 8."""
    x, y = _batch(0)
    whole_model, _, whole = _setup()
    F.cross_entropy(whole_model(x), y).backward()
    whole.step()
    split_model, _, split = _setup(backward_passes_per_step=2)
    for part in (slice(0, 4), slice(4, 8)):
        (F.cross_entropy(split_model(x[part]), y[part]) / 2).backward()
    split.step()
    for a, b in zip(whole.a_factors + whole.g_factors, split.a_factors + split.g_factors, strict=False):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    got, want = split_model.fc.weight.grad, whole_model.fc.weight.grad
    assert float((got - want).norm() / want.norm()) < 1e-4


@pytest.mark.parametrize("method, products_per_call", [("eigen", 4), ("inverse", 2), ("newton", 2)])
def test_layers_of_one_shape_take_one_batched_product_whatever_the_method(method: str, products_per_call: int) -> None:
    """resnet32's 32 layers come in 7 shapes: one preconditioning call per shape (a batched one where several
    layers share it), counted by torch.profiler, not a call per layer."""
    from torch.profiler import ProfilerActivity, profile

    from hpcdl.training.models import build_model

    torch.manual_seed(0)
    model = build_model("resnet32", 10, 3)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    pre = KFACPreconditioner(model, method=method, inv_update_freq=100, factor_update_freq=100)
    F.cross_entropy(model(x), y).backward()
    pre.step()  # the first step: factors and decompositions
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pre._precondition(pre.steps)
    shapes = {(layer.a_dim, layer.g_dim) for layer in pre.layers}
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::matmul")
    assert len(pre.layers) == 32 and len(shapes) == 7
    assert calls == products_per_call * len(shapes), (method, calls)
