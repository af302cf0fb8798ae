"""The update rule and the gradient preconditioner of a training job, built from the configuration.

Every rule honours the loop's non-finite verdict: the loop sets ``optimizer.found_inf`` (a 0-dim
device tensor, 1.0 = skip) before ``step()``. torch's fused SGD/Adam/AdamW read it on the device.
The other rules live in :mod:`hpcdl.training.guarded_rules`, imported only when one is chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hpcdl.runtime.errors import UsageError
from hpcdl.training.config import TrainConfig
from hpcdl.training.task import import_function

OPTIMIZERS = ("sgd", "adam", "adamw", "lars", "lamb", "muon", "soap")
FUSED = ("sgd", "adam", "adamw")  # read found_inf on the device


def build_update_rule(config: TrainConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The ``--optimizer`` rule over the model's parameters, at learning rate ``lr``.

    SGD/Adam/AdamW use torch's fused kernels, which take the non-finite flag on the device. LARS keeps
    timm's trust coefficient (0.001) and applies the trust ratio to every parameter, as timm does
    when weight decay is on; LAMB keeps timm's defaults (betas 0.9/0.999, global gradient-norm clip 1).
    Muon takes ``--momentum`` and otherwise timm's defaults (5 quintic Newton-Schulz steps in bf16, the
    rate scaled per matrix to AdamW's update size, so one rate serves its AdamW part too). SOAP keeps
    pytorch-optimizer's defaults (betas 0.95/0.95, eigenbases refreshed every 10 steps); its first step
    only gathers the factors, as SOAP's reference does. Weight decay is decoupled in Muon and SOAP.
    """
    params = list(model.parameters())
    name = config.optimizer
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=config.momentum, nesterov=config.nesterov,
                               weight_decay=config.weight_decay, fused=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=config.weight_decay, fused=True)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay, fused=True)
    if name not in OPTIMIZERS:
        raise UsageError(f"--optimizer must be one of {', '.join(OPTIMIZERS)} (got {name})")
    from hpcdl.training.guarded_rules import GuardedLamb, GuardedLars, GuardedMuon, GuardedSoap  # timm: on demand

    if name == "lars":
        return GuardedLars(params, lr=lr, momentum=config.momentum, nesterov=config.nesterov,
                           weight_decay=config.weight_decay)
    if name == "lamb":
        return GuardedLamb(params, lr=lr, weight_decay=config.weight_decay)
    if name == "muon":
        return GuardedMuon(params, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)
    return GuardedSoap(params, lr=lr, weight_decay=config.weight_decay)


def load_factory(spec: str) -> Callable[..., Any]:
    """``--kfac-impl module:function`` -> the function; a one-line UsageError when it cannot be imported."""
    return import_function(spec, "--kfac-impl", form="hpcdl or module:function")


def build_preconditioner(config: TrainConfig, model: nn.Module, current_lr: Callable[..., float],
                         scaler: torch.amp.GradScaler | None, communicator: Any = None, **settings: Any) -> Any:
    """hpcdl's K-FAC (``kfac/``), another implementation through ``--kfac-impl``, or None.

    ``communicator`` (a ``kfac.comm.Communicator``; default: the job's) lets a plugin watch K-FAC's
    collectives, e.g. benchmarks/kfac_traffic.py's byte counts. ``settings`` are KFACPreconditioner arguments
    that win over the config's: a plugin's way to a setting no flag offers (e.g. ``statistics_dtype``).

    The plugin point exists so that benchmarks can run another K-FAC (kfac-pytorch) inside this same
    training loop: ``module:function`` is called as ``function(config, model, current_lr, scaler)`` and
    returns an object with ``step(found_inf=...)``, ``state_dict()`` and ``load_state_dict(state)``.
    """
    if not config.kfac:
        return None
    if config.kfac_impl != "hpcdl":
        return load_factory(config.kfac_impl)(config, model, current_lr, scaler)
    from kfac import KFACPreconditioner

    arguments: dict[str, Any] = dict(
        factor_update_freq=config.kfac_factor_update_freq,
        inv_update_freq=config.kfac_inv_update_freq,
        damping=config.kfac_damping,
        factor_decay=config.kfac_factor_decay,
        kl_clip=config.kfac_kl_clip,
        lr=current_lr,
        grad_worker_fraction=config.kfac_grad_worker_fraction,
        backward_passes_per_step=config.batches_per_allreduce,  # factors accumulate like the gradients
        factor_examples=config.kfac_factor_examples,
        skip_layers=config.kfac_skip_layers,
        grad_scaler=scaler,  # its scale is divided out of G
        communicator=communicator,
        comm_dtype=torch.bfloat16 if config.kfac_comm_precision == "bf16" else None,
        factor_comm_dtype=torch.bfloat16 if config.kfac_factor_precision == "bf16" else None,
        conv_approximation=config.kfac_conv_approx,
        method=config.kfac_method,
        tf32=any(p.is_cuda for p in model.parameters()),  # like the model's own float32 products (job.train_in_tf32)
    ) | settings
    return KFACPreconditioner(model, **arguments)
