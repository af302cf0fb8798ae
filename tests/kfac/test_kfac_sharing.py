"""What K-FAC's decompositions put on the wire (kfac.sharing with each method's wire form, kfac.methods).

The collectives themselves are tested across ranks against MPI's in test_kfac_mpi.py; here a two-member group
whose other member is simulated shows what one rank hands to the allgather, and that the wire form of every
method comes back bit for bit (so the owner and every receiver apply the same decomposition).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from kfac import solve
from kfac.assignment import WorkAssignment
from kfac.comm import buffer_to_tensors
from kfac.factors import upper_size
from kfac.methods import METHODS, Eigen, FactorJob, Inverse, Newton
from kfac.sharing import Sharing


def _factor(n: int, rank: int, seed: int) -> Tensor:
    """A covariance-like factor of rank ``rank`` (singular when rank < n)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, rank, generator=g, dtype=torch.float64)
    return (x @ x.T / rank).float()


class _PairGroup:
    """Ranks (0, 1) seen from rank 0: records what rank 0 sends; rank 1's part is ``theirs``."""

    def __init__(self, theirs: Tensor) -> None:
        self.ranks, self.theirs, self.sent = (0, 1), theirs, []

    def allgather_async(self, tensor: Tensor, sizes: Sequence[int], name: str) -> list[Tensor]:
        self.sent.append((tensor.clone(), list(sizes)))
        return [tensor, self.theirs]

    def wait_gathered(self, handle: list[Tensor]) -> list[Tensor]:
        return handle


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_decomposition_survives_its_wire_form_bit_for_bit(method: str) -> None:
    form = METHODS[method]()
    jobs = [FactorJob(("layer", n), _factor(n, rank, n), 1e-3, None) for n, rank in ((7, 3), (40, 40), (65, 10))]
    results, _ = form.decompose(jobs, torch.float32, cpu_limit=512)
    for job in jobs:
        n = job.factor.shape[0]
        wire = form.to_wire(results[job.key])
        assert [tuple(t.shape) for t in wire] == list(form.wire_shapes(n))
        back = form.from_wire([t.clone() for t in wire], n)
        assert all(torch.equal(a, b) for a, b in zip(back, results[job.key], strict=True)), (method, n)


def test_an_inverse_is_exactly_symmetric_even_from_the_general_inverse() -> None:
    """A factor Cholesky rejects (indefinite beyond the damping) takes torch.linalg.inv, which is not symmetric
    to the bit; the upper triangle that travels must still be all of it."""
    n = 30
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, n, generator=g)
    indefinite = x + x.T  # eigenvalues of both signs
    (inverse,) = solve.damped_inverse(indefinite, 1e-3, torch.float32)
    assert torch.equal(inverse, inverse.T)
    dense = torch.linalg.inv(indefinite.double() + 1e-3 * torch.eye(n, dtype=torch.float64))
    assert torch.allclose(inverse.double(), dense, rtol=1e-4, atol=1e-4 * float(dense.abs().max()))


@pytest.mark.parametrize(("method", "elements"), [("eigen", lambda n: n * n + n), ("inverse", upper_size),
                                                  ("newton", upper_size)])
def test_an_owner_sends_its_method_wire_form_and_keeps_what_came_back(method: str, elements) -> None:
    """Two layers, rank 0 owning layer 0's A and G, rank 1 layer 1's: rank 0's share of the allgather holds
    eigen's (Q, d) or an inverse's upper triangle, and what it keeps equals what rank 1 rebuilds from it."""
    form: Eigen | Inverse = METHODS[method]() if method != "newton" else Newton()
    sizes = {(0, "A"): 9, (0, "G"): 4, (1, "A"): 12, (1, "G"): 5}
    assignment = WorkAssignment(world_size=2, grad_workers=2, layer_group=(0, 0), a_owner=(0, 1), g_owner=(0, 1))
    jobs = [FactorJob(key, _factor(n, n, i), 1e-2, None) for i, (key, n) in enumerate(sizes.items()) if key[0] == 0]
    results, _ = form.decompose(jobs, torch.float32, cpu_limit=512)
    mine = {key: tuple(t.clone() for t in value) for key, value in results.items()}
    theirs_numbers = sum(elements(sizes[(1, kind)]) for kind in "AG")
    theirs = torch.arange(theirs_numbers, dtype=torch.float32)
    group = _PairGroup(theirs)
    collectives: dict[str, int] = defaultdict(int)
    sharing = Sharing(0, lambda: torch.device("cpu"), None, collectives)
    sharing.rule = "allgather"
    sharing.decompositions(group, assignment, [0, 1], results, form, lambda i, kind: sizes[(i, kind)],
                           torch.float32)
    (sent, counts), = group.sent
    assert counts == [elements(9) + elements(4), theirs_numbers]
    assert sent.numel() == counts[0]
    for key in ((0, "A"), (0, "G")):  # the owner's own: bit for bit what it computed, and what a receiver rebuilds
        assert all(torch.equal(a, b) for a, b in zip(results[key], mine[key], strict=True)), key
    rebuilt = form.from_wire(buffer_to_tensors(sent[: elements(9)], form.wire_shapes(9)), 9)
    assert all(torch.equal(a, b) for a, b in zip(rebuilt, mine[(0, "A")], strict=True))
    assert set(results) == set(sizes)  # rank 1's arrived too, in the layers' shapes
    assert [tuple(t.shape) for t in results[(1, "A")]] == ([(12, 12), (12,)] if method == "eigen" else [(12, 12)])
