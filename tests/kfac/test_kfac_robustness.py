"""K-FAC under conditions that used to break it: singular factors, skipped (overflowed) steps.

Also the asynchronous step: in steady state a step reads nothing back from the device, and the
late decompositions are exactly those of the factors one inverse update earlier.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac import KFACPreconditioner, solve
from kfac.decompose import EigenJob, decompose_eigen
from tests.support.kfac_models import DeepNarrow


# ------------------------------------------------------------------ singular factors
def _narrow_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(2, 32, 2, 2, generator=g), torch.randint(0, 3, (2,), generator=g)


def test_a_singular_factor_that_float32_eigh_cannot_decompose_does_not_stop_training() -> None:
    torch.manual_seed(0)
    model = DeepNarrow()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pre = KFACPreconditioner(model, inv_update_freq=1, damping=0.01)
    x, y = _narrow_batch(0)
    F.cross_entropy(model(x), y).backward()
    pre._update_factors(0, None)  # the factors this batch gives, before any decomposition
    factor = pre.a_factors[0].clone()
    assert torch.linalg.matrix_rank(factor.double(), rtol=1e-5) <= 2  # up to float32 rounding
    try:
        torch.linalg.eigh(factor)
    except RuntimeError:
        pass
    else:
        pytest.skip("this LAPACK decomposes the singular factor in float32: nothing to recover from here")

    torch.manual_seed(0)
    model = DeepNarrow()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pre = KFACPreconditioner(model, inv_update_freq=1, damping=0.01)
    with pytest.warns(RuntimeWarning, match="conv A.*failed to converge.*recovered") as record:
        for step in range(4):
            x, y = _narrow_batch(step)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            optimizer.step()
    assert sum("failed to converge" in str(w.message) for w in record) == 1  # warned once
    assert pre.stats["eigen_recoveries"]["float64_retry"] >= 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # The recovered decomposition is the factor's: Q diag(d) Qᵀ = A.
    (qa, da), _ = pre._held.pairs[0]
    a = pre.a_factors[0].double()
    rebuilt = qa.double() @ torch.diag(da.double()) @ qa.double().T
    assert float((rebuilt - a).norm() / a.norm()) < 1e-5
    assert pre.state_dict()["eigen_recoveries"] == pre.stats["eigen_recoveries"]


def _rank_deficient(n: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(rank, n, generator=g, dtype=torch.float64)
    return (rows.T @ rows).float()


def _failing_eigh(monkeypatch: pytest.MonkeyPatch, fails) -> None:
    """Make torch.linalg.eigh raise LinAlgError whenever ``fails(matrix)`` is true."""
    real = torch.linalg.eigh

    def eigh(matrix: torch.Tensor, *args, **kwargs):
        if fails(matrix):
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge (injected)")
        return real(matrix, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)


def _reconstructs(decomposition, factor: torch.Tensor, tol: float) -> bool:
    q, d = (t.double() for t in decomposition)
    rebuilt = q @ torch.diag(d) @ q.T
    return float((rebuilt - factor.double()).norm() / factor.double().norm()) < tol


def test_recovery_ladder_float64_then_damping_then_previous_then_diagonal(monkeypatch: pytest.MonkeyPatch) -> None:
    factor = _rank_deficient(12, 3, seed=0)
    _failing_eigh(monkeypatch, lambda m: m.dtype == torch.float32)
    decomposition, how = solve.robust_eigen_decomposition(factor, torch.float32, None)
    assert how == "float64_retry" and decomposition[0].dtype == torch.float32
    assert _reconstructs(decomposition, factor, 1e-6)

    # Only the damped matrix converges: the eigenvalues carry the extra damping.
    _failing_eigh(monkeypatch, lambda m: torch.equal(m.double(), factor.double()))
    decomposition, how = solve.robust_eigen_decomposition(factor, torch.float32, None)
    shift = solve.EXTRA_DAMPING * float(factor.double().diagonal().mean())
    assert how == "extra_damping"
    damped = factor.double() + shift * torch.eye(12, dtype=torch.float64)
    assert _reconstructs(decomposition, damped, 1e-6)

    _failing_eigh(monkeypatch, lambda m: True)
    previous = (torch.eye(12), torch.ones(12))
    assert solve.robust_eigen_decomposition(factor, torch.float32, previous) == (previous, "kept_previous")
    (q, d), how = solve.robust_eigen_decomposition(factor, torch.float32, None)
    assert how == "diagonal" and torch.equal(q, torch.eye(12)) and torch.equal(d, factor.diagonal())


def test_batched_decompositions_equal_one_by_one_and_fall_back_on_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    factors = [_rank_deficient(6, 6, seed=s) for s in range(3)]
    batched = solve.eigen_decompositions(factors, torch.float32)
    assert batched is not None
    for factor, decomposition in zip(factors, batched, strict=False):
        assert _reconstructs(decomposition, factor, 1e-5)
    _failing_eigh(monkeypatch, lambda m: m.dim() == 3)  # the batch fails, single ones work
    assert solve.eigen_decompositions(factors, torch.float32) is None
    results, recoveries = decompose_eigen([EigenJob(k, f, None) for k, f in enumerate(factors)], torch.float32, 0)
    assert not recoveries and all(_reconstructs(results[k], f, 1e-5) for k, f in enumerate(factors))


# ------------------------------------------------------------------ skipped steps (found_inf)
class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def _small_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 2, 5, 5, generator=g), torch.randint(0, 3, (6,), generator=g)


def _run(steps: list[int], skipped: set[int], overflow_statistics: bool = False, **kwargs):
    """Train on the batches of ``steps``; those in ``skipped`` overflow (inf in a gradient, found_inf=1)
    and the optimizer skips them, as GradScaler does."""
    torch.manual_seed(0)
    model = Small()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pre = KFACPreconditioner(model, **{"inv_update_freq": 2, **kwargs})
    for step in steps:
        x, y = _small_batch(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if step in skipped and overflow_statistics:
            loss = loss * float("inf")  # every statistic of G becomes non-finite too
        loss.backward()
        if step in skipped:
            model.fc.weight.grad[0, 0] = float("inf")
        found_inf = torch.tensor(1.0 if step in skipped else 0.0)
        pre.step(found_inf=found_inf)
        if step not in skipped:
            optimizer.step()
    return model, pre


@pytest.mark.parametrize("overflow_statistics", [False, True])
def test_a_skipped_step_leaves_no_trace_in_the_factors(overflow_statistics: bool) -> None:
    _, with_skip = _run([0, 1, 2, 3], skipped={2}, overflow_statistics=overflow_statistics)
    _, without = _run([0, 1, 3], skipped=set())
    for got, want in zip(
        with_skip.a_factors + with_skip.g_factors, without.a_factors + without.g_factors, strict=False
    ):
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)
    assert with_skip.stats["skipped_factor_updates"] == 2  # two layers, one skipped step
    assert with_skip.steps == 4  # host-side counters go on


def test_a_skipped_first_step_starts_the_factors_at_the_next_one() -> None:
    _, with_skip = _run([0, 1, 2], skipped={0}, overflow_statistics=True)
    _, without = _run([1, 2], skipped=set())
    for got, want in zip(
        with_skip.a_factors + with_skip.g_factors, without.a_factors + without.g_factors, strict=False
    ):
        assert torch.equal(got, want)


def test_found_inf_zero_changes_nothing() -> None:
    model_a, pre_a = _run([0, 1, 2], skipped=set())
    torch.manual_seed(0)
    model_b = Small()
    optimizer = torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9)
    pre_b = KFACPreconditioner(model_b, inv_update_freq=2)
    for step in (0, 1, 2):
        x, y = _small_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model_b(x), y).backward()
        pre_b.step()
        optimizer.step()
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=False):
        assert torch.equal(p, q)


# ------------------------------------------------------------------ no host reads in a steady-state step
def test_a_steady_state_step_reads_nothing_back_from_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU stand-in for CUDA's sync debug mode: every Python-level way of reading a tensor's value
    on the host fails inside pre.step() once all layers have factors and decompositions."""
    torch.manual_seed(0)
    model = Small()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model, factor_update_freq=1, inv_update_freq=100, kl_clip=0.001)
    for step in range(2):
        x, y = _small_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        optimizer.step()

    def forbidden(*args, **kwargs):
        raise AssertionError("K-FAC read a tensor back to the host")

    x, y = _small_batch(2)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    pre.step(found_inf=torch.zeros(()))  # factor update, KL clip, preconditioning
    monkeypatch.undo()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# ------------------------------------------------------------------ late decompositions
def test_late_decompositions_are_those_of_the_factors_one_inverse_update_earlier() -> None:
    torch.manual_seed(0)
    model = Small()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model, inv_update_freq=2, late_decompositions=True, kl_clip=None)
    factors_at = {}
    for step in range(5):
        x, y = _small_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        factors_at[step] = [f.clone() for f in pre.a_factors]
        optimizer.step()
    # step 0: first decompositions, at once; step 2: started in the background; step 4: installed.
    for i in range(len(pre.layers)):
        (qa, da), _ = pre._held.pairs[i]
        assert _reconstructs((qa, da), factors_at[2][i], 1e-5)
        assert not _reconstructs((qa, da), factors_at[4][i], 1e-5)


def test_late_decompositions_are_off_by_default_and_equal_the_synchronous_run_at_first() -> None:
    _, pre = _run([0, 1], skipped=set())
    assert pre.options.late_decompositions is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, late = _run([0, 1], skipped=set(), late_decompositions=True)
    for a, b in zip(pre._held.pairs, late._held.pairs, strict=False):
        assert all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1], strict=False))
