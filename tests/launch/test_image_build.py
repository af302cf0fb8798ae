"""The pieces the image build relies on, without building: the Horovod sdist patch (all of Horovod's
build fixes live in scripts/horovod_build.py), the wheel cache keys that decide whether a host's
Horovod and mpi4py wheels may go into an image, and the build's prerequisite script.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import horovod_build  # noqa: E402 - a script, not a package

HYDRA_VERSION = """HYDRA build details:
    Version:                                 4.0.2
    Release Date:                            Thu Apr  7 12:34:45 CDT 2022
"""


def fake_sdist(root: Path, standard: str = "14") -> Path:
    src = root / "horovod-0.28.1"
    (src / "horovod" / "torch").mkdir(parents=True)
    for name in horovod_build.CXX_STANDARD_FILES:
        (src / name).write_text(f"project(x)\nset(CMAKE_CXX_STANDARD {standard})\nadd_library(y)\n")
    return src


def test_the_sdist_patch_raises_cxx14_to_17_once(tmp_path: Path) -> None:
    src = fake_sdist(tmp_path)
    changed = horovod_build.patch_sdist(src)
    assert sorted(changed) == sorted(src / name for name in horovod_build.CXX_STANDARD_FILES)
    for name in horovod_build.CXX_STANDARD_FILES:
        text = (src / name).read_text()
        assert "set(CMAKE_CXX_STANDARD 17)" in text and "STANDARD 14" not in text
    assert horovod_build.patch_sdist(src) == []  # patched already: nothing to do


def test_the_sdist_patch_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    with pytest.raises(horovod_build.BuildError, match="sets no C\\+\\+14 standard"):
        horovod_build.patch_sdist(fake_sdist(tmp_path, standard="11"))
    with pytest.raises(horovod_build.BuildError, match="is missing"):
        horovod_build.patch_sdist(tmp_path / "empty")


@pytest.mark.processes
def test_the_patch_command_line_is_one_line_on_error(tmp_path: Path) -> None:
    script = str(REPO / "scripts/horovod_build.py")
    ok = subprocess.run([sys.executable, script, "patch-sdist", str(fake_sdist(tmp_path))],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "2 file(s) changed" in ok.stderr
    bad = subprocess.run([sys.executable, script, "patch-sdist", str(tmp_path / "x")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_setup_patches_through_horovod_build_only() -> None:
    setup = (REPO / "scripts/setup.sh").read_text()
    assert "horovod_build.py\" patch-sdist" in setup
    assert "CMAKE_CXX_STANDARD" not in setup, "the C++17 fix belongs in scripts/horovod_build.py"


def test_mpi_ids_name_family_and_version() -> None:
    open_mpi = "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/\n"
    assert horovod_build.mpi_id(open_mpi) == "Open_MPI_4.1.4"
    assert horovod_build.mpi_id(HYDRA_VERSION) == "MPICH_4.0.2"


def test_mpi4py_keys_differ_by_mpi_python_and_compiler() -> None:
    base = horovod_build.mpi4py_key("4.1.2", "cp311", "mpirun (Open MPI) 4.1.4", "gcc-12.2.0")
    assert base == "mpi4py-4.1.2-cp311-Open_MPI_4.1.4-gcc-12.2.0"
    others = {
        horovod_build.mpi4py_key("4.1.2", "cp311", HYDRA_VERSION, "gcc-12.2.0"),
        horovod_build.mpi4py_key("4.1.2", "cp312", "mpirun (Open MPI) 4.1.4", "gcc-12.2.0"),
        horovod_build.mpi4py_key("4.1.2", "cp311", "mpirun (Open MPI) 4.1.6", "gcc-12.2.0"),
        horovod_build.mpi4py_key("4.1.2", "cp311", "mpirun (Open MPI) 4.1.4", "gcc-13.2.0"),
    }
    assert base not in others and len(others) == 4


@pytest.mark.processes
def test_prereqs_check_names_what_is_missing_or_nothing() -> None:
    done = subprocess.run(["bash", str(REPO / "containers/prereqs.sh"), "--check"], capture_output=True, text=True)
    if done.returncode == 0:
        assert done.stdout.startswith("[image] build tools present: charliecloud-runtime")
    else:
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("[image] missing Debian packages: ")
