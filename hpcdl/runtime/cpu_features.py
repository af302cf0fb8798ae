"""Whether this CPU computes bf16 natively, and the warning when it does not.

bf16 matrix products run on AVX512_BF16 or AMX (x86) or the BF16 extension (Arm); elsewhere
oneDNN converts every operand to fp32 and back, and ``--amp bf16`` trains about 12x slower than
fp32 (measured on an AMD EPYC with AVX2 only: issue 30). The probe is a function of its own so
that tests can stand in for a CPU they do not have.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

SLOW_BF16_WARNING = ("warning: --amp bf16 on a CPU without native bf16 (no AVX512_BF16, AMX or Arm BF16) runs about "
                     "12x slower than fp32; leave --amp off on this CPU")


def native_bf16() -> bool:
    """True when the CPU has bf16 arithmetic (AVX512_BF16 or AMX on x86, the BF16 extension on Arm)."""
    cpu = torch.cpu
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(cpu, "_is_amx_tile_supported",
                                                                          lambda: False)():
        return True
    if platform.machine().lower() in ("aarch64", "arm64"):
        try:
            return any(line.startswith("Features") and " bf16" in line
                       for line in Path("/proc/cpuinfo").read_text().splitlines())
        except OSError:
            return False
    return False


def slow_bf16_warning(amp_dtype: torch.dtype | None, device: torch.device) -> str | None:
    """The one-line warning for bf16 autocast on a CPU that emulates it, else None."""
    if amp_dtype != torch.bfloat16 or device.type != "cpu" or native_bf16():
        return None
    return SLOW_BF16_WARNING
