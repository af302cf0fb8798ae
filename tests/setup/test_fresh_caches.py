"""scripts/fresh_caches.sh: scripts/test.sh runs the tests with empty data and run caches (a fresh
machine's), keeping only the build caches setup makes, so that no test passes on an earlier run's leftovers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.processes

# After hpcdl_fresh_caches: the settings, and where hpcdl.fetch_mnist (and so every benchmark) looks for MNIST.
SHOW = f"""
source scripts/fresh_caches.sh
hpcdl_fresh_caches
for name in HPCDL_FRESH_CACHES XDG_CACHE_HOME HPCDL_CACHE PIP_CACHE_DIR TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR; do
  echo "$name=${{!name}}"
done
echo "entries=$(find "$HPCDL_FRESH_CACHES" -mindepth 1 | wc -l)"
echo "mnist=$({sys.executable} -c 'from hpcdl.tools.fetch_mnist import DEFAULT_OUTPUT; print(DEFAULT_OUTPUT)')"
"""


def fresh_caches(home: Path, **env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("XDG_CACHE_HOME", "HPCDL_CACHE", "PIP_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    done = subprocess.run(["bash", "-c", SHOW], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**base, "HOME": str(home), "TMPDIR": str(home), "PYTHONPATH": str(REPO), **env})
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


def test_data_and_run_caches_are_a_new_empty_folder_removed_at_the_end(tmp_path: Path) -> None:
    (tmp_path / ".cache" / "hpcdl" / "mnist").mkdir(parents=True)  # what an earlier run left behind
    seen = fresh_caches(tmp_path)
    fresh = Path(seen["HPCDL_FRESH_CACHES"])
    assert fresh.parent == tmp_path and fresh.name.startswith("hpcdl-test-caches.")
    assert seen["entries"] == "1"  # the empty cache folder itself
    for name in ("XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "mnist"):
        assert Path(seen[name]).is_relative_to(fresh), name
    assert Path(seen["mnist"]) == fresh / "cache" / "hpcdl" / "mnist"
    assert not fresh.exists()  # removed when the shell ended


def test_the_build_caches_setup_makes_stay_where_they_were(tmp_path: Path) -> None:
    seen = fresh_caches(tmp_path)
    assert seen["HPCDL_CACHE"] == str(tmp_path / ".cache" / "hpcdl")  # Horovod's wheels, wheelhouse, images
    assert seen["PIP_CACHE_DIR"] == str(tmp_path / ".cache" / "pip")
    elsewhere = fresh_caches(tmp_path, XDG_CACHE_HOME=str(tmp_path / "xdg"), HPCDL_CACHE=str(tmp_path / "builds"))
    assert elsewhere["HPCDL_CACHE"] == str(tmp_path / "builds") and elsewhere["PIP_CACHE_DIR"] == str(tmp_path / "xdg" / "pip")


def test_the_test_command_runs_the_tests_with_them() -> None:
    script = (REPO / "scripts" / "test.sh").read_text()
    setup, tests = script.index("hpcdl_fresh_caches"), script.index("-m pytest")
    assert "source scripts/fresh_caches.sh" in script and setup < tests
