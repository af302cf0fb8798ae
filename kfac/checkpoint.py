"""The preconditioner's checkpoint: what a resumed run needs to continue bit for bit.

Besides the running factors and the step count, it holds per layer the factors that layer's installed
decompositions were computed from, with the step and the call that computed them (a :data:`Source`), and those
of the late decompositions in flight. Loading recomputes those decompositions from them, in the groups that
computed them (the layers one call decomposed are batched together), instead of from the running factors, which
would change the preconditioner until the next inverse update. A method that warm-starts from its previous
decompositions (newton) also saves the decompositions themselves: recomputed from their factors alone they would
differ at its tolerance. Every rank holds all factors, so any rank's state is complete, and it loads onto any
world size and grad worker fraction.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from kfac import solve
from kfac.layers import KFACLayer

# The factors (A, G) one layer's decompositions were computed from, the step, and which call of that step
# ("now", "first" or "late": the layers one call decomposed are batched together).
Source = tuple[Tensor | None, Tensor | None, int, str]
Pair = tuple[solve.Decomposition, solve.Decomposition]  # a layer's (A-side, G-side) decompositions
Factors = tuple[list[Tensor | None], list[Tensor | None]]  # (A, G) per layer


class Sources:
    """Per layer, the Source of its installed decompositions (``installed``) and of the late ones in flight
    (``late``)."""

    def __init__(self) -> None:
        self.installed: dict[int, Source] = {}
        self.late: dict[int, Source] = {}

    def note(self, stale: list[int], first: list[int], step: int, factors: Factors, late: bool,
             inverse_update: bool) -> None:
        """Record one step's decompositions: of the ``stale`` layers, ``first`` had none before. Without late
        decompositions all were installed now; with them the first ones were, and an inverse update installed
        the late ones in flight and started the rest."""
        a, g = factors
        if not late:
            self.installed.update({i: (a[i], g[i], step, "now") for i in stale})
            return
        self.installed.update({i: (a[i], g[i], step, "first") for i in first})
        if inverse_update:
            self.installed.update(self.late)
            self.late = {i: (a[i], g[i], step, "late") for i in stale if i not in first}


@dataclass
class KFACState:
    """The preconditioner's checkpoint, as :meth:`to_dict` saves it and :meth:`of` reads it back.

    ``held``: the decompositions of a warm-starting method (by layer, those this rank holds), or None; ``method``
    names the method they belong to (another method's would not fit).
    """

    steps: int
    layers: list[str]
    factors: Factors
    sources: Sources
    eigen_recoveries: dict[str, int]
    method: str
    held: dict[int, Pair] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Copies of everything (local, no collective); a factor that is also a source is saved once."""
        copies: dict[int, Tensor] = {}

        def copy(tensor: Tensor | None) -> Tensor | None:
            if tensor is None:
                return None
            if id(tensor) not in copies:
                copies[id(tensor)] = tensor.detach().clone()
            return copies[id(tensor)]

        def sources(held: dict[int, Source]) -> dict[int, Source]:
            return {i: (copy(a), copy(g), step, call) for i, (a, g, step, call) in sorted(held.items())}

        state = {
            "steps": self.steps,
            "layers": list(self.layers),
            "a_factors": [copy(f) for f in self.factors[0]],
            "g_factors": [copy(f) for f in self.factors[1]],
            "decomposed_from": sources(self.sources.installed),
            "late_from": sources(self.sources.late),
            "eigen_recoveries": dict(self.eigen_recoveries),
        }
        if self.held is not None:
            held = {i: tuple(tuple(t.detach().clone() for t in side) for side in pair)
                    for i, pair in self.held.items()}
            state["decompositions"] = {"method": self.method, "held": held}
        return state

    @classmethod
    def of(cls, state: dict[str, Any], layers: Sequence[KFACLayer], method: str) -> KFACState:
        """A saved :meth:`to_dict` for these layers, its tensors on their devices in their precision. A state saved
        before the sources were kept has none (its decompositions then come from the running factors, which
        continues exactly only from an inverse update)."""
        names = [layer.name for layer in layers]
        if list(state["layers"]) != names:
            raise ValueError(f"K-FAC state is for layers {list(state['layers'])}, this model has {names}")
        loaded: dict[int, Tensor] = {}  # one tensor here for one saved twice

        def restored(saved: Tensor | None, i: int, key: str) -> Tensor | None:
            if saved is None:
                return None
            layer = layers[i]
            dim = layer.a_dim if key == "A" else layer.g_dim
            if tuple(saved.shape) != (dim, dim):
                raise ValueError(f"K-FAC state for {layer.name}: {key} factor has shape {tuple(saved.shape)}, "
                                 f"expected {(dim, dim)}")
            if id(saved) not in loaded:
                loaded[id(saved)] = saved.detach().to(device=layer.device, dtype=layer.dtype).clone()
            return loaded[id(saved)]

        factors: Factors = ([restored(f, i, "A") for i, f in enumerate(state["a_factors"])],
                            [restored(f, i, "G") for i, f in enumerate(state["g_factors"])])
        sources = Sources()
        sources.installed, sources.late = (
            {int(i): (restored(a, int(i), "A"), restored(g, int(i), "G"), int(step), str(call))
             for i, (a, g, step, call) in state.get(key, {}).items()}
            for key in ("decomposed_from", "late_from")
        )
        saved = state.get("decompositions")
        held = None
        if saved is not None and saved["method"] == method:
            def moved(i: int, side: solve.Decomposition) -> solve.Decomposition:
                return tuple(t.to(layers[i].device) for t in side)

            held = {int(i): (moved(int(i), a), moved(int(i), g)) for i, (a, g) in saved["held"].items()}
        return cls(int(state["steps"]), names, factors, sources, dict(state.get("eigen_recoveries", {})), method, held)

    def calls(self) -> list[tuple[int, list[int]]]:
        """The installed decompositions' calls in the order they ran: (the step, the layers it decomposed)."""
        calls: dict[tuple[int, str], list[int]] = defaultdict(list)
        for i, (_, _, step, call) in self.sources.installed.items():
            calls[(step, call)].append(i)
        return [(step, layers) for (step, _), layers in sorted(calls.items())]


def factors_of(sources: dict[int, Source], n: int) -> Factors:
    """The (A, G) lists of ``n`` layers that these sources name (None elsewhere)."""
    a: list[Tensor | None] = [None] * n
    g: list[Tensor | None] = [None] * n
    for i, (a_i, g_i, _, _) in sources.items():
        a[i], g[i] = a_i, g_i
    return a, g
