"""Offline setup: `make wheelhouse DIR=...` on a networked machine, then `HPCDL_WHEELHOUSE=DIR make setup`
with the network really cut (a new, empty Linux network namespace: `unshare -n`).

The wheelhouse is built once per machine into a cache folder named after the pins (versions.env and
pyproject.toml), so a rerun of the suite costs only the offline install. The offline install may take
Horovod's wheel from setup's wheel cache (the same key the main setup built; compiling it again would
add minutes), but everything else -- torch and its CUDA libraries, every pin, mpi4py built from its
sdist, hpcdl itself -- comes from the folder. The other setup.sh modes (existing torch) have their own
tests below, without the 2.6 GB torch install.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HPCDL_CACHE", Path.home() / ".cache" / "hpcdl"))

RUN_HERE = os.environ.get("CI") == "true" or os.environ.get("HPCDL_OFFLINE_TEST") == "1"
needs_ci = pytest.mark.skipif(
    not RUN_HERE,
    reason="installs torch's 2.6 GB of CUDA wheels into a scratch venv (about 5 minutes): runs in CI (CI=true) "
    "or with HPCDL_OFFLINE_TEST=1",
)


def can_cut_the_network() -> str | None:
    """None when `unshare -n` works here, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare -n refused: {probe.stderr.strip()} (needs root)"


def wheelhouse_key() -> str:
    text = (REPO / "scripts" / "versions.env").read_bytes() + (REPO / "pyproject.toml").read_bytes()
    return hashlib.sha256(text + sys.version.encode()).hexdigest()[:16]


def cached_wheelhouse() -> Path:
    """The wheelhouse for these pins, built by `make wheelhouse` on first use (network needed then)."""
    folder = CACHE / "wheelhouse" / wheelhouse_key()
    if not (folder / "hpcdl-wheelhouse.txt").exists():
        result = subprocess.run(["make", "-s", "wheelhouse", f"DIR={folder}"], cwd=REPO, capture_output=True,
                                text=True, timeout=1200)
        assert result.returncode == 0, result.stdout + result.stderr
    return folder


@needs_ci
@pytest.mark.timeout(1800)  # a first run also builds the wheelhouse; an offline install alone is 2-5 minutes
def test_setup_completes_from_a_wheelhouse_with_the_network_cut(tmp_path: Path) -> None:
    reason = can_cut_the_network()
    if reason:
        pytest.fail(f"the offline test must cut the network and cannot: {reason}")
    wheelhouse = cached_wheelhouse()
    names = {p.name for p in wheelhouse.iterdir()}
    assert any(n.startswith("torch-") and n.endswith(".whl") for n in names)
    assert f"horovod-{versions()['HOROVOD_VERSION']}.tar.gz" in names
    assert any(n.startswith(("cffi-", "pycparser-", "cmake-")) for n in names)

    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(HPCDL_WHEELHOUSE=str(wheelhouse), HPCDL_VENV=str(venv), HPCDL_CACHE=str(CACHE), HPCDL_TORCH="pip")
    # In the new namespace there is no interface but the loopback, brought up as on any node (MPI's
    # own checks need one interface): prove that nothing outside is reachable, then set up.
    script = (
        "set -e\n"
        "ip link set lo up 2>/dev/null || true\n"
        f"if {sys.executable} -c \"import socket; socket.create_connection(('pypi.org', 443), timeout=5)\" "
        "2>/dev/null; then echo 'network still reachable'; exit 99; fi\n"
        "bash scripts/setup.sh\n"
    )
    result = subprocess.run(["unshare", "-n", "bash", "-c", script], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=1500)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert f"offline: installing only from {wheelhouse}" in output
    assert "[setup] ready" in output
    check = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import torch, torchvision, horovod.torch as hvd, mpi4py, hpcdl, kfac, pytest_mpi, os, sys\n"
         "assert hasattr(hvd, 'init') and hvd.mpi_built() and hvd.gloo_built()\n"
         "print(torch.__file__); print(mpi4py.__file__)"],
        capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr
    assert all(line.startswith(str(venv)) for line in check.stdout.split()), check.stdout  # the venv's own copies


def versions() -> dict[str, str]:
    pins = {}
    for line in (REPO / "scripts" / "versions.env").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            name, value = line.split("=", 1)
            pins[name] = value.strip('"')
    return pins


# ---------------------------------------------------------------- an existing torch (no second copy)


def test_setup_rejects_an_unknown_torch_mode(tmp_path: Path) -> None:
    env = dict(os.environ, HPCDL_TORCH="conda", HPCDL_VENV=str(tmp_path / "v"))
    result = subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "HPCDL_TORCH must be auto, pip or existing" in result.stderr
    assert not (tmp_path / "v").exists()


def test_setup_rejects_an_unknown_horovod_choice(tmp_path: Path) -> None:
    env = dict(os.environ, HPCDL_HOROVOD="maybe", HPCDL_VENV=str(tmp_path / "v"))
    result = subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "HPCDL_HOROVOD must be auto, 1 or 0 (got 'maybe')" in result.stderr
    assert not (tmp_path / "v").exists()


def test_a_missing_wheelhouse_is_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, HPCDL_WHEELHOUSE=str(tmp_path / "nowhere"), HPCDL_VENV=str(tmp_path / "v"))
    result = subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "is not a folder (make one with: make wheelhouse DIR=...)" in result.stderr


@pytest.mark.timeout(1800)
def test_existing_torch_is_linked_not_installed(tmp_path: Path) -> None:
    """HPCDL_TORCH=existing with PYTHON = an environment that has torch (here: the project venv, as a site
    module or a container would have it). The new venv must import that same torch, install no torch of
    its own, and build mpi4py and install hpcdl itself. Offline, from a wheelhouse of the small pieces."""
    if not RUN_HERE:
        pytest.skip("builds mpi4py in a scratch venv (a minute or two): runs in CI (CI=true) "
                    "or with HPCDL_OFFLINE_TEST=1")
    venv = tmp_path / "venv"
    base = Path(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(HPCDL_TORCH="existing", PYTHON=str(base), HPCDL_VENV=str(venv), HPCDL_CACHE=str(CACHE),
               HPCDL_WHEELHOUSE=str(cached_wheelhouse()))
    result = subprocess.run(["unshare", "-n", "bash", "-c", "ip link set lo up 2>/dev/null; bash scripts/setup.sh"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "3/6 torch (existing)" in output
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import torch, mpi4py, hpcdl; print(torch.__file__); print(mpi4py.__file__)"],
                           capture_output=True, text=True, timeout=300)
    torch_file, mpi4py_file = probe.stdout.split()
    import torch

    assert torch_file == torch.__file__  # the existing one
    assert mpi4py_file.startswith(str(venv))  # built here against the MPI on PATH
    assert not list((venv / "lib").glob("python*/site-packages/torch"))  # no second torch
