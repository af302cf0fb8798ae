"""The two gradient backends as a test parameter (``--backend horovod|torch``); Horovod's cases skip where it is
not installed (a setup with HPCDL_HOROVOD=0)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

HOROVOD = importlib.util.find_spec("horovod") is not None
needs_horovod = pytest.mark.skipif(not HOROVOD, reason="Horovod is not installed (set up with HPCDL_HOROVOD=0)")


def backend_param(*values: str, id: str | None = None) -> Any:
    """A pytest.param of ``values`` (backend names, maybe with others), skipped without Horovod if one is horovod."""
    marks = [needs_horovod] if "horovod" in values else []
    return pytest.param(*values, marks=marks, id=id)


BACKENDS = [backend_param("horovod"), backend_param("torch")]
