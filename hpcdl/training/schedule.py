"""Learning-rate schedule as a pure function of training progress.

The rate depends on the fractional epoch (epoch + step/steps_per_epoch), not on a step count,
so a run resumed on a different number of ranks (different steps per epoch) continues the same
curve, rescaled to its new world size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up from ``base_lr`` to ``peak_lr``, then step decay (x0.1 per milestone) or cosine.

    ``base_lr`` is where the warm-up starts (see :func:`warmup_start`); at ``progress`` p < warmup
    the rate is base_lr + (peak_lr - base_lr) * p / warmup_epochs, so it reaches ``peak_lr`` exactly
    when the warm-up ends.
    """

    base_lr: float
    peak_lr: float
    warmup_epochs: float
    total_epochs: int
    kind: str = "step"
    milestones: Sequence[int] = ()

    def __call__(self, progress: float) -> float:
        """The learning rate at ``progress`` epochs into training."""
        if progress < self.warmup_epochs:
            return self.base_lr + (self.peak_lr - self.base_lr) * progress / self.warmup_epochs
        if self.kind == "cosine":
            span = max(self.total_epochs - self.warmup_epochs, 1e-12)
            done = min(1.0, (progress - self.warmup_epochs) / span)
            return 0.5 * self.peak_lr * (1 + math.cos(math.pi * done))
        passed = sum(1 for milestone in self.milestones if progress >= milestone)
        return self.peak_lr * (0.1**passed)


def lr_scale(world_size: int, batches_per_allreduce: int, use_adasum: bool, local_size: int, gpu: bool) -> float:
    """How much the per-rank base learning rate grows with the global batch.

    Averaging gradients over ranks makes the step that of a batch ``world_size`` times larger,
    so the rate scales linearly (Goyal et al. 2017). Adasum combines gradients adaptively and
    needs no such scaling across nodes; only the GPUs of one node are summed (as Horovod advises).
    """
    if use_adasum:
        return float(local_size if gpu else 1) * batches_per_allreduce
    return float(world_size * batches_per_allreduce)


def warmup_start(base_lr: float, peak_lr: float, start_factor: float | None) -> float:
    """The rate the warm-up starts from.

    By default the single-rank rate ``base_lr`` (Goyal et al.'s gradual warm-up from the rate of one
    worker's batch to the scaled one), which is no warm-up at all on one rank. With ``start_factor``
    the warm-up starts at that fraction of ``peak_lr`` whatever the world size, which is what a large
    batch reached on few ranks (gradient accumulation) needs.
    """
    return base_lr if start_factor is None else start_factor * peak_lr
