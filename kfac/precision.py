"""The precision of each K-FAC stage, whatever the training script chose for its own matmuls.

K-FAC's products are not the model's: its factors are sums of millions of small outer products
and its solve divides by eigenvalues that span many orders of magnitude, so TF32's 10-bit
mantissa (about 1e-3 relative) would put the result far outside the dense-solve tolerance the
tests hold (1e-5). The policy, documented in docs/kfac.md:

- factors: float32 (float64 for a float64 model), autocast off, cuBLAS and cuDNN in IEEE fp32; with the
  preconditioner's ``tf32=True``, TF32 products with float32 accumulation on CUDA: each factor is then the
  exact moment of inputs rounded to TF32 (about 1e-3 relative), far inside the batch-to-batch noise of
  the estimate, and the statistics use the GPU's matrix units (several times IEEE fp32's rate);
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

import torch


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
