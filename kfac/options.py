"""KFACOptions: the preconditioner's settings, checked together before anything is built.

Every range a setting accepts is stated here, once, so that a bad value is one ``ValueError`` naming it,
raised before the model's layers are found or a collective is set up. kfac/ stands alone (it imports nothing
from hpcdl), so it states its ranges itself. The defaults are ``KFACPreconditioner``'s signature (the public,
documented one); the docstring there says what each setting means.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kfac.layers import CONV_APPROXIMATIONS, SkipSpec
from kfac.methods import METHODS, Eigen, Inverse, Newton

Schedule = float | Callable[[int], float]
# The payload precisions offered for what K-FAC shares by allgather: bfloat16 has float32's exponent range
# (eigenvalues cannot overflow as in float16).
COMM_DTYPES = (None, torch.bfloat16)
# What float32 inputs may be rounded to before the factor statistics: bfloat16's exponent range is float32's, so
# a mean loss's small output gradients (and large activations) stay representable, as float16's would not.
STATISTICS_DTYPES = (None, torch.bfloat16)


def schedule_value(schedule: Schedule, step: int) -> float:
    """A schedule's value at ``step``: the constant, or the callable's answer."""
    return float(schedule(step)) if callable(schedule) else float(schedule)


def check_schedule(name: str, schedule: Schedule, below_one: bool = False) -> None:
    """A constant hyperparameter must be finite and > 0 (``below_one``: in [0, 1)); a callable is the user's."""
    if callable(schedule):
        return
    value = float(schedule)
    accepted = "[0, 1)" if below_one else "> 0"
    inside = 0 <= value < 1 if below_one else 0 < value < math.inf
    if not inside:
        raise ValueError(f"{name} must be {accepted} or a callable of the step, got {schedule}")


@dataclass(frozen=True)
class KFACOptions:
    """The settings of one KFACPreconditioner, checked on creation; ``method`` given by name becomes an
    instance of its kfac.methods class (the one place names are turned into methods)."""

    factor_update_freq: int
    inv_update_freq: int
    damping: Schedule
    factor_decay: Schedule
    kl_clip: Schedule | None
    lr: Schedule
    grad_worker_fraction: float | str
    method: str | Eigen | Inverse
    eigen_dtype: torch.dtype
    loss_reduction: str
    skip_layers: Sequence[SkipSpec]
    colocate_factors: bool
    backward_passes_per_step: int
    late_decompositions: bool
    factor_examples: int | None
    cpu_eigen_limit: int
    comm_dtype: torch.dtype | None
    factor_comm_dtype: torch.dtype | None
    bucket_cap_mb: float
    conv_approximation: str
    tf32: bool = False
    statistics_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name, freq in (
            ("factor_update_freq", self.factor_update_freq),
            ("inv_update_freq", self.inv_update_freq),
            ("backward_passes_per_step", self.backward_passes_per_step),
        ):
            if not isinstance(freq, int) or freq < 1:
                raise ValueError(f"{name} must be a positive integer, got {freq!r}")
        check_schedule("damping", self.damping)
        check_schedule("factor_decay", self.factor_decay, below_one=True)
        if self.kl_clip is not None:
            check_schedule("kl_clip", self.kl_clip)
        if not isinstance(self.tf32, bool):
            raise ValueError(f"tf32 must be True or False, got {self.tf32!r}")
        object.__setattr__(self, "method", _method_of(self.method, self.tf32))
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        if self.eigen_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"eigen_dtype must be torch.float32 or torch.float64, got {self.eigen_dtype}")
        examples = self.factor_examples
        if examples is not None and (not isinstance(examples, int) or examples < 1):
            raise ValueError(f"factor_examples must be a positive integer or None, got {examples!r}")
        if not isinstance(self.cpu_eigen_limit, int) or self.cpu_eigen_limit < 0:
            raise ValueError(f"cpu_eigen_limit must be a non-negative integer, got {self.cpu_eigen_limit!r}")
        for name, dtype in (("comm_dtype", self.comm_dtype), ("factor_comm_dtype", self.factor_comm_dtype)):
            if dtype not in COMM_DTYPES:
                raise ValueError(f"{name} must be one of {COMM_DTYPES}, got {dtype}")
        if self.statistics_dtype not in STATISTICS_DTYPES:
            raise ValueError(f"statistics_dtype must be one of {STATISTICS_DTYPES}, got {self.statistics_dtype}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb!r}")
        fraction = self.grad_worker_fraction
        if fraction != "auto" and not isinstance(fraction, (int, float)):
            raise ValueError(f"grad_worker_fraction must be a number in (0, 1] or 'auto', got {fraction!r}")
        if self.conv_approximation not in CONV_APPROXIMATIONS:
            raise ValueError(f"conv_approximation must be one of {CONV_APPROXIMATIONS}, "
                             f"got {self.conv_approximation!r}")

    @property
    def solver(self) -> Eigen | Inverse:
        """The decomposition method (an instance: a name was resolved on creation)."""
        assert not isinstance(self.method, str)
        return self.method


def _method_of(method: str | Eigen | Inverse, tf32: bool) -> Eigen | Inverse:
    """A method named becomes its instance; newton's takes ``tf32`` (its first steps in TF32 on CUDA)."""
    if isinstance(method, str):
        if method not in METHODS:
            raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
        return Newton(tf32=True) if method == "newton" and tf32 else METHODS[method]()
    if not isinstance(method, (Eigen, Inverse)):
        raise ValueError(f"method must be one of {tuple(METHODS)} or a kfac.methods instance, got {method!r}")
    return method
