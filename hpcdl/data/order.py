"""Which samples each rank sees in each epoch, and the seeds of their augmentation.

One global permutation per epoch, drawn from ``(seed, epoch)`` alone, is cut to a whole number of
steps for every rank (``drop_last``: fewer than ``size * batch`` samples wait for the next epoch)
and dealt out round-robin. So every sample of the cut is seen exactly once across ranks, every
rank takes the same number of steps, and batch ``k`` of an epoch can be rebuilt without the
batches before it: resuming at step ``k`` is exact. Nothing here reads global RNG state.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from hpcdl.runtime.errors import UsageError


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from several integers; nearby inputs give unrelated seeds (unlike ``seed + epoch``)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(parts)}q", *parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def steps_per_epoch(samples: int, size: int, batch_size: int) -> int:
    return (samples // size) // batch_size


def check_enough(samples: int, size: int, batch_size: int) -> None:
    if steps_per_epoch(samples, size, batch_size) < 1:
        raise UsageError(
            f"{samples} training samples cannot give {size} ranks a batch of {batch_size} each; "
            "use fewer ranks or a smaller --batch-size"
        )


def epoch_permutation(samples: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch))
    return torch.randperm(samples, generator=generator)


def rank_order(samples: int, seed: int, epoch: int, rank: int, size: int, batch_size: int) -> torch.Tensor:
    """This rank's sample indices for the epoch, ``steps * batch_size`` of them: batch k is ``[k*B:(k+1)*B]``."""
    used = steps_per_epoch(samples, size, batch_size) * batch_size * size
    return epoch_permutation(samples, seed, epoch)[:used][rank::size]


def test_order(samples: int, rank: int, size: int) -> range:
    """Indices rank, rank+size, ... of the evaluation set: disjoint shards covering it exactly once."""
    return range(rank, samples, size)
