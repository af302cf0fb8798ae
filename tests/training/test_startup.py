"""What a rank imports before its first step: every rank of every run pays it, and a flag error waits for it.

torchvision (which loads torch's compiler stack), timm and scikit-learn cost a second or more together;
hpcdl.train imports none of them until a run needs one (JPEG decoding, a timm update rule, the digits
split's first load on this machine).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torchvision", "timm", "sklearn")


@pytest.mark.processes
def test_importing_hpcdl_train_loads_no_torchvision_timm_or_sklearn() -> None:
    code = ("import sys, hpcdl.train, hpcdl.training.optimizers, hpcdl.data.pipeline, hpcdl.data.unpack\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
