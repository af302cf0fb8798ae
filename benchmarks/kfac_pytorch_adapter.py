"""kfac-pytorch (github.com/gpauloski/kfac-pytorch) as a contender: installed, built with our settings, loaded.

kfac-pytorch is not a dependency of hpcdl and not on PyPI. Its package is also named ``kfac``, like ours. Two ways
in: :func:`install` puts it in a site folder outside the repository, which a training process puts first on
PYTHONPATH and reaches through ``--kfac-impl`` (:func:`kfac_pytorch_preconditioner`, benchmarks/kfac_large_batch.py);
a benchmark that times both side by side in one process (benchmarks/kfac_overhead.py ``--kfac-pytorch``) calls
:func:`load_beside` for a renamed copy. A copy needs no installation: its ``__init__`` asks ``importlib.metadata``
for the version of ``kfac-pytorch``, so the copy gets a minimal dist-info (name and version) when the source has none.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SITE = Path(os.environ.get("KFAC_PYTORCH_SITE", Path.home() / ".cache" / "hpcdl" / "kfac-pytorch"))
# kfac-pytorch 0.4.2, the commit the committed results used.
SOURCE = "git+https://github.com/gpauloski/kfac-pytorch@869cf110334e5a6e9ea054bafdc4558313a821e8"
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
    if grad_scaler is not None and hasattr(grad_scaler, "get_scale"):
        # it recognises only the deprecated torch.cuda.amp.GradScaler; a callable returning the scale is its other form
        grad_scaler = grad_scaler.get_scale
    preconditioner = package.preconditioner.KFACPreconditioner(
        model, factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps, damping=damping,
        factor_decay=factor_decay, kl_clip=kl_clip, lr=lr, accumulation_steps=accumulation_steps,
        grad_scaler=grad_scaler)
    step = preconditioner.step
    preconditioner.step = lambda found_inf=None: step()
    return preconditioner


def install(source: str, site: Path) -> int:
    """kfac-pytorch into ``site``, a directory of its own outside the repository (never on hpcdl's path)."""
    env = dict(os.environ, SETUPTOOLS_SCM_PRETEND_VERSION="0.4.2")  # a source archive carries no git tags
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--upgrade", "--target", str(site), source]
    print(" ".join(command), flush=True)
    return subprocess.call(command, env=env)


def kfac_pytorch_preconditioner(config: Any, model: Any, current_lr: Callable[..., float], scaler: Any,
                                carry_over: bool = True) -> Any:
    """``--kfac-impl``'s plugin: kfac-pytorch (first on PYTHONPATH as ``kfac``) with hpcdl.train's settings.

    Damping and KL clip are hpcdl's divided by N² (N = examples per step on this rank): the Linear-layer
    equivalence of docs/kfac.md; conv layers have no single equivalent, which is kfac-pytorch's convention at work.
    """
    import kfac  # kfac-pytorch: the study puts its site directory first on PYTHONPATH

    if not hasattr(kfac, "preconditioner") or Path(kfac.__file__).resolve().is_relative_to(REPO):
        raise RuntimeError(f"kfac-pytorch is not first on PYTHONPATH (kfac is {kfac.__file__})")
    n = config.batch_size * config.batches_per_allreduce if carry_over else 1
    return build(kfac, model, factor_update_steps=config.kfac_factor_update_freq,
                 inv_update_steps=config.kfac_inv_update_freq, damping=config.kfac_damping / n**2,
                 factor_decay=config.kfac_factor_decay, kl_clip=config.kfac_kl_clip / n**2,
                 lr=lambda _step: current_lr(), accumulation_steps=config.batches_per_allreduce, grad_scaler=scaler)


# The same with ``--kfac-damping`` and ``--kfac-kl-clip`` taken as kfac-pytorch values, in its own convention.
kfac_pytorch_native_preconditioner = functools.partial(kfac_pytorch_preconditioner, carry_over=False)


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
    """kfac-pytorch from ``path``, imported as ``kfac_pytorch_beside`` so that it lives beside our ``kfac``, next to
    a minimal dist-info."""
    scratch = scratch or Path(os.environ.get("TMPDIR", "/tmp")) / f"kfac_pytorch_{os.getpid()}"
    info = scratch / f"kfac_pytorch-{version_of(path)}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kfac-pytorch\nVersion: {version_of(path)}\n")
    return renamed_copy(package_dir(path), RENAMED, scratch)


def renamed_copy(source: Path, name: str, scratch: Path) -> ModuleType:
    """The package ``source`` (any package named ``kfac``: kfac-pytorch's, or an older checkout's of ours) imported
    as ``name``: its files copied under ``scratch`` with their ``kfac`` imports renamed."""
    for file in source.rglob("*.py"):
        out = scratch / name / file.relative_to(source)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(_IMPORT.sub(rf"\g<1>{name}", file.read_text()))
    sys.path.insert(0, str(scratch))
    return importlib.import_module(name)
