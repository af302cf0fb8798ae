"""What the tests of benchmarks/ share: the large-batch study's script, imported as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
LARGE_BATCH_SCRIPT = REPO / "benchmarks" / "kfac_large_batch.py"


@pytest.fixture(scope="module")
def study() -> Any:
    """benchmarks/kfac_large_batch.py as a module, to call its functions directly."""
    spec = importlib.util.spec_from_file_location("kfac_large_batch", LARGE_BATCH_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kfac_large_batch"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
