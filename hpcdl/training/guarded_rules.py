"""The update rules hpcdl takes from other libraries, made to honour the loop's non-finite verdict.

timm's LARS, LAMB and Muon and pytorch-optimizer's SOAP have no fused kernel that reads the loop's
``found_inf`` flag, so :class:`SkipsNonFinite` reads it back to the host and leaves parameters and
state untouched when it is set: one device sync per step on a GPU, nothing on a CPU.

Muon is timm's, not ``torch.optim.Muon``: torch's takes 2-D parameters only (it refuses biases and
convolution kernels), and Horovod wraps one optimizer, while timm's flattens a kernel to
(out, in*kh*kw) and gives what is not a matrix its built-in AdamW at the same scheduled rate.

A module of its own because importing timm costs about half a second, which SGD and AdamW runs should
not pay at start-up (hpcdl.training.optimizers imports this module only when one of these rules is chosen).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from timm.optim import Lamb, Lars, Muon

from hpcdl.runtime.errors import UsageError

try:
    from pytorch_optimizer.optimizer.soap import SOAP
except ImportError as missing:  # a bare GPU image has no pytorch-optimizer: only --optimizer soap needs it
    _why = f"{type(missing).__name__}: {missing}"

    class SOAP(torch.optim.Optimizer):  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise UsageError(f"--optimizer soap needs the pytorch-optimizer package ({_why})")


class SkipsNonFinite:
    """Mixin: ``step()`` does nothing when the loop's ``found_inf`` flag is set (a host read)."""

    found_inf: torch.Tensor | None

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf):
            return None
        return super().step(closure)  # type: ignore[misc]


class GuardedLars(SkipsNonFinite, Lars):
    """timm's LARS (You et al. 2017): SGD with momentum and a per-layer trust ratio ||w|| / ||g||."""


class GuardedLamb(SkipsNonFinite, Lamb):
    """timm's LAMB (You et al. 2020): Adam moments with a per-layer trust ratio."""


class GuardedMuon(SkipsNonFinite, Muon):
    """timm's Muon (Jordan et al. 2024): momentum orthogonalised by Newton-Schulz for matrices, AdamW for the rest."""


class GuardedSoap(SkipsNonFinite, SOAP):
    """pytorch-optimizer's SOAP (Vyas et al. 2024): Adam in the eigenbasis of Shampoo's factors."""
