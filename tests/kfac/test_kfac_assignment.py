"""Assignment of decompositions and gradient work to ranks."""

from __future__ import annotations

import itertools

import pytest

from kfac.assignment import assign_work, grad_worker_count, longest_first

# The factor sizes of resnet32 on CIFAR (31 bias-free 3x3 convolutions and the classifier).
RESNET32_A = [27] + [144] * 11 + [288] * 10 + [576] * 9 + [65]
RESNET32_G = [16] * 11 + [32] * 10 + [64] * 10 + [10]


def test_every_factor_is_owned_once_by_a_rank_of_its_layers_group() -> None:
    for world in (1, 2, 3, 4, 6, 8):
        for workers in [w for w in range(1, world + 1) if world % w == 0]:
            for colocate in (True, False):
                plan = assign_work(RESNET32_A, RESNET32_G, world, workers / world, colocate)
                owned = [item for rank in range(world) for item in plan.owned_factors(rank)]
                assert sorted(owned) == sorted((i, kind) for i in range(len(RESNET32_A)) for kind in "AG")
                for i in range(len(RESNET32_A)):
                    group = plan.worker_groups()[plan.layer_group[i]]
                    assert plan.a_owner[i] in group and plan.g_owner[i] in group
                    if colocate:
                        assert plan.a_owner[i] == plan.g_owner[i]


def test_groups_and_blocks_tile_the_ranks_kaisa_style() -> None:
    plan = assign_work(RESNET32_A, RESNET32_G, 8, 0.5)
    assert plan.grad_workers == 4 and plan.columns == 2
    assert plan.worker_groups() == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert plan.receiver_blocks() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    for layer in range(len(RESNET32_A)):
        for rank in range(8):
            source = plan.gradient_source(layer, rank)
            assert source // 2 == rank // 2 and plan.is_grad_worker(layer, source)


def test_the_assignment_is_deterministic() -> None:
    plans = {assign_work(RESNET32_A, RESNET32_G, 4, f) for f in (0.25, 0.25, 0.25)}
    assert len(plans) == 1


def test_resnet32_decompositions_are_balanced_over_ranks() -> None:
    two = assign_work(RESNET32_A, RESNET32_G, 2, 1.0, colocate_factors=False).loads(RESNET32_A, RESNET32_G)
    assert max(two) <= 1.02 * sum(two) / 2, two
    # on 4 ranks nine 577x577 factors force three onto one rank: that is the optimum, and LPT finds it
    four = assign_work(RESNET32_A, RESNET32_G, 4, 1.0, colocate_factors=False).loads(RESNET32_A, RESNET32_G)
    assert max(four) == 3 * 576.0**3, four


def _optimum(costs: list[float], bins: int) -> float:
    return min(
        max(sum(c for c, b in zip(costs, choice, strict=False) if b == k) for k in range(bins))
        for choice in itertools.product(range(bins), repeat=len(costs))
    )


@pytest.mark.parametrize("seed", range(5))
def test_longest_first_is_within_grahams_bound(seed: int) -> None:
    """LPT's makespan is at most (4/3 - 1/(3m)) times the optimum (Graham 1969)."""
    import random

    rng = random.Random(seed)
    costs = [float(rng.randint(1, 40) ** 3) for _ in range(8)]
    load = {b: 0.0 for b in range(3)}
    longest_first(costs, [0, 1, 2], load)
    assert max(load.values()) <= (4 / 3 - 1 / 9) * _optimum(costs, 3) + 1e-9


@pytest.mark.parametrize("world, fraction", [(4, 0.0), (4, 1.5), (3, 0.5), (6, 0.7)])
def test_fractions_that_do_not_tile_the_ranks_are_refused(world: int, fraction: float) -> None:
    with pytest.raises(ValueError, match="grad"):
        grad_worker_count(world, fraction)


def test_fraction_rounds_to_whole_workers() -> None:
    assert grad_worker_count(4, 0.25) == 1
    assert grad_worker_count(4, 0.1) == 1
    assert grad_worker_count(8, 0.5) == 4
    assert grad_worker_count(1, 0.3) == 1


def test_auto_fraction_weighs_decompositions_against_the_gradient_exchange() -> None:
    """Per step a rank receives D/m decomposition elements per inverse update and G(m-1)/m gradient elements."""
    from kfac.assignment import auto_fraction

    # Decompositions every step and much larger than the gradients: the most groups (fraction 1/W) wins.
    assert auto_fraction([10_000] * 8, gradient_numel=100, world_size=4, inv_update_freq=1) == 0.25
    # Rare decompositions: no gradient exchange (fraction 1) wins.
    assert auto_fraction([10_000] * 8, gradient_numel=100, world_size=4, inv_update_freq=1000) == 1.0
    # In between the costs are computed, not guessed: D = 80,000, G = 20,000, every 4 steps on 4 ranks:
    # m = 1: 20,000; m = 2: 10,000 + 10,000 = 20,000 (a tie: the larger fraction); m = 4: 5,000 + 15,000 = 20,000.
    assert auto_fraction([10_000] * 8, gradient_numel=20_000, world_size=4, inv_update_freq=4) == 1.0
    assert auto_fraction([10_000] * 8, gradient_numel=19_000, world_size=4, inv_update_freq=4) == 0.25
    assert auto_fraction([5], gradient_numel=1, world_size=1, inv_update_freq=1) == 1.0


def test_auto_fraction_reaches_the_preconditioner_and_refuses_nonsense() -> None:
    import pytest
    import torch

    from kfac import KFACPreconditioner

    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    assert KFACPreconditioner(model, grad_worker_fraction="auto").grad_worker_fraction == 1.0  # one rank
    with pytest.raises(ValueError, match="grad_worker_fraction must be a number in \\(0, 1\\] or 'auto'"):
        KFACPreconditioner(model, grad_worker_fraction="half")
