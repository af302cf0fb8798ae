"""scripts/horovod_build.py: the Horovod build settings, NCCL discovery, CUDA architectures and cache key.

No GPU and no NCCL installation here, so NCCL layouts are faked as folders with the files Horovod's
FindNCCL looks for (nccl.h, libnccl.so.2, ...), and GPUs as lists of compute capabilities.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "horovod_build.py"

spec = importlib.util.spec_from_file_location("horovod_build", SCRIPT)
assert spec and spec.loader
hb = importlib.util.module_from_spec(spec)
sys.modules["horovod_build"] = hb
spec.loader.exec_module(hb)

NCCL_H = "#define NCCL_MAJOR 2\n#define NCCL_MINOR 29\n#define NCCL_PATCH 7\n#define NCCL_VERSION_CODE 22907\n"


def fake_nccl(
    root: Path, *, lib: str = "lib", dev_link: bool = True, static: bool = False, header: str = NCCL_H
) -> Path:
    """An NCCL installation: include/nccl.h and lib/libnccl.so.2 (+ libnccl.so, + libnccl_static.a)."""
    (root / "include").mkdir(parents=True, exist_ok=True)
    (root / "include" / "nccl.h").write_text(header)
    libdir = root / lib
    libdir.mkdir(parents=True, exist_ok=True)
    (libdir / "libnccl.so.2").write_bytes(b"\x7fELF fake")
    if dev_link:
        (libdir / "libnccl.so").symlink_to("libnccl.so.2")
    if static:
        (libdir / "libnccl_static.a").write_bytes(b"!<arch>\n")
    return root


NO_SYSTEM: tuple = ()


# ---------------------------------------------------------------- NCCL discovery


def test_header_version(tmp_path: Path) -> None:
    assert hb.nccl_header_version(fake_nccl(tmp_path) / "include") == "2.29.7"
    (tmp_path / "include" / "nccl.h").write_text("/* no version */")
    assert hb.nccl_header_version(tmp_path / "include") == "unknown"


@pytest.mark.parametrize("name", hb.NCCL_HOME_VARS)
def test_each_home_variable_is_used(name: str, tmp_path: Path) -> None:
    home = fake_nccl(tmp_path / "nccl", lib="lib64")
    found = hb.find_nccl({name: str(home)}, wheel_dir=None, system=NO_SYSTEM)
    assert found is not None and found.include == home / "include" and found.lib == home / "lib64"
    assert found.version == "2.29.7" and name in found.source


def test_home_variables_in_order(tmp_path: Path) -> None:
    first, second = fake_nccl(tmp_path / "a"), fake_nccl(tmp_path / "b")
    found = hb.find_nccl({"NCCL_HOME": str(second), "HOROVOD_NCCL_HOME": str(first)}, None, NO_SYSTEM)
    assert found is not None and found.include == first / "include"


def test_a_wrong_home_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(hb.BuildError, match=r"NCCL_HOME=.* holds no include/nccl.h"):
        hb.find_nccl({"NCCL_HOME": str(tmp_path)}, None, NO_SYSTEM)


def test_a_loaded_module_through_cpath_and_ld_library_path(tmp_path: Path) -> None:
    module = fake_nccl(tmp_path / "apps" / "nccl" / "2.19")
    env = {"CPATH": f"/nonexistent{os.pathsep}{module / 'include'}", "LD_LIBRARY_PATH": f"{module / 'lib'}:/usr/lib"}
    found = hb.find_nccl(env, None, NO_SYSTEM)
    assert found is not None and found.lib == module / "lib" and "module" in found.source


def test_the_system_installation(tmp_path: Path) -> None:
    sysroot = fake_nccl(tmp_path / "usr", lib="lib/x86_64-linux-gnu")
    found = hb.find_nccl({}, None, ((str(sysroot / "include"), str(sysroot / "lib/x86_64-linux-gnu")),))
    assert found is not None and "system" in found.source


def test_torch_wheel_after_what_the_user_chose_and_before_the_system(tmp_path: Path) -> None:
    wheel = fake_nccl(tmp_path / "site-packages" / "nvidia" / "nccl", dev_link=False)
    sysroot = fake_nccl(tmp_path / "usr")
    system = ((str(sysroot / "include"), str(sysroot / "lib")),)
    found = hb.find_nccl({}, wheel, system)  # torch runs with its wheel's NCCL: build against that one
    assert found is not None and "nvidia-nccl wheel" in found.source and not found.has_dev_link
    module = fake_nccl(tmp_path / "module")
    assert hb.find_nccl({"NCCL_HOME": str(module)}, wheel, NO_SYSTEM).include == module / "include"


def test_nothing_found(tmp_path: Path) -> None:
    assert hb.find_nccl({"CPATH": str(tmp_path)}, None, NO_SYSTEM) is None
    assert hb.find_nccl({}, tmp_path / "missing", NO_SYSTEM) is None


def test_the_wheel_gets_a_private_libnccl_so_link_outside_site_packages(tmp_path: Path) -> None:
    wheel = fake_nccl(tmp_path / "site-packages" / "nvidia" / "nccl", dev_link=False)
    found = hb.find_nccl({}, wheel, NO_SYSTEM)
    include, lib = hb.nccl_build_dirs(found, tmp_path / "cache" / "nccl")
    assert (lib / "libnccl.so").resolve() == (wheel / "lib" / "libnccl.so.2").resolve()
    assert (include / "nccl.h").read_text() == NCCL_H
    assert tmp_path / "cache" in lib.parents
    assert sorted(p.name for p in (wheel / "lib").iterdir()) == ["libnccl.so.2"], "site-packages must stay untouched"
    again = hb.nccl_build_dirs(found, tmp_path / "cache" / "nccl")  # idempotent: a rerun of setup
    assert again == (include, lib)


def test_an_installation_with_its_own_link_is_used_as_it_is(tmp_path: Path) -> None:
    home = fake_nccl(tmp_path / "nccl")
    found = hb.find_nccl({"NCCL_HOME": str(home)}, None, NO_SYSTEM)
    assert hb.nccl_build_dirs(found, tmp_path / "cache") == (home / "include", home / "lib")
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------- CUDA


def test_cuda_architectures_from_the_visible_gpus() -> None:
    assert hb.cuda_arch_list({}, [(9, 0)], "13.0") == ("90", "the visible GPUs")
    assert hb.cuda_arch_list({}, [(8, 0), (9, 0), (8, 0), (10, 0)], "13.0")[0] == "80,90,100"
    assert hb.cuda_arch_list({}, [(7, 5)], "12.4")[0] == "75"


def test_the_users_architecture_list_wins() -> None:
    assert hb.cuda_arch_list({"HOROVOD_BUILD_CUDA_CC_LIST": "70,80"}, [(9, 0)], "12.4") == (
        "70,80",
        "HOROVOD_BUILD_CUDA_CC_LIST",
    )


def test_no_gpu_visible_gives_a_default_the_toolkit_supports() -> None:
    archs, source = hb.cuda_arch_list({}, [], "13.0")
    assert archs == "75,80,90" and "no GPU visible" in source  # CUDA 13 dropped sm_70
    assert hb.cuda_arch_list({}, [], "12.8")[0] == "70,75,80,90"


def test_capabilities_from_nvidia_smi_when_torch_sees_none() -> None:
    caps = hb.visible_capabilities(run=lambda cmd: "9.0\n9.0\n" if cmd[0] == "nvidia-smi" else "")
    import torch

    if not torch.cuda.is_available():
        assert caps == [(9, 0), (9, 0)]


def test_toolkit_found_in_the_documented_order(tmp_path: Path) -> None:
    assert hb.find_cuda_toolkit({"CUDA_HOME": "/opt/cuda-12"}, which=lambda _: None, default=tmp_path) == Path(
        "/opt/cuda-12"
    )
    nvcc = tmp_path / "cuda-12.4" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("")
    assert hb.find_cuda_toolkit({}, which=lambda _: str(nvcc), default=tmp_path / "none") == tmp_path / "cuda-12.4"
    assert hb.find_cuda_toolkit({}, which=lambda _: None, default=tmp_path / "none") is None


def test_toolkit_version(tmp_path: Path) -> None:
    (tmp_path / "version.json").write_text('{"cuda": {"name": "CUDA SDK", "version": "12.4.1"}}')
    assert hb.cuda_toolkit_version(tmp_path) == "12.4"
    nvcc_says = "Cuda compilation tools, release 13.0, V13.0.88\n"
    assert hb.cuda_toolkit_version(tmp_path / "x", run=lambda cmd: nvcc_says) == "13.0"


# ---------------------------------------------------------------- the build environment


def test_the_four_fixes_are_in_every_build(tmp_path: Path) -> None:
    cpu = hb.build_environment({}, gpu=False, cuda_home=None, cuda_archs="", nccl_dirs=None, nccl=None, jobs=4)
    assert cpu["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"
    assert cpu["CXXFLAGS"].split("-include")[1:] and all(f"-include {h}" in cpu["CXXFLAGS"] for h in hb.FORCED_INCLUDES)
    assert {cpu[k] for k in ("HOROVOD_WITH_PYTORCH", "HOROVOD_WITH_MPI", "HOROVOD_WITH_GLOO")} == {"1"}
    assert "HOROVOD_GPU_OPERATIONS" not in cpu and cpu["MAKEFLAGS"] == "-j4"


def test_gpu_build_links_nccl_shared_when_there_is_no_static_library(tmp_path: Path) -> None:
    wheel = fake_nccl(tmp_path / "nvidia" / "nccl", dev_link=False)
    nccl = hb.find_nccl({}, wheel, NO_SYSTEM)
    dirs = hb.nccl_build_dirs(nccl, tmp_path / "cache")
    gpu = hb.build_environment({}, True, Path("/usr/local/cuda"), "90", dirs, nccl, jobs=16)
    assert gpu["HOROVOD_GPU_OPERATIONS"] == "NCCL" and gpu["HOROVOD_NCCL_LINK"] == "SHARED"
    assert gpu["HOROVOD_NCCL_LIB"] == str(dirs[1]) and gpu["HOROVOD_NCCL_INCLUDE"] == str(dirs[0])
    assert gpu["HOROVOD_CUDA_HOME"] == "/usr/local/cuda" and gpu["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    static = hb.find_nccl({"NCCL_HOME": str(fake_nccl(tmp_path / "static", static=True))}, None, NO_SYSTEM)
    assert "HOROVOD_NCCL_LINK" not in hb.build_environment(
        {}, True, Path("/c"), "90", (static.include, static.lib), static, 1
    )


def test_users_settings_are_kept_and_flags_not_doubled() -> None:
    env = {
        "CXXFLAGS": "-O3 -include cstdint",
        "CMAKE_POLICY_VERSION_MINIMUM": "3.10",
        "MAKEFLAGS": "-j3",
        "HOROVOD_GPU_ALLREDUCE": "NCCL",
        "HOROVOD_CPU_OPERATIONS": "GLOO",
    }
    out = hb.build_environment(env, False, None, "", None, None, jobs=8)
    assert out["CXXFLAGS"].startswith("-O3 -include cstdint") and out["CXXFLAGS"].count("cstdint") == 1
    assert out["CMAKE_POLICY_VERSION_MINIMUM"] == "3.10" and out["MAKEFLAGS"] == "-j3"
    assert out["HOROVOD_CPU_OPERATIONS"] == "GLOO"
    assert "HOROVOD_GPU_ALLREDUCE" not in out  # a CPU build must not ask for NCCL


def test_gpu_build_without_nccl_is_an_error() -> None:
    with pytest.raises(hb.BuildError, match="needs NCCL"):
        hb.build_environment({}, True, Path("/usr/local/cuda"), "90", None, None, jobs=2)


def test_compiler_identity() -> None:
    gcc = "g++ (GCC) 13.2.0\nCopyright (C) 2023 Free Software Foundation, Inc.\n"
    debian = "c++ (Debian 12.2.0-14+deb12u1) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.\n"
    clang = "clang version 17.0.6\nTarget: x86_64-pc-linux-gnu\n"
    assert hb.compiler_id({}, run=lambda cmd: gcc) == "gcc-13.2.0"
    assert hb.compiler_id({}, run=lambda cmd: debian) == "gcc-12.2.0"
    assert hb.compiler_id({"CXX": "clang++"}, run=lambda cmd: clang if cmd[0] == "clang++" else "") == "clang-17.0.6"


def test_mpi_identity() -> None:
    assert hb.mpi_id("mpirun (Open MPI) 4.1.4") == "Open_MPI_4.1.4"
    assert hb.mpi_id("HYDRA build details:") == "HYDRA_build_details"
    assert hb.mpi_id("") == "unknown-mpi"
    # seen with no network interface up: Open MPI warns before its version line
    warned = "[vm:27372] opal_ifinit: unable to find network interfaces.\nmpirun (Open MPI) 4.1.4\n\nReport bugs"
    assert hb.mpi_id(warned) == "Open_MPI_4.1.4"


# ---------------------------------------------------------------- the cache key

BASE = dict(
    horovod="0.28.1",
    patch_rev="1",
    python="cp311",
    torch="2.13.0+cu130",
    mpi="Open_MPI_4.1.4",
    compiler="gcc-12.2.0",
    cuda="13.0",
    nccl="none",
    gpu=False,
    flags="0123456789ab",
)


@pytest.mark.parametrize(
    "field, other",
    [
        ("compiler", "gcc-13.2.0"),
        ("cuda", "12.4"),
        ("nccl", "2.29.7"),
        ("flags", "ba9876543210"),
        ("python", "cp312"),
        ("torch", "2.11.0+cu130"),
        ("mpi", "Open_MPI_5.0.11"),
        ("gpu", True),
        ("patch_rev", "2"),
    ],
)
def test_every_incompatibility_changes_the_key(field: str, other: object) -> None:
    assert hb.cache_key(**BASE) != hb.cache_key(**{**BASE, field: other})


def test_the_key_is_a_safe_folder_name() -> None:
    key = hb.cache_key(**{**BASE, "mpi": "Intel(R) MPI Library 2021.9 for Linux*"})
    assert "/" not in key and " " not in key and "*" not in key and key.startswith("horovod-0.28.1-")


def test_the_flags_hash_sees_build_settings_but_not_parallelism() -> None:
    env = hb.build_environment({}, False, Path("/usr/local/cuda"), "75,80,90", None, None, jobs=2)
    same = hb.build_environment({"MAKEFLAGS": "-j16"}, False, Path("/usr/local/cuda"), "75,80,90", None, None, jobs=16)
    assert hb.flags_digest(env) == hb.flags_digest(same)
    for change in ({"CXXFLAGS": "-O1"}, {"HOROVOD_CPU_OPERATIONS": "GLOO"}, {"HOROVOD_BUILD_CUDA_CC_LIST": "90"}):
        other = hb.build_environment(
            change,
            False,
            Path("/usr/local/cuda"),
            change.get("HOROVOD_BUILD_CUDA_CC_LIST", "75,80,90"),
            None,
            None,
            jobs=2,
        )
        assert hb.flags_digest(other) != hb.flags_digest(env), change


# ---------------------------------------------------------------- the command setup.sh runs


def test_env_command_on_this_machine(tmp_path: Path) -> None:
    """What setup.sh evaluates: exports for a CPU build against the installed torch, and the key."""
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "env",
            "--gpu",
            "0",
            "--cache",
            str(tmp_path),
            "--mpi",
            "mpirun (Open MPI) 4.1.4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "export CMAKE_POLICY_VERSION_MINIMUM=3.5" in lines and "export HOROVOD_WITH_MPI=1" in lines
    key = next(line.split("=", 1)[1] for line in lines if line.startswith("HOROVOD_CACHE_KEY="))
    assert "Open_MPI_4.1.4" in key and f"cp{sys.version_info[0]}{sys.version_info[1]}" in key
    evaluated = subprocess.run(
        ["bash", "-c", result.stdout + '\necho "$CXXFLAGS|$HOROVOD_CACHE_KEY"'], capture_output=True, text=True
    )
    assert evaluated.stdout.strip() == f"{hb.with_forced_includes('')}|{key}"


def test_env_command_gpu_build_finds_torchs_nccl_wheel(tmp_path: Path) -> None:
    if hb.nccl_wheel_dir() is None or not hb.find_cuda_toolkit(os.environ):
        pytest.skip(
            "needs torch's nvidia-nccl wheel and a CUDA toolkit (CI has both: the CUDA torch wheel, /usr/local/cuda)"
        )
    env = {k: v for k, v in os.environ.items() if k not in hb.NCCL_HOME_VARS}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "env", "--gpu", "1", "--cache", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "nvidia-nccl wheel" in result.stderr or "system" in result.stderr
    exports = dict(
        line[len("export ") :].split("=", 1) for line in result.stdout.splitlines() if line.startswith("export ")
    )
    assert exports["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert Path(exports["HOROVOD_NCCL_LIB"].strip("'"), "libnccl.so").exists()


def test_env_command_gpu_build_without_nccl_says_how_to_fix(tmp_path: Path) -> None:
    if not hb.find_cuda_toolkit(os.environ):
        pytest.skip("needs a CUDA toolkit (CI has /usr/local/cuda); without one the toolkit is the first complaint")
    env = {k: v for k, v in os.environ.items() if k not in hb.NCCL_HOME_VARS}
    env["NCCL_HOME"] = str(tmp_path / "nowhere")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "env", "--gpu", "1", "--cache", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "NCCL_HOME=" in result.stderr


# ---------------------------------------------------------------- scripts/pins.py (existing-torch installs)

pins_spec = importlib.util.spec_from_file_location("pins", REPO / "scripts" / "pins.py")
assert pins_spec and pins_spec.loader
pins = importlib.util.module_from_spec(pins_spec)
pins_spec.loader.exec_module(pins)


def test_pins_come_from_pyproject_without_what_setup_builds() -> None:
    every = pins.pinned()
    assert any(r.startswith("torch==") for r in every) and any(r.startswith("pytest==") for r in every)
    assert not {pins.name_of(r) for r in pins.pinned(group="deps")} & {"pytest", "ruff"}
    listed = subprocess.run([sys.executable, str(REPO / "scripts" / "pins.py"), "all"], capture_output=True, text=True)
    names = {pins.name_of(line) for line in listed.stdout.split()}
    assert names and not names & pins.HANDLED_BY_SETUP


def test_missing_leaves_any_installed_version_alone() -> None:
    present = {"numpy", "tqdm"}
    out = pins.missing(["numpy==2.4.6", "tqdm==4.70.1", "pytest-mpi==0.6", "torch==2.13.0"], present.__contains__)
    assert out == ["pytest-mpi==0.6"]  # numpy at another version stays; torch is never listed


def test_requirement_names_are_normalised() -> None:
    assert pins.name_of("Scikit_Learn[extra]>=1.0; python_version>'3'") == "scikit-learn"
    assert pins.name_of("pytest-mpi==0.6") == "pytest-mpi"


def test_pins_without_tomllib(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\ndependencies = [\n  "a==1",\n  "b==2",\n]\n'
                                             '[project.optional-dependencies]\ntest = ["c==3"]\n')
    parsed = pins._lists_without_tomllib((tmp_path / "pyproject.toml").read_text())
    assert parsed == {"dependencies": ["a==1", "b==2"], "test": ["c==3"]}
