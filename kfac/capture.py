"""Hooks that collect one layer's factor statistics while the model runs forward and backward.

A forward hook adds the input's Σ a aᵀ and registers a hook on the output tensor; that hook
adds Σ g gᵀ of the gradient reaching the output, scaled to per-example gradients when the loss
is a mean (``per_example_factor`` = backward passes per step, for a loss divided by them; 0 for
a summed loss). With ``pass_examples`` only the first ``pass_examples[j]`` examples of pass j feed
the sums (the preconditioner deals a step's budget over ranks and passes): a factor is an average,
and a few hundred examples (times their positions, for a convolution) estimate it about as well as
thousands, at a fraction of the cost. The per-example scale still uses the whole pass. When
every forward call of the step has seen its gradient the layer is complete and ``on_complete`` is
called, still inside backward, so that its allreduce can overlap the rest of backward. A layer
whose output never receives a gradient (an unused branch) simply never completes.

The hooks' own work runs inside the model's forward and backward; ``timed(where)`` (``where`` is
"forward" or "backward") wraps it, so that the preconditioner can count it as its ``statistics``
phase and take it out of the pass it ran in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kfac.factors import BatchStatistics
from kfac.layers import KFACLayer
from kfac.precision import fp32_products, statistics_input


class LayerCapture:
    """Accumulates one layer's statistics for the current step."""

    def __init__(
        self,
        layer: KFACLayer,
        is_capturing: Callable[[], bool],
        per_example_factor: float,
        on_complete: Callable[[LayerCapture], None],
        pass_examples: Sequence[int] | None = None,
        timed: Callable[[str], AbstractContextManager[None]] | None = None,
        precision: str = "ieee",
        statistics_dtype: torch.dtype | None = None,
    ) -> None:
        self.layer = layer
        self._precision = precision  # of the statistics' float32 products on CUDA: 'ieee' or 'tf32'
        self._rounding = statistics_dtype  # float32 inputs rounded to it first (kfac.precision.statistics_input)
        self._timed = timed if timed is not None else _untimed
        self._pass_examples = pass_examples
        self._is_capturing = is_capturing
        self._per_example_factor = per_example_factor
        self._on_complete = on_complete
        self._handle: RemovableHandle = layer.module.register_forward_hook(self._forward_hook)
        self.new_step()

    def new_step(self) -> None:
        """Forget this step's passes (:meth:`reset` forgets only the sums of the pass just collected)."""
        self.passes = 0  # passes of this step collected so far: the next pass's index
        self.reset()

    def reset(self) -> None:
        self.a_sum: Tensor | None = None
        self.a_count = 0.0
        self.g_sum: Tensor | None = None
        self.g_count = 0.0
        self.forwards = 0
        self.backwards = 0
        self.launched = False
        self._limit: int | None = None

    @property
    def complete(self) -> bool:
        return self.forwards > 0 and self.forwards == self.backwards

    def statistics(self) -> BatchStatistics | None:
        """This step's sums, or None when the layer did not get through forward and backward."""
        if not self.complete:
            return None
        assert self.a_sum is not None and self.g_sum is not None
        return BatchStatistics(self.a_sum, self.a_count, self.g_sum, self.g_count)

    def remove(self) -> None:
        self._handle.remove()

    def _forward_hook(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if not (module.training and torch.is_grad_enabled() and self._is_capturing()):
            return
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        with self._timed("forward"):
            self._limit = self._limit_of_pass(self.passes)
            x = statistics_input(self._first(inputs[0].detach()), self._rounding)
            with torch.no_grad(), torch.autocast(x.device.type, enabled=False), fp32_products(self._precision):
                moment, count = self.layer.a_moment(x)
            self.a_sum = moment if self.a_sum is None else self.a_sum.add_(moment)
            self.a_count += count
            self.forwards += 1
            output.register_hook(self._gradient_hook)

    def _limit_of_pass(self, index: int) -> int | None:
        shares = self._pass_examples
        return None if shares is None else shares[min(index, len(shares) - 1)]

    def _first(self, tensor: Tensor) -> Tensor:
        limit = self._limit
        return tensor if limit is None else self.layer.first_examples(tensor, limit)

    def _gradient_hook(self, grad_output: Tensor) -> None:
        with self._timed("backward"):
            device = grad_output.device.type
            with torch.no_grad(), torch.autocast(device, enabled=False), fp32_products(self._precision):
                moment, count = self.layer.g_moment(statistics_input(self._first(grad_output), self._rounding))
                if self._per_example_factor:  # the per-example gradient of a mean-reduced loss: N x grad_output
                    moment.mul_((self._per_example_factor * self.layer.examples(grad_output)) ** 2)
            self.g_sum = moment if self.g_sum is None else self.g_sum.add_(moment)
            self.g_count += count
            self.backwards += 1
            if self.complete:
                self.passes += 1
                self._on_complete(self)


def _untimed(where: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def examples_per_pass(total: int, rank: int, world: int, passes: int) -> list[int]:
    """This rank's share of ``total`` factor examples for each of its ``passes`` backward passes.

    The W·k (rank, pass) slots are numbered rank·k + pass, which is the micro-batch numbering of
    gradient accumulation: one rank with k passes takes exactly the examples k ranks with one pass
    take. Slot s gets ⌊total / (W·k)⌋, plus one for the first total mod W·k slots, at least one."""
    slots = world * passes
    base, extra = divmod(total, slots)
    return [max(1, base + int(rank * passes + j < extra)) for j in range(passes)]
