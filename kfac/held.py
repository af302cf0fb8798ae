"""HeldDecompositions: the decompositions this rank holds, and the directions it computes with them.

Each layer's grad workers hold its (A-side, G-side) decompositions; every rank knows which layers have been
decomposed at all (``decomposed``: the same on every rank). The decompositions of layers with the same shapes
(eigenbases, or damped inverses) are stacked, so that one batched product serves them all: ResNets have many
layers of one shape, and a batched matmul per shape replaces a handful of small ones per layer (on a GPU, a
kernel launch each). The layers' own decompositions are views of the stacks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping
from typing import cast

import torch
from torch import Tensor

from kfac import solve
from kfac.methods import Eigen, Inverse

Pair = tuple[solve.Decomposition, solve.Decomposition]  # a layer's (A-side, G-side) decompositions


class HeldDecompositions:
    """Per layer, this rank's decompositions (``pairs``: None where it holds none) and whether the layer has any
    (``decomposed``); ``batches``: the stacks, as (their layers, the A-side stack, the G-side stack)."""

    def __init__(self, n: int, method: Eigen | Inverse) -> None:
        self._n, self._method = n, method
        self.pairs: list[Pair | None] = [None] * n
        self.decomposed = [False] * n
        self.batches: list[tuple[list[int], solve.Decomposition, solve.Decomposition]] = []
        self._denominators: dict[Hashable, tuple[float, Tensor]] = {}

    def install(self, layers: list[int], pairs: Mapping[int, Pair]) -> None:
        """``layers`` are decomposed now; this rank holds the ``pairs`` given (those it is a grad worker of)."""
        for i in layers:
            if i in pairs:
                self.pairs[i] = pairs[i]
            self.decomposed[i] = True
        self._stack_same_shapes()

    def clear(self) -> None:
        self.pairs = [None] * self._n
        self.decomposed = [False] * self._n
        self.batches, self._denominators = [], {}

    def directions(self, grads: Mapping[int, Tensor], damping: float, mine: Callable[[int], bool]) -> dict[int, Tensor]:
        """The K-FAC direction of each gradient (a (g_dim, a_dim) matrix per layer) this rank computes: a stack's
        layers in one batched product when all of them have a gradient, the others one by one, those whose grad
        worker this rank is (``mine``)."""
        directions: dict[int, Tensor] = {}
        for b, (layers, a_stack, g_stack) in enumerate(self.batches):
            present = [i for i in layers if i in grads]
            if len(present) < len(layers):  # a layer without gradient (single process): one by one below
                continue
            stacked = self._precondition(("batch", b), torch.stack([grads[i] for i in layers]), a_stack, g_stack,
                                         damping)
            directions.update(zip(layers, stacked, strict=False))
        for i in grads:
            if i in directions or not mine(i):
                continue
            a, g = cast(Pair, self.pairs[i])
            directions[i] = self._precondition(i, grads[i], a, g, damping)
        return directions

    def _precondition(self, key: Hashable, grad: Tensor, a: solve.Decomposition, g: solve.Decomposition,
                      damping: float) -> Tensor:
        """One layer's direction, or a stack's (every tensor with a leading batch dimension)."""
        if isinstance(self._method, Eigen):
            return solve.precondition_eigen(grad, a, g, self._denominator(key, damping, a[1], g[1]))
        return self._method.precondition(grad, a, g)

    def _denominator(self, key: Hashable, damping: float, da: Tensor, dg: Tensor) -> Tensor:
        """d_G d_Aᵀ + λ for the eigen method, kept until the decompositions or the damping change."""
        cached = self._denominators.get(key)
        if cached is None or cached[0] != damping:
            cached = (damping, solve.eigen_denominator(da, dg, damping))
            self._denominators[key] = cached
        return cached[1]

    def _stack_same_shapes(self) -> None:
        self.batches, self._denominators = [], {}
        by_shape: dict[tuple, list[int]] = defaultdict(list)
        for i, pair in enumerate(self.pairs):
            if pair is not None:
                a, g = pair
                by_shape[(a[0].shape[0], g[0].shape[0], a[0].dtype, a[0].device)].append(i)
        for layers in by_shape.values():
            if len(layers) < 2:
                continue
            held = [cast(Pair, self.pairs[i]) for i in layers]
            a_stack, g_stack = (tuple(torch.stack([d[side][part] for d in held]) for part in range(len(held[0][side])))
                                for side in (0, 1))
            for k, i in enumerate(layers):
                self.pairs[i] = (tuple(t[k] for t in a_stack), tuple(t[k] for t in g_stack))
            self.batches.append((layers, a_stack, g_stack))
