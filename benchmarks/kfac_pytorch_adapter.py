"""kfac-pytorch (github.com/gpauloski/kfac-pytorch) as a contender: built with our settings, loaded from a local copy.

kfac-pytorch is not a dependency of hpcdl and not on PyPI. Its package is also named ``kfac``, like ours. Two ways
in: a training process that puts its install first on PYTHONPATH (benchmarks/kfac_large_batch.py) imports it as
``kfac`` and calls :func:`build`; a benchmark that times both side by side in one process
(benchmarks/kfac_overhead.py ``--kfac-pytorch``) calls :func:`load_beside` for a renamed copy. A copy needs no
installation: its ``__init__`` asks ``importlib.metadata`` for the version of ``kfac-pytorch``, so the copy gets a
minimal dist-info (name and version) when the source has none.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

RENAMED = "kfac_pytorch_beside"  # the copy's package name, never ``kfac``
_IMPORT = re.compile(r"^(\s*(?:import|from)\s+)kfac(?=[.\s])", re.MULTILINE)


def build(package: ModuleType, model: Any, *, factor_update_steps: int, inv_update_steps: int, damping: float,
          factor_decay: float, kl_clip: float, lr: Any, accumulation_steps: int = 1, grad_scaler: Any = None) -> Any:
    """kfac-pytorch's preconditioner of ``model`` (``package``: its top-level module, whatever it is named); its
    ``step`` takes the training loop's ``found_inf`` and ignores it (kfac-pytorch has no non-finite skip)."""
    import torch

    for module in model.modules():  # its full backward hooks cannot precede an in-place op; same function
        if isinstance(module, torch.nn.ReLU):
            module.inplace = False
    preconditioner = package.preconditioner.KFACPreconditioner(
        model, factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps, damping=damping,
        factor_decay=factor_decay, kl_clip=kl_clip, lr=lr, accumulation_steps=accumulation_steps,
        grad_scaler=grad_scaler)
    step = preconditioner.step
    preconditioner.step = lambda found_inf=None: step()
    return preconditioner


def package_dir(path: Path) -> Path:
    """The ``kfac`` folder of kfac-pytorch under ``path`` (a checkout, an install site, or the folder itself);
    a one-line ValueError when it is not there."""
    for candidate in (path / "kfac", path):
        if (candidate / "preconditioner.py").is_file() and (candidate / "base_preconditioner.py").is_file():
            return candidate
    raise ValueError(f"no kfac-pytorch under {path} (expected kfac/preconditioner.py and kfac/base_preconditioner.py)")


def version_of(path: Path) -> str:
    """The version its dist-info or pyproject.toml names beside the package, else 0.0.0."""
    root = package_dir(path).parent
    for info in sorted(root.glob("kfac_pytorch-*.dist-info")):
        return info.name.removeprefix("kfac_pytorch-").removesuffix(".dist-info")
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
        if found:
            return found.group(1)
    return "0.0.0"


def load_beside(path: Path, scratch: Path | None = None) -> ModuleType:
    """kfac-pytorch from ``path``, imported as ``kfac_pytorch_beside`` so that it lives beside our ``kfac``: its
    files are copied with their ``kfac`` imports renamed, next to a minimal dist-info."""
    source = package_dir(path)
    scratch = scratch or Path(os.environ.get("TMPDIR", "/tmp")) / f"kfac_pytorch_{os.getpid()}"
    target = scratch / RENAMED
    for file in source.rglob("*.py"):
        out = target / file.relative_to(source)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(_IMPORT.sub(rf"\g<1>{RENAMED}", file.read_text()))
    info = scratch / f"kfac_pytorch-{version_of(path)}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kfac-pytorch\nVersion: {version_of(path)}\n")
    sys.path.insert(0, str(scratch))
    return importlib.import_module(RENAMED)
