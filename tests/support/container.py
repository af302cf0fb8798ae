"""The CPU image for tests: built once per session by containers/build.sh (cached: seconds when built).

``hpcdl_image`` (a session fixture) returns the image directory that ch-run runs. Where it cannot
be built here (not root, build tools missing, no wheelhouse, no CUDA toolkit for Horovod's build)
the tests that need it skip with the build's own one-line reason; under CI=true or
HPCDL_REQUIRE_IMAGE=1 they fail instead (scripts/test.sh builds the image before the tests).
HPCDL_TEST_IMAGE=<dir> uses that image as it is.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "containers" / "build.sh"
PYTHON = REPO / ".venv" / "bin" / "python"
BUILD_TIMEOUT = 1800  # a fresh machine: Debian base, the wheelhouse's torch, maybe Horovod's build


def required() -> bool:
    return os.environ.get("CI") == "true" or os.environ.get("HPCDL_REQUIRE_IMAGE") == "1"


def build_image(timeout: float = BUILD_TIMEOUT) -> tuple[Path | None, str]:
    """(the image, "") or (None, why not): containers/build.sh's last line is the image's path."""
    given = os.environ.get("HPCDL_TEST_IMAGE")
    if given:
        return (Path(given), "") if Path(given).is_dir() else (None, f"HPCDL_TEST_IMAGE={given} is not a directory")
    if os.geteuid() != 0:
        return None, "building the image needs root (mmdebstrap, ch-run -w); set HPCDL_TEST_IMAGE to a built one"
    try:
        done = subprocess.run(["bash", str(BUILD), "--link", str(REPO / "images" / "hpcdl-cpu")],
                              capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return None, f"containers/build.sh did not finish in {timeout:.0f} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        errors = [line for line in done.stderr.splitlines() if "error:" in line] or done.stderr.splitlines()[-1:]
        return None, f"the image could not be built: {' '.join(errors) or 'exit ' + str(done.returncode)}"
    return Path(lines[-1]), ""


def existing_image() -> tuple[Path | None, str]:
    """(an image already built, "") or (None, why not), building nothing: HPCDL_TEST_IMAGE, or the one `make image`
    linked at images/hpcdl-cpu. Where the image is required (CI), it is built as for :func:`hpcdl_image`."""
    if required():
        return build_image()
    given = os.environ.get("HPCDL_TEST_IMAGE")
    image = Path(given) if given else REPO / "images" / "hpcdl-cpu"
    if image.is_dir():
        return image, ""
    return None, f"no image at {image} (make image builds it; HPCDL_TEST_IMAGE=<dir> names another)"


@pytest.fixture(scope="session")
def hpcdl_image() -> Iterator[Path]:
    image, reason = build_image()
    if image is None:
        if required():
            pytest.fail(f"container tests must run here (CI=true or HPCDL_REQUIRE_IMAGE=1) but {reason}")
        pytest.skip(reason)
    yield image


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without launch settings, as root may run Open MPI; plus extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "SLURM_", "HPCDL_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", USER=os.environ.get("USER", "root"), **extra)
    return env


# What a host shell with the project's venv active leaks into a rank unless the runtime stops it.
HOST_LEAKS = {
    "PYTHONPATH": str(REPO),
    "VIRTUAL_ENV": str(REPO / ".venv"),
    "PIP_INDEX_URL": "http://pip.invalid/simple",
    "PIP_FIND_LINKS": "/nonexistent/wheels",
}


def leaky_env(**extra: str) -> dict[str, str]:
    """clean_env with the host venv first on PATH and its variables set: what ranks must not see."""
    env = clean_env(**HOST_LEAKS, **extra)
    env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    return env
