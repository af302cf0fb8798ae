"""Sharing: how the members of a rank group hand each other their tensors, and what K-FAC shares that way.

Two things travel so: each factor's decomposition, from the rank that computed it to the other members of its
layer's worker group; and each layer's preconditioned gradient (its direction), from its grad worker to the
other members of its receiver block (grad_worker_fraction below 1). Every member knows every payload's shapes
from the plan (kfac.assignment), so only the values travel. :func:`share_by` picks the collective from the
payloads' sizes; all three only move bits, so they give the same result bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor

from kfac.assignment import WorkAssignment
from kfac.comm import buffer_to_tensors, chunk_overlaps, tensors_to_buffer
from kfac.decompose import Results
from kfac.solve import Decomposition

# What one member sends: (the shapes, known on every rank; its tensors on that member, else None; their dtype).
Payload = tuple[Sequence[Sequence[int]], Sequence[Tensor] | None, torch.dtype]
Key = tuple[int, str]  # (layer, "A" or "G")


class WireForm(Protocol):
    """How a method's decomposition of an n x n factor travels (kfac.methods: eigen's as is, an inverse's upper
    triangle)."""

    def wire_shapes(self, n: int) -> tuple[tuple[int, ...], ...]: ...

    def to_wire(self, decomposition: Decomposition) -> Decomposition: ...

    def from_wire(self, tensors: Sequence[Tensor], n: int) -> Decomposition: ...


SHARING_RULES = ("allgather", "sum", "scatter")
# What scatter's second collective costs beyond its bytes (a launch, Horovod's negotiation), in elements a link
# carries meanwhile: scatter is picked only where it saves more than this (256 KiB of fp32) over the others.
SCATTER_OVERHEAD_ELEMENTS = 1 << 16


def share_by(sizes: Sequence[int], rule: str = "auto") -> str:
    """'allgather', 'sum' or 'scatter' for parts of these sizes (elements; the same answer on every rank).

    Elements a link carries, W members: a ring allgather(v) moves the largest part through each of the
    W-1 hops, W·max; a sum of zero-padded slots, 2·Σ; scatter (an alltoall to W equal chunks, then an
    allgather of the chunks), max + Σ plus SCATTER_OVERHEAD_ELEMENTS for its second collective. ``rule``
    'auto' takes the cheapest (a tie goes to the one collective, allgather before sum); any of
    SHARING_RULES forces it.
    """
    if rule != "auto":
        if rule not in SHARING_RULES:
            raise ValueError(f"rule must be 'auto' or one of {SHARING_RULES}, got {rule!r}")
        return rule
    largest, total = max(sizes, default=0), sum(sizes)
    costs = {"allgather": len(sizes) * largest, "sum": 2 * total,
             "scatter": largest + total + SCATTER_OVERHEAD_ELEMENTS}
    return min(costs, key=lambda kind: costs[kind])  # the first of equals: dicts keep their order


class Sharing:
    """This rank's side of every share: ``device()``, where its buffers go (the model's: it may move after
    the preconditioner is built); the payload's precision on the wire (``wire``: None keeps each payload's
    own); the collectives counted by name into ``collectives``; and the collective's own time under ``timed()``."""

    rule = "auto"  # share_by's rule; tests force each collective

    def __init__(self, rank: int, device: Callable[[], torch.device], wire: torch.dtype | None,
                 collectives: dict[str, int],
                 timed: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        self.rank, self.device, self.wire = rank, device, wire
        self.collectives, self.timed = collectives, timed

    def gather_from_each(self, group: Any, name: str, payloads: dict[int, Payload]) -> dict[int, list[Tensor]]:
        """Every member of ``group`` sends its tensors to the others in one collective (or scatter's two);
        returns what each sent, widened back to its dtype.

        An allgather when the members' payloads are balanced; when a few members own most of it (ResNet-50's
        54 layers on 1,024 ranks), an allgather, whose ring carries the largest part through every hop, costs
        up to W times more than needed, so either each member writes its part into its own slot of a zeroed
        buffer and the group sums it as int32 words (one nonzero word plus zeros is that word: exact for every
        dtype), at twice the bytes of a balanced allgather, or (scatter) an alltoall hands member j the j-th of
        W equal chunks of the concatenated payload and an allgather of the chunks gives everyone all of it:
        max + Σ bytes a link for two collectives.
        """
        dtype, device = next(iter(payloads.values()))[2], self.device()
        wire = self.wire or dtype
        sizes = [sum(torch.Size(shape).numel() for shape in payloads[m][0]) for m in group.ranks]
        shapes, tensors, _ = payloads[self.rank]
        mine = (tensors_to_buffer(tensors, wire, device) if shapes and tensors is not None
                else torch.empty(0, dtype=wire, device=device))
        rule = share_by(sizes, self.rule)
        me = group.ranks.index(self.rank)
        with self.timed():
            if rule == "allgather":
                parts = group.wait_gathered(group.allgather_async(mine, sizes, name))
            elif rule == "sum":
                total = sum(sizes)
                words = -(-total * mine.element_size() // 4)  # the payload as whole int32 words
                slots = torch.zeros(words * 4 // mine.element_size(), dtype=wire, device=device)
                start = sum(sizes[:me])
                slots[start : start + mine.numel()] = mine
                summed = group.wait_sum(group.allreduce_sum_async(slots.view(torch.int32), name))
                parts = list(summed.view(wire)[:total].split(sizes))
            else:  # scatter: an alltoall and an allgather, or nothing when there is nothing to share
                parts = _scatter_then_gather(group, mine, sizes, me, name)
        self.collectives[name] += (2 if sum(sizes) else 0) if rule == "scatter" else 1
        received = {}
        for member, part in zip(group.ranks, parts, strict=True):
            member_shapes = payloads[member][0]
            received[member] = buffer_to_tensors(part.to(dtype), member_shapes) if member_shapes else []
        return received

    def decompositions(self, group: Any, assignment: WorkAssignment, layers: Sequence[int],
                       results: Results, form: WireForm, size_of: Callable[[int, str], int],
                       dtype: torch.dtype) -> None:
        """Every owner in ``group`` sends the decompositions of ``layers``' factors it computed (in ``results``
        on it) to the group, in the method's wire ``form``; ``results`` then holds every member's, the owner's
        own included as it came back from the wire (the same bits on every member)."""
        todo = set(layers)

        def owned(root: int) -> list[Key]:
            return [(i, kind) for i, kind in assignment.owned_factors(root) if i in todo]

        payloads: dict[int, Payload] = {}
        for root in group.ranks:
            items = owned(root)
            shapes = [shape for item in items for shape in form.wire_shapes(size_of(*item))]
            sent = [t for item in items for t in form.to_wire(results[item])] if root == self.rank else None
            payloads[root] = (shapes, sent, dtype)
        for root, tensors in self.gather_from_each(group, "kfac.decompositions", payloads).items():
            items_of_root = iter(tensors)
            for item in owned(root):
                n = size_of(*item)
                results[item] = form.from_wire([next(items_of_root) for _ in form.wire_shapes(n)], n)

    def directions(self, block: Any, assignment: WorkAssignment, grads: dict[int, Tensor],
                   directions: dict[int, Tensor], dtype: torch.dtype) -> None:
        """Each layer's grad worker in this receiver block sends its direction to the block (one share);
        ``directions`` then holds every layer of ``grads``."""
        payloads: dict[int, Payload] = {}
        layers_of = {}
        for root in block.ranks:
            layers_of[root] = [i for i in grads if assignment.gradient_source(i, root) == root]
            sent = [directions[i] for i in layers_of[root]] if root == self.rank else None
            payloads[root] = ([tuple(grads[i].shape) for i in layers_of[root]], sent, dtype)
        for root, tensors in self.gather_from_each(block, "kfac.directions", payloads).items():
            for i, tensor in zip(layers_of[root], tensors, strict=False):
                # The root too takes the copy it sent: same memory layout, same rounding downstream.
                directions[i] = tensor


def _scatter_then_gather(group: Any, mine: Tensor, sizes: Sequence[int], me: int, name: str) -> list[Tensor]:
    """Every member's part on every member (member ``me`` sends ``mine``): an alltoall hands member j the
    j-th of W equal chunks of the concatenated parts (chunk_overlaps), an allgather of the chunks, padded
    with zeros to equal length, brings them all to everyone, who cuts the parts back out."""
    overlaps, chunk = chunk_overlaps(sizes)
    total = sum(sizes)
    if total == 0:  # every member knows the sizes: nothing travels
        return [mine.new_empty(0) for _ in sizes]
    received = group.wait_alltoall(group.alltoall_async(mine, overlaps[me], [row[me] for row in overlaps], name))
    padded = mine.new_zeros(chunk)
    padded[: received.numel()] = received
    # A name of its own: Horovod keys its negotiation cache by name, and the alltoall's differs in kind.
    chunks = group.wait_gathered(group.allgather_async(padded, [chunk] * len(sizes), f"{name}.chunks"))
    return list(torch.cat(chunks)[:total].split(list(sizes)))
