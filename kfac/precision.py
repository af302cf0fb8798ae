"""The precision of each K-FAC stage, whatever the training script chose for its own matmuls.

K-FAC's products are not the model's: its factors are sums of millions of small outer products
and its solve divides by eigenvalues that span many orders of magnitude, so TF32's 10-bit
mantissa (about 1e-3 relative) would put the result far outside the dense-solve tolerance the
tests hold (1e-5). The policy, documented in docs/kfac.md:

- factors: float32 (float64 for a float64 model), autocast off, cuBLAS and cuDNN in IEEE fp32; with the
  preconditioner's ``tf32=True``, TF32 products with float32 accumulation on CUDA: each factor is then the
  exact moment of inputs rounded to TF32 (about 1e-3 relative), far inside the batch-to-batch noise of
  the estimate, and the statistics use the GPU's matrix units (several times IEEE fp32's rate). Inputs that
  arrive in float16 or bfloat16 (a model under autocast) are multiplied as they are on CUDA, with float32
  accumulation into float32 results (:func:`operand`, :func:`mm`): every half value is exact in float32 and
  in TF32, so this is the product of their float32 copies without making the copies, at the matrix units'
  half-precision rate; their sums too are taken in float32 (:func:`wide_sum`). With the preconditioner's
  ``statistics_dtype=torch.bfloat16`` a float32 model's inputs are rounded to bfloat16 first
  (:func:`statistics_input`) and take that path: each factor is then the exact moment of the rounded inputs
  (about 4e-3 relative per input, checked against the float32 statistics on real factors in
  tests/kfac/test_kfac_precision.py), at twice TF32's rate; on a CPU the same factors, multiplied in float32;
- decompositions: float32 ``eigh`` (or ``eigen_dtype``), retried in float64 when it fails;
- preconditioning: the decompositions' dtype, cuBLAS in IEEE fp32.

:func:`ieee_fp32` switches TF32 off for the duration of a K-FAC stage and restores the caller's
setting afterwards (hpcdl.train's is TF32 on). It uses PyTorch's ``fp32_precision`` flags and
nothing else, as the caller must: once a process has set TF32 through both those and the legacy
``allow_tf32`` switches, torch 2.13 raises on any read of the legacy ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial

import torch
from torch import Tensor

HALF = (torch.float16, torch.bfloat16)
# cuBLAS's half-precision GEMMs with float32 results (torch's out_dtype; CUDA only): a name of its own, so that
# the tests can stand in an emulation where there is no GPU.
_half_mm = partial(torch.mm, out_dtype=torch.float32)
_half_bmm = partial(torch.bmm, out_dtype=torch.float32)


def statistics_input(t: Tensor, rounding: torch.dtype | None) -> Tensor:
    """A layer input or output gradient as the statistics take it: a float32 one rounded to ``rounding`` (the
    preconditioner's ``statistics_dtype``) when one is given, any other as it is (float64 keeps its accuracy,
    a half one is already half)."""
    return t.to(rounding) if rounding is not None and t.dtype == torch.float32 else t


def keeps_half(t: Tensor, dtype: torch.dtype) -> bool:
    """Whether the statistics multiply ``t`` in its own half precision: on CUDA, for float32 factors."""
    return t.dtype in HALF and t.is_cuda and dtype == torch.float32


def operand(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as the statistics' products read it: a half-precision tensor as it is where :func:`keeps_half`,
    else converted to the factors' ``dtype``."""
    return t if keeps_half(t, dtype) else t.to(dtype)


def result_dtype(t: Tensor) -> torch.dtype:
    """The dtype of products and sums of an :func:`operand`: float32 for a half one, else its own."""
    return torch.float32 if t.dtype in HALF else t.dtype


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of two 2-D operands, float32 from half ones (float32 accumulation)."""
    return _half_mm(a, b) if a.dtype in HALF else a @ b


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """``torch.bmm(a, b)`` of two operands, float32 from half ones (float32 accumulation)."""
    return _half_bmm(a, b) if a.dtype in HALF else torch.bmm(a, b)


def add_mm_(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``out += a @ b`` (``out`` of :func:`result_dtype`)."""
    return out.add_(_half_mm(a, b)) if a.dtype in HALF else out.addmm_(a, b)


def wide_sum(t: Tensor, dim: int) -> Tensor:
    """``t.sum(dim)`` in :func:`result_dtype` (a half sum would round its result to half)."""
    return t.sum(dim, dtype=result_dtype(t))


def ieee_fp32() -> AbstractContextManager[None]:
    """cuBLAS matmuls and cuDNN convolutions in full float32 inside the block (no TF32)."""
    return fp32_products("ieee")


@contextmanager
def fp32_products(precision: str) -> Iterator[None]:
    """cuBLAS matmuls and cuDNN convolutions of float32 at ``precision`` ('ieee' or 'tf32') inside the block."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv  # type: ignore[attr-defined]
    saved = (matmul.fp32_precision, conv.fp32_precision)
    if saved == (precision, precision):
        yield
        return
    matmul.fp32_precision = precision
    conv.fp32_precision = precision
    try:
        yield
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved
