"""Keep freed memory in the process: a CPU training step then stops paying page faults.

A CPU training step allocates and frees the same large activation buffers (4 MiB each for a
CIFAR ResNet at batch 64) every step. glibc's malloc serves blocks above its mmap threshold
with fresh ``mmap`` calls and hands freed memory at the top of the heap back to the kernel, so
every step faults the same pages in again. On the development VM that cost 18 % of hpcdl's
resnet32 step, and more in hpcdl's loop than in a bare one (README, "Measured on this
machine"); we did not trace why the two differ. Raising the mmap and trim
thresholds keeps the pages. The price is resident memory that stays at the step's peak, which a
training job reaches every step anyway.

``HPCDL_MALLOC_TUNING=0`` leaves glibc's defaults. Not glibc (macOS, musl): nothing to do.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting on 64-bit systems
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True when they were set."""
    if os.environ.get("HPCDL_MALLOC_TUNING", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
