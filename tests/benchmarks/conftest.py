"""What the tests of benchmarks/ share: the large-batch study's script, imported as a module."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.support.scripts import load_benchmark


@pytest.fixture(scope="module")
def study() -> ModuleType:
    """benchmarks/kfac_large_batch.py as a module (test files of other studies override this fixture)."""
    return load_benchmark("kfac_large_batch")
