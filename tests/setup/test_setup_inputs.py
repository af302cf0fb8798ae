"""scripts/setup.sh checks what it was asked for before it builds or links anything, and says exactly
what is wrong: a PYTHON that does not exist, a PYTHON without torch for HPCDL_TORCH=existing, a venv
that already holds its own torch. Each case fails within seconds; the venv given is left untouched.

The venvs here are stubs whose python answers yes to every check: setup must not trust the venv's
own torch when PYTHON's was asked for.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # runs bash

REPO = Path(__file__).resolve().parents[2]


def stub_venv(root: Path, existing_mark: str | None = None) -> Path:
    """A venv whose python exits 0 for anything (a venv that already 'has' torch, Horovod, ...)."""
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    if existing_mark is not None:
        (root / ".hpcdl-existing-torch").write_text(existing_mark + "\n")
    return root


def setup(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, HPCDL_CACHE=str(tmp_path / "cache"), **env)
    full.pop("PYTHON", None) if "PYTHON" not in env else None
    return subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], env=full, capture_output=True, text=True,
                          timeout=120)


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_existing_torch_from_a_python_that_does_not_exist(tmp_path: Path) -> None:
    venv = stub_venv(tmp_path / "venv", existing_mark="/nowhere/python3")
    before = contents(venv)
    done = setup(tmp_path, HPCDL_TORCH="existing", PYTHON="/nowhere/python3", HPCDL_VENV=str(venv))
    assert done.returncode != 0
    assert "PYTHON=/nowhere/python3: no such program" in done.stderr
    assert contents(venv) == before


def test_existing_torch_from_a_python_without_torch(tmp_path: Path) -> None:
    no_torch = tmp_path / "bare" / "python3"
    no_torch.parent.mkdir()
    no_torch.write_text("#!/bin/sh\nexec /usr/bin/env -i /usr/bin/python3 -I -S \"$@\"\n")  # no site-packages
    no_torch.chmod(0o755)
    venv = stub_venv(tmp_path / "venv", existing_mark=str(no_torch))
    done = setup(tmp_path, HPCDL_TORCH="existing", PYTHON=str(no_torch), HPCDL_VENV=str(venv))
    assert done.returncode != 0
    assert f"HPCDL_TORCH=existing, but PYTHON={no_torch} cannot use its torch and torchvision" in done.stderr
    assert "No module named 'torch'" in done.stderr


def test_existing_torch_into_a_venv_with_its_own_torch(tmp_path: Path) -> None:
    venv = stub_venv(tmp_path / "venv")  # no mark: made by HPCDL_TORCH=pip
    python = REPO / ".venv" / "bin" / "python"
    done = setup(tmp_path, HPCDL_TORCH="existing", PYTHON=str(python), HPCDL_VENV=str(venv))
    assert done.returncode != 0
    assert f"{venv} was made with its own torch; remove it or choose another HPCDL_VENV" in done.stderr


def test_a_new_venv_from_a_python_that_does_not_exist_does_not_blame_python3_venv(tmp_path: Path) -> None:
    done = setup(tmp_path, PYTHON="/nowhere/python3", HPCDL_VENV=str(tmp_path / "new"))
    assert done.returncode != 0
    assert "PYTHON=/nowhere/python3: no such program" in done.stderr and "python3-venv" not in done.stderr
    assert not (tmp_path / "new").exists()


def test_a_python_that_is_not_python(tmp_path: Path) -> None:
    done = setup(tmp_path, PYTHON="/bin/false", HPCDL_VENV=str(tmp_path / "new"))
    assert done.returncode != 0 and "PYTHON=/bin/false is not a usable Python 3.9 or newer" in done.stderr


@pytest.mark.parametrize(("args", "env", "line"), [
    (["{tmp}/file/wheels"], {}, "wheelhouse: cannot make the folder {tmp}/file/wheels (Not a directory)"),
    (["--python-version", "nan", "{tmp}/w"], {}, "wheelhouse: --python-version takes 3.N, e.g. 3.12 (got 'nan')"),
    (["{tmp}/w"], {"PYTHON": "/nowhere/python3"}, "wheelhouse: PYTHON=/nowhere/python3: no such program"),
    ([], {}, "wheelhouse: which folder? e.g. make wheelhouse DIR=/scratch/hpcdl-wheels"),
])
def test_wheelhouse_checks_its_arguments_before_downloading(tmp_path: Path, args: list[str], env: dict[str, str],
                                                             line: str) -> None:
    (tmp_path / "file").write_text("x")
    done = subprocess.run(["bash", str(REPO / "scripts" / "wheelhouse.sh"),
                           *(a.format(tmp=tmp_path) for a in args)], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [line.format(tmp=tmp_path)]
    assert not (tmp_path / "w").exists()
