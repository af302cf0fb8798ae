"""Keep freed memory in the process: a CPU training step then stops paying page faults.

A CPU training step allocates and frees the same large activation buffers every step (4 MiB each
for a CIFAR ResNet at batch 64, 75 MiB for ``mnist_cnn``'s first activations at batch 2048). glibc's
malloc serves large blocks with fresh ``mmap`` calls and hands freed memory at the top of the heap
back to the kernel, so every step faults the same pages in again, inside the forward and backward
passes where no phase timer can tell them from the model's work. Raising the trim threshold and
serving every block from the heap (no ``mmap`` for any size: the mmap threshold alone cannot rise
above 32 MiB) keeps the pages; what that is worth, and costs, is in docs/training.md ("keeping freed
memory"). The price is resident memory that stays at the step's peak, which a training job reaches
every step anyway. glibc still maps memory where the heap cannot grow (another thread's arena, an
address-space collision), so nothing that worked before fails.

``HPCDL_MALLOC_TUNING=0`` leaves glibc's defaults. Not glibc (macOS, musl): nothing to do.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting on 64-bit systems
TRIM_THRESHOLD = 1 << 30
MMAP_MAX = 0  # no block, of any size, gets a mapping of its own


def keep_freed_memory() -> bool:
    """Keep freed blocks of every size in this process's heap (glibc); True when the settings took."""
    if os.environ.get("HPCDL_MALLOC_TUNING", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_MMAP_MAX, MMAP_MAX))
    return all([bool(mallopt(option, value)) for option, value in settings])  # a list: every setting is applied
