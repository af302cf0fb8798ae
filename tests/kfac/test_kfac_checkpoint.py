"""kfac.checkpoint: which factors each decomposition came from, and the state that carries them across a resume.

The preconditioner-level proofs (a resume at any step ends bit-identical to a run never stopped) are in
test_kfac_preconditioner.py, test_kfac_mpi.py and tests/training/test_kfac_resume_jobs.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac.checkpoint import KFACState, Sources, factors_of
from kfac.layers import find_layers


def _factors(n: int, seed: int) -> tuple[list, list]:
    generator = torch.Generator().manual_seed(seed)
    return ([torch.randn(3, 3, generator=generator) for _ in range(n)],
            [torch.randn(2, 2, generator=generator) for _ in range(n)])


def _tags(held: dict) -> dict:
    return {i: (step, call) for i, (_, _, step, call) in held.items()}


def test_without_late_decompositions_every_decomposition_is_installed_now() -> None:
    sources, factors = Sources(), _factors(3, 0)
    sources.note([0, 2], [0, 2], 0, factors, late=False, inverse_update=True)
    sources.note([1], [1], 4, factors, late=False, inverse_update=False)
    assert _tags(sources.installed) == {0: (0, "now"), 2: (0, "now"), 1: (4, "now")} and sources.late == {}
    assert sources.installed[2][0] is factors[0][2] and sources.installed[2][1] is factors[1][2]


def test_late_decompositions_are_installed_one_inverse_update_later() -> None:
    sources, (a, g) = Sources(), _factors(3, 0)
    sources.note([0, 1], [0, 1], 0, (a, g), late=True, inverse_update=True)  # first ones: at once
    assert _tags(sources.installed) == {0: (0, "first"), 1: (0, "first")} and sources.late == {}
    sources.note([0, 1, 2], [2], 10, (a, g), late=True, inverse_update=True)  # 0, 1 start late; 2 is new
    assert _tags(sources.installed) == {0: (0, "first"), 1: (0, "first"), 2: (10, "first")}
    assert _tags(sources.late) == {0: (10, "late"), 1: (10, "late")}
    sources.note([0, 1, 2], [], 13, (a, g), late=True, inverse_update=False)  # between updates: nothing moves
    assert _tags(sources.late) == {0: (10, "late"), 1: (10, "late")}
    sources.note([0, 1, 2], [], 20, (a, g), late=True, inverse_update=True)
    assert _tags(sources.installed) == {0: (10, "late"), 1: (10, "late"), 2: (10, "first")}
    assert _tags(sources.late) == {0: (20, "late"), 1: (20, "late"), 2: (20, "late")}


def _layers():
    return find_layers(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(2, 2)), (), "expand")


def test_a_state_round_trip_copies_each_tensor_once_and_keeps_the_calls_in_order() -> None:
    layers = _layers()
    dims = [(layer.a_dim, layer.g_dim) for layer in layers]
    generator = torch.Generator().manual_seed(1)
    a = [torch.randn(d, d, generator=generator) for d, _ in dims]
    g = [torch.randn(d, d, generator=generator) for _, d in dims]
    old_a = torch.randn(dims[1][0], dims[1][0], generator=generator)
    sources = Sources()
    sources.installed = {1: (old_a, g[1], 10, "now"), 0: (a[0], g[0], 20, "first")}
    sources.late = {1: (a[1], g[1], 20, "late")}
    state = KFACState(23, [layer.name for layer in layers], (a, g), sources, {"float64": 1}, "eigen").to_dict()
    assert "decompositions" not in state and state["steps"] == 23 and list(state["decomposed_from"]) == [0, 1]
    assert state["a_factors"][0] is state["decomposed_from"][0][0] and state["a_factors"][0] is not a[0]
    a[0].add_(1.0)  # the saved state is a copy
    assert not torch.equal(state["a_factors"][0], a[0])
    back = KFACState.of(state, layers, "eigen")
    assert back.steps == 23 and back.eigen_recoveries == {"float64": 1} and back.held is None
    assert torch.equal(back.factors[0][1], a[1]) and torch.equal(back.sources.installed[1][0], old_a)
    assert back.factors[0][0] is back.sources.installed[0][0]  # one tensor here for one saved twice
    assert back.factors[1][1] is back.sources.late[1][1]
    assert back.calls() == [(10, [1]), (20, [0])]
    chosen = factors_of(back.sources.installed, 2)
    assert chosen[0][1] is back.sources.installed[1][0] and chosen[1][0] is back.sources.installed[0][1]


def test_a_warm_started_method_s_decompositions_travel_and_another_method_ignores_them() -> None:
    layers = _layers()
    inverses = {0: ((torch.eye(3),), (torch.eye(3) * 2,))}
    factors = ([None, None], [None, None])
    state = KFACState(1, [layer.name for layer in layers], factors, Sources(), {}, "newton", inverses).to_dict()
    assert state["decompositions"]["method"] == "newton"
    assert state["decompositions"]["held"][0][1][0] is not inverses[0][1][0]
    held = KFACState.of(state, layers, "newton").held
    assert held is not None and torch.equal(held[0][1][0], torch.eye(3) * 2)
    assert KFACState.of(state, layers, "inverse").held is None


def test_a_state_for_other_layers_is_refused_in_one_line() -> None:
    layers = _layers()
    state = KFACState(1, [layer.name for layer in layers], ([None, None], [None, None]), Sources(), {},
                      "eigen").to_dict()
    with pytest.raises(ValueError, match="K-FAC state is for layers"):
        KFACState.of({**state, "layers": ["other", "names"]}, layers, "eigen")
    state["a_factors"][1] = torch.zeros(5, 5)
    with pytest.raises(ValueError, match=r"A factor has shape \(5, 5\), expected \(3, 3\)") as error:
        KFACState.of(state, layers, "eigen")
    assert "\n" not in str(error.value)
