"""Who decomposes which factor, and who preconditions which layer (KAISA's layout).

With W ranks and ``grad_worker_fraction`` f there are g = f·W gradient workers per layer and
m = W/g "columns": rank r belongs to worker group r mod m and to receiver block r // m.

- Every layer belongs to one worker group (layers are spread over the m groups greedily by cost).
  Its factors are decomposed by ranks of that group, the results are broadcast inside the group,
  and every member preconditions the layer.
- Every receiver block (m consecutive ranks) holds exactly one member of each worker group; that
  member broadcasts the layer's preconditioned gradient to the rest of its block.

f = 1 (g = W, m = 1): one group of all ranks, every rank preconditions, no gradient broadcast.
f = 1/W (g = 1, m = W): a layer's owner alone preconditions and broadcasts to all.
The cost of a factor's decomposition is n³ for an n x n factor; work is balanced with the
longest-processing-time-first rule, which is deterministic, so every rank computes the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def grad_worker_count(world_size: int, fraction: float) -> int:
    """g = round(f·W), at least 1; W must be a multiple of g so that the groups tile the ranks."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"grad_worker_fraction must be in (0, 1], got {fraction}")
    workers = max(1, min(world_size, round(fraction * world_size)))
    if world_size % workers:
        raise ValueError(
            f"grad_worker_fraction={fraction} gives {fraction * world_size:g} gradient workers on {world_size} ranks; "
            f"choose a fraction k/{world_size} where k divides {world_size}"
        )
    return workers


def auto_fraction(
    decomposition_numels: Sequence[int], gradient_numel: int, world_size: int, inv_update_freq: int
) -> float:
    """KAISA's fraction with the fewest elements a rank receives per step, among those whose groups tile the ranks.

    With m = W/g groups, a rank receives its group's decompositions, about D/m elements per inverse update
    (D: every factor's eigenvectors and eigenvalues), and, when m > 1, the other m-1 members' preconditioned
    gradients of its receiver block, about G(m-1)/m elements every step (G: the preconditioned layers'
    gradients). Factor statistics are allreduced whatever the fraction. Frequent decompositions of large
    factors favour small groups (fraction < 1); rare ones favour 1, which also spares the extra gradient
    exchange. A tie goes to the larger fraction (fewer collectives). Memory also falls with m (each rank
    keeps D/m): a user short of memory can still ask for a fraction below the one chosen here.
    """
    total = float(sum(decomposition_numels))
    best, best_cost = 1.0, math.inf
    for workers in sorted((g for g in range(1, world_size + 1) if world_size % g == 0), reverse=True):
        m = world_size // workers
        cost = total / m / inv_update_freq + gradient_numel * (m - 1) / m
        if cost < best_cost:
            best, best_cost = workers / world_size, cost
    return best


def longest_first(costs: Sequence[float], bins: Sequence[int], load: dict[int, float]) -> list[int]:
    """Give each job, largest first, to the least-loaded bin (ties: the earlier bin). Updates ``load``."""
    owners = [-1] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        best = min(bins, key=lambda b: (load[b], bins.index(b)))
        owners[job] = best
        load[best] += costs[job]
    return owners


@dataclass(frozen=True)
class WorkAssignment:
    """The plan for one model on one world: identical on every rank."""

    world_size: int
    grad_workers: int
    layer_group: tuple[int, ...]  # per layer: its worker group, 0 .. m-1
    a_owner: tuple[int, ...]  # per layer: the rank that decomposes A
    g_owner: tuple[int, ...]  # per layer: the rank that decomposes G

    @property
    def columns(self) -> int:
        """m = W / g: the number of worker groups, and the size of each receiver block."""
        return self.world_size // self.grad_workers

    def worker_groups(self) -> list[tuple[int, ...]]:
        m = self.columns
        return [tuple(c + k * m for k in range(self.grad_workers)) for c in range(m)]

    def receiver_blocks(self) -> list[tuple[int, ...]]:
        m = self.columns
        return [tuple(range(b * m, (b + 1) * m)) for b in range(self.grad_workers)]

    def is_grad_worker(self, layer: int, rank: int) -> bool:
        return rank % self.columns == self.layer_group[layer]

    def gradient_source(self, layer: int, rank: int) -> int:
        """The grad worker of ``layer`` inside ``rank``'s receiver block."""
        m = self.columns
        return (rank // m) * m + self.layer_group[layer]

    def owned_factors(self, rank: int) -> list[tuple[int, str]]:
        """(layer, 'A' or 'G') pairs whose decomposition ``rank`` computes, in layer order."""
        owned = []
        for layer in range(len(self.layer_group)):
            if self.a_owner[layer] == rank:
                owned.append((layer, "A"))
            if self.g_owner[layer] == rank:
                owned.append((layer, "G"))
        return owned

    def loads(self, a_dims: Sequence[int], g_dims: Sequence[int]) -> list[float]:
        """Decomposition cost per rank, Σ n³ of the factors it owns."""
        load = [0.0] * self.world_size
        for layer, (a, g) in enumerate(zip(a_dims, g_dims, strict=False)):
            load[self.a_owner[layer]] += float(a) ** 3
            load[self.g_owner[layer]] += float(g) ** 3
        return load


def assign_work(
    a_dims: Sequence[int],
    g_dims: Sequence[int],
    world_size: int,
    grad_worker_fraction: float = 1.0,
    colocate_factors: bool = True,
) -> WorkAssignment:
    """Spread layers over worker groups, then factors (or layers, when colocated) over each group's ranks."""
    if len(a_dims) != len(g_dims):
        raise ValueError("a_dims and g_dims must have one entry per layer")
    workers = grad_worker_count(world_size, grad_worker_fraction)
    m = world_size // workers
    layer_costs = [float(a) ** 3 + float(g) ** 3 for a, g in zip(a_dims, g_dims, strict=False)]
    layer_group = longest_first(layer_costs, list(range(m)), {c: 0.0 for c in range(m)})

    a_owner = [-1] * len(a_dims)
    g_owner = [-1] * len(a_dims)
    load = {r: 0.0 for r in range(world_size)}
    for group in range(m):
        ranks = [group + k * m for k in range(workers)]
        layers = [i for i, c in enumerate(layer_group) if c == group]
        if colocate_factors:
            owners = longest_first([layer_costs[i] for i in layers], ranks, load)
            for i, owner in zip(layers, owners, strict=False):
                a_owner[i] = g_owner[i] = owner
        else:
            jobs = [(i, "A") for i in layers] + [(i, "G") for i in layers]
            costs = [float(a_dims[i] if kind == "A" else g_dims[i]) ** 3 for i, kind in jobs]
            owners = longest_first(costs, ranks, load)
            for (i, kind), owner in zip(jobs, owners, strict=False):
                (a_owner if kind == "A" else g_owner)[i] = owner
    return WorkAssignment(
        world_size=world_size,
        grad_workers=workers,
        layer_group=tuple(layer_group),
        a_owner=tuple(a_owner),
        g_owner=tuple(g_owner),
    )
