"""How scripts/setup.sh builds Horovod: the build environment, NCCL discovery, the CUDA architectures
and the wheel cache key. Standard library only: it runs in the fresh venv before anything else.

    python scripts/horovod_build.py env --gpu 1 --cache ~/.cache/hpcdl --mpi "Open MPI 4.1.4"

prints `export NAME=value` lines for the shell (and HOROVOD_CACHE_KEY) on stdout and what it found
on stderr; a GPU build that cannot work (no CUDA toolkit, no NCCL) ends with one line and exit 2.

Why each setting exists (each was needed on a real node; ../shared/ENVIRONMENT.md, "GPU nodes"):
  CXXFLAGS -include ...           GCC 13+ no longer pulls <cstdint>, <string>, ... in transitively, and
                                  Horovod 0.28.1 (2023) and its gloo forget to include them;
  CMAKE_POLICY_VERSION_MINIMUM    CMake 4 refuses gloo's old cmake_minimum_required;
  HOROVOD_NCCL_*                  Horovod's FindNCCL needs a `libnccl.so`; torch's nvidia-nccl wheel
                                  ships only `libnccl.so.2`, so a link is made in a private folder;
  HOROVOD_BUILD_CUDA_CC_LIST      the GPUs this node has, not a guess (unless the user sets it).
`patch-sdist SRC` applies the C++17 fix to an unpacked sdist, `mpi4py-key` names mpi4py's wheel cache.
The cache key names everything that makes a built wheel unusable elsewhere: compiler, CUDA and NCCL
versions, the flags, Python, torch and MPI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Headers GCC 13 stopped including transitively; Horovod 0.28.1 and its gloo use them unannounced.
FORCED_INCLUDES = ("cstdint", "string", "stdexcept", "limits", "memory", "algorithm")
CMAKE_POLICY_MINIMUM = "3.5"
# Where a loaded module or the user may say NCCL is (first wins). TACC's modules set TACC_NCCL_DIR.
NCCL_HOME_VARS = ("HOROVOD_NCCL_HOME", "NCCL_HOME", "NCCL_ROOT", "NCCL_DIR", "TACC_NCCL_DIR")
INCLUDE_PATH_VARS = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")
LIBRARY_PATH_VARS = ("LIBRARY_PATH", "LD_LIBRARY_PATH")
SYSTEM_NCCL = (
    ("/usr/include", "/usr/lib/x86_64-linux-gnu"),
    ("/usr/include", "/usr/lib64"),
    ("/usr/include", "/usr/lib"),
)
# Environment that changes the compiled wheel (and so the cache key). MAKEFLAGS only changes speed.
KEYED_VARS = ("CXXFLAGS", "CFLAGS", "LDFLAGS", "CMAKE_POLICY_VERSION_MINIMUM", "CC", "CXX")


class BuildError(Exception):
    """A build that cannot work here; the message is one line with the fix."""


# ---------------------------------------------------------------- NCCL


@dataclass(frozen=True)
class Nccl:
    include: Path  # holds nccl.h
    lib: Path  # holds libnccl.so* (maybe only libnccl.so.2)
    version: str
    source: str  # where it was found, for the user

    @property
    def has_static(self) -> bool:
        return (self.lib / "libnccl_static.a").exists()

    @property
    def has_dev_link(self) -> bool:
        return (self.lib / "libnccl.so").exists()


def nccl_header_version(include: Path) -> str:
    """'2.29.7' from nccl.h's NCCL_MAJOR/MINOR/PATCH defines."""
    text = (include / "nccl.h").read_text(errors="replace")
    parts = [re.search(rf"^\s*#define\s+NCCL_{name}\s+(\d+)", text, re.M) for name in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        return "unknown"
    return ".".join(m.group(1) for m in parts if m)


def _nccl_libdir(home: Path) -> Path | None:
    for sub in ("lib", "lib64", "lib/x86_64-linux-gnu"):
        candidate = home / sub
        if any(candidate.glob("libnccl.so*")) or (candidate / "libnccl_static.a").exists():
            return candidate
    return None


def _pair(include: Path, lib: Path | None, source: str) -> Nccl | None:
    if lib is None or not (include / "nccl.h").exists():
        return None
    if not (any(lib.glob("libnccl.so*")) or (lib / "libnccl_static.a").exists()):
        return None
    return Nccl(include=include, lib=lib, version=nccl_header_version(include), source=source)


def _split_paths(value: str) -> list[Path]:
    return [Path(part) for part in value.split(os.pathsep) if part]


def find_nccl(
    env: Mapping[str, str], wheel_dir: Path | None, system: Sequence[tuple[str, str]] = SYSTEM_NCCL
) -> Nccl | None:
    """NCCL's headers and library, looked for where users and modules put them, in this order:
    HOROVOD_NCCL_HOME / NCCL_HOME / NCCL_ROOT / NCCL_DIR / TACC_NCCL_DIR; HOROVOD_NCCL_INCLUDE with
    HOROVOD_NCCL_LIB; a module's CPATH with its LIBRARY_PATH / LD_LIBRARY_PATH; torch's own nvidia-nccl
    wheel (`wheel_dir`, from `import nvidia.nccl`: the library torch loads at run time); and last the
    system's (libnccl-dev).
    """
    for name in NCCL_HOME_VARS:
        if env.get(name):
            home = Path(env[name])
            found = _pair(home / "include", _nccl_libdir(home), f"${name}={home}")
            if found is None:
                raise BuildError(
                    f"{name}={home} holds no include/nccl.h with lib/libnccl.so*: point it at an NCCL "
                    "installation (the folder with include/ and lib/), or unset it to let setup search"
                )
            return found
    if env.get("HOROVOD_NCCL_INCLUDE") and env.get("HOROVOD_NCCL_LIB"):
        found = _pair(Path(env["HOROVOD_NCCL_INCLUDE"]), Path(env["HOROVOD_NCCL_LIB"]), "$HOROVOD_NCCL_INCLUDE/_LIB")
        if found:
            return found
    includes = [p for name in INCLUDE_PATH_VARS for p in _split_paths(env.get(name, "")) if (p / "nccl.h").exists()]
    libs = [p for name in LIBRARY_PATH_VARS for p in _split_paths(env.get(name, "")) if any(p.glob("libnccl.so*"))]
    if includes and libs:
        found = _pair(includes[0], libs[0], "a loaded module (CPATH and LD_LIBRARY_PATH)")
        if found:
            return found
    # torch loads its own libnccl.so.2 first at run time: build against that one's headers.
    if wheel_dir is not None:
        found = _pair(wheel_dir / "include", wheel_dir / "lib", f"torch's nvidia-nccl wheel ({wheel_dir})")
        if found:
            return found
    for include, lib in system:
        found = _pair(Path(include), Path(lib), f"the system ({include}, {lib})")
        if found:
            return found
    return None


def nccl_build_dirs(nccl: Nccl, private_root: Path) -> tuple[Path, Path]:
    """(include, lib) folders that Horovod's FindNCCL accepts.

    An installation with `libnccl.so` (or the static library) is used as it is. torch's wheel has
    only `libnccl.so.2`: the `libnccl.so` link the linker needs is made in a private folder (never
    inside site-packages), named after the library it points to so that two NCCLs never share one.
    """
    if nccl.has_dev_link or nccl.has_static:
        return nccl.include, nccl.lib
    home = _linked_home(nccl, private_root)
    return home / "include", home / "lib"


def _linked_home(nccl: Nccl, private_root: Path) -> Path:
    real = next((p for p in sorted(nccl.lib.glob("libnccl.so*")) if p.is_file()), None)
    if real is None:
        raise BuildError(f"no libnccl.so* in {nccl.lib}")
    real = real.resolve()
    digest = hashlib.sha256(str(real).encode()).hexdigest()[:10]
    home = private_root / f"nccl-{nccl.version}-{digest}"
    (home / "lib").mkdir(parents=True, exist_ok=True)
    for name in ("libnccl.so", "libnccl.so.2"):
        link = home / "lib" / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(real)
    include = home / "include"
    if include.is_symlink() or include.exists():
        include.unlink()
    include.symlink_to(nccl.include.resolve(), target_is_directory=True)
    return home


def nccl_wheel_dir() -> Path | None:
    """The nvidia-nccl wheel's folder (nvidia/nccl with include/ and lib/), if torch brought one."""
    try:
        import nvidia.nccl as wheel
    except ImportError:
        return None
    paths = list(getattr(wheel, "__path__", []))
    return Path(paths[0]) if paths else None


# ---------------------------------------------------------------- CUDA


def find_cuda_toolkit(
    env: Mapping[str, str], which: Callable[[str], str | None] = shutil.which, default: Path = Path("/usr/local/cuda")
) -> Path | None:
    """CUDA_HOME / CUDA_PATH / HOROVOD_CUDA_HOME, else /usr/local/cuda, else the nvcc on PATH."""
    for name in ("HOROVOD_CUDA_HOME", "CUDA_HOME", "CUDA_PATH"):
        if env.get(name):
            return Path(env[name])
    if (default / "include").is_dir():
        return default
    nvcc = which("nvcc")
    if nvcc:
        return Path(os.path.realpath(nvcc)).parent.parent
    return None


def cuda_toolkit_version(home: Path, run: Callable[[list[str]], str] | None = None) -> str:
    """'13.0' from the toolkit's version.json, else from `nvcc --version` ('release 13.0')."""
    version_json = home / "version.json"
    if version_json.exists():
        try:
            full = json.loads(version_json.read_text())["cuda"]["version"]
            return ".".join(full.split(".")[:2])
        except (KeyError, ValueError):
            pass
    run = run or _output
    text = run([str(home / "bin" / "nvcc"), "--version"]) or run(["nvcc", "--version"])
    match = re.search(r"release (\d+\.\d+)", text)
    return match.group(1) if match else "unknown"


def default_cuda_archs(cuda_version: str) -> list[str]:
    """Architectures to build for when no GPU is visible (a login node): Turing to Hopper.
    CUDA 13 dropped everything before sm_75; CUDA 12 still has Volta."""
    major = int(cuda_version.split(".")[0]) if cuda_version[:1].isdigit() else 13
    return ["75", "80", "90"] if major >= 13 else ["70", "75", "80", "90"]


def cuda_arch_list(
    env: Mapping[str, str], capabilities: Sequence[tuple[int, int]], cuda_version: str
) -> tuple[str, str]:
    """(HOROVOD_BUILD_CUDA_CC_LIST, where it came from): the user's, else the visible GPUs', else a default."""
    if env.get("HOROVOD_BUILD_CUDA_CC_LIST"):
        return env["HOROVOD_BUILD_CUDA_CC_LIST"], "HOROVOD_BUILD_CUDA_CC_LIST"
    if capabilities:
        archs = sorted({f"{major}{minor}" for major, minor in capabilities}, key=int)
        return ",".join(archs), "the visible GPUs"
    return ",".join(default_cuda_archs(cuda_version)), f"no GPU visible: a default for CUDA {cuda_version}"


def visible_capabilities(run: Callable[[list[str]], str] | None = None) -> list[tuple[int, int]]:
    """Compute capabilities of the visible GPUs: torch first, nvidia-smi where torch sees none."""
    try:
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken torch is reported by setup's own checks
        pass
    run = run or _output
    found = []
    for line in run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]).splitlines():
        match = re.match(r"\s*(\d+)\.(\d+)\s*$", line)
        if match:
            found.append((int(match.group(1)), int(match.group(2))))
    return found


# ---------------------------------------------------------------- compiler, flags, key


def _output(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def compiler_id(env: Mapping[str, str], run: Callable[[list[str]], str] | None = None) -> str:
    """'gcc-13.2.0': name and version of the C++ compiler CMake will use ($CXX, else c++)."""
    run = run or _output
    text = run([env.get("CXX") or "c++", "--version"])
    first = (text.splitlines() or ["unknown"])[0]
    version = re.search(r"(\d+\.\d+(?:\.\d+)?)", first)
    lowered = text.lower()
    name = (
        "clang"
        if "clang" in lowered
        else "icx"
        if "intel" in lowered
        else "gcc"
        if "free software foundation" in lowered or "gcc" in lowered
        else "cxx"
    )
    return f"{name}-{version.group(1) if version else 'unknown'}"


def with_forced_includes(cxxflags: str) -> str:
    """The user's CXXFLAGS plus the -include flags GCC 13 needs (each once)."""
    words = cxxflags.split()
    present = {words[i + 1] for i, word in enumerate(words[:-1]) if word == "-include"}
    extra = [f"-include {header}" for header in FORCED_INCLUDES if header not in present]
    return " ".join([cxxflags.strip(), *extra]).strip()


def build_environment(
    env: Mapping[str, str],
    gpu: bool,
    cuda_home: Path | None,
    cuda_archs: str,
    nccl_dirs: tuple[Path, Path] | None,
    nccl: Nccl | None,
    jobs: int,
) -> dict[str, str]:
    """The variables to export for `pip wheel` of the patched Horovod sdist.

    Settings the user already made (HOROVOD_*, CXXFLAGS, CMAKE_POLICY_VERSION_MINIMUM, MAKEFLAGS)
    are kept; the defaults fill the rest.
    """
    out = {name: value for name, value in env.items() if name.startswith("HOROVOD_")}
    out.update(
        HOROVOD_WITH_PYTORCH="1",
        HOROVOD_WITH_MPI="1",
        HOROVOD_WITH_GLOO="1",
        HOROVOD_WITHOUT_TENSORFLOW="1",
        HOROVOD_WITHOUT_MXNET="1",
    )
    out.setdefault("HOROVOD_CPU_OPERATIONS", "MPI")
    out["CMAKE_POLICY_VERSION_MINIMUM"] = env.get("CMAKE_POLICY_VERSION_MINIMUM") or CMAKE_POLICY_MINIMUM
    out["CXXFLAGS"] = with_forced_includes(env.get("CXXFLAGS", ""))
    out["MAKEFLAGS"] = env.get("MAKEFLAGS") or f"-j{jobs}"
    if cuda_home is not None:
        out["CUDA_HOME"] = str(cuda_home)
        out["HOROVOD_CUDA_HOME"] = env.get("HOROVOD_CUDA_HOME") or str(cuda_home)
        out["HOROVOD_BUILD_CUDA_CC_LIST"] = cuda_archs
    if gpu:
        if nccl is None or nccl_dirs is None:
            raise BuildError("HPCDL_GPU=1 needs NCCL and none was found")
        include, lib = nccl_dirs
        out["HOROVOD_GPU_OPERATIONS"] = env.get("HOROVOD_GPU_OPERATIONS") or "NCCL"
        out["HOROVOD_NCCL_HOME"] = str(lib.parent)
        out["HOROVOD_NCCL_INCLUDE"] = str(include)
        out["HOROVOD_NCCL_LIB"] = str(lib)
        if not nccl.has_static:
            out["HOROVOD_NCCL_LINK"] = "SHARED"
    else:
        for name in (
            "HOROVOD_GPU_OPERATIONS",
            "HOROVOD_GPU_ALLREDUCE",
            "HOROVOD_GPU_BROADCAST",
            "HOROVOD_NCCL_HOME",
            "HOROVOD_NCCL_INCLUDE",
            "HOROVOD_NCCL_LIB",
            "HOROVOD_NCCL_LINK",
        ):
            out.pop(name, None)
    return out


def flags_digest(build_env: Mapping[str, str]) -> str:
    """A short hash of every setting that changes the compiled wheel (not MAKEFLAGS: only speed)."""
    keyed = {k: v for k, v in build_env.items() if k.startswith("HOROVOD_") or k in KEYED_VARS or k == "CUDA_HOME"}
    text = "\n".join(f"{k}={keyed[k]}" for k in sorted(keyed))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_key(
    *,
    horovod: str,
    patch_rev: str,
    python: str,
    torch: str,
    mpi: str,
    compiler: str,
    cuda: str,
    nccl: str,
    gpu: bool,
    flags: str,
) -> str:
    """The wheel cache folder's name: readable parts, then the flags' hash.

    A wheel built for one node type (another compiler, CUDA, NCCL, MPI, torch or Python, or other
    flags) is never reused on an incompatible one, because any difference gives another name.
    """
    parts = [
        f"horovod-{horovod}",
        f"p{patch_rev}",
        python,
        f"torch{torch}",
        mpi,
        compiler,
        f"cuda{cuda}",
        f"nccl{nccl}",
        "gpu" if gpu else "cpu",
        flags,
    ]
    return re.sub(r"[^A-Za-z0-9.+_-]+", "_", "-".join(parts))


def mpi_id(version_output: str) -> str:
    """'Open_MPI_4.1.4' from `mpirun --version` ('mpirun (Open MPI) 4.1.4'; 'MPICH_4.0.2' from Hydra's
    table), skipping warnings such as '[node:123] opal_ifinit: unable to find network interfaces.' that
    Open MPI may print first."""
    hydra = re.search(r"HYDRA build details:.*?Version:\s*(\S+)", version_output, re.S)
    if hydra:  # MPICH's mpirun (Hydra) prints a table: 'MPICH_4.0.2'
        return f"MPICH_{hydra.group(1)}"
    lines = [line.strip() for line in version_output.splitlines() if line.strip() and not line.lstrip().startswith("[")]
    line = re.sub(r"^\S*mpi(run|exec)\S*\s*", "", lines[0] if lines else "", flags=re.I)
    return re.sub(r"[^A-Za-z0-9.]+", "_", line).strip("_") or "unknown-mpi"


# ---------------------------------------------------------------- command line


def _torch_facts() -> tuple[str, str | None]:
    import torch

    return torch.__version__, torch.version.cuda


def plan(
    env: Mapping[str, str], gpu: bool, cache: Path, mpi_line: str, versions: Mapping[str, str]
) -> tuple[dict[str, str], str, list[str]]:
    """(variables to export, cache key, lines describing what was found)."""
    torch_version, torch_cuda = _torch_facts()
    notes = [f"torch {torch_version} (CUDA {torch_cuda or 'none'})"]
    cuda_home = find_cuda_toolkit(env) if (torch_cuda or gpu) else None
    if (torch_cuda or gpu) and (cuda_home is None or not (cuda_home / "include").is_dir()):
        raise BuildError(
            "torch is a CUDA build (or HPCDL_GPU=1) but no CUDA toolkit was found: "
            "'module load cuda' or set CUDA_HOME to the toolkit (the folder with bin/nvcc)"
        )
    cuda_version = cuda_toolkit_version(cuda_home) if cuda_home else "none"
    archs, arch_source = ("", "")
    if cuda_home:
        archs, arch_source = cuda_arch_list(env, visible_capabilities(), cuda_version)
        notes.append(f"CUDA toolkit {cuda_version} at {cuda_home}; architectures {archs} ({arch_source})")
    nccl = nccl_dirs = None
    if gpu:
        nccl = find_nccl(env, nccl_wheel_dir())
        if nccl is None:
            raise BuildError(
                "HPCDL_GPU=1 needs NCCL and none was found: set NCCL_HOME to an NCCL installation, "
                "'module load nccl', or install torch's CUDA build (it brings the nvidia-nccl wheel)"
            )
        nccl_dirs = nccl_build_dirs(nccl, cache / "nccl")
        linked = f" (libnccl.so linked in {nccl_dirs[1]})" if nccl_dirs[1] != nccl.lib else ""
        notes.append(f"NCCL {nccl.version} from {nccl.source}{linked}")
    build_env = build_environment(env, gpu, cuda_home, archs, nccl_dirs, nccl, jobs=os.cpu_count() or 2)
    compiler = compiler_id(env)
    notes.append(f"compiler {compiler}")
    python = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    key = cache_key(
        horovod=versions["HOROVOD_VERSION"],
        patch_rev=versions["HOROVOD_PATCH_REV"],
        python=python,
        torch=torch_version,
        mpi=mpi_id(mpi_line),
        compiler=compiler,
        cuda=cuda_version,
        nccl=nccl.version if nccl else "none",
        gpu=gpu,
        flags=flags_digest(build_env),
    )
    return build_env, key, notes


# Horovod 0.28.1's sdist pins C++14 in these files; PyTorch >= 2.1 headers need C++17 (the fix
# upstream merged after the release). HOROVOD_PATCH_REV in versions.env names this patch in the key.
CXX_STANDARD_FILES = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")


def patch_sdist(src: Path) -> list[Path]:
    """Apply the C++17 fix to an unpacked Horovod sdist; returns the files changed.

    Raises BuildError when a file is missing or holds neither standard (another Horovod release:
    the patch must be looked at again, not skipped silently). Patching twice changes nothing.
    """
    changed = []
    for name in CXX_STANDARD_FILES:
        path = src / name
        if not path.is_file():
            raise BuildError(f"{path} is missing: is {src} an unpacked Horovod sdist?")
        text = path.read_text()
        if "set(CMAKE_CXX_STANDARD 17)" in text and "set(CMAKE_CXX_STANDARD 14)" not in text:
            continue
        if "set(CMAKE_CXX_STANDARD 14)" not in text:
            raise BuildError(f"{path} sets no C++14 standard to raise to C++17: check the patch for this Horovod")
        path.write_text(text.replace("set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)"))
        changed.append(path)
    return changed


def mpi4py_key(mpi4py: str, python: str, mpi_line: str, compiler: str) -> str:
    """The mpi4py wheel cache folder's name: the MPI it was compiled against, the Python ABI and
    the compiler (mpi4py does not link torch)."""
    return re.sub(r"[^A-Za-z0-9.+_-]+", "_", f"mpi4py-{mpi4py}-{python}-{mpi_id(mpi_line)}-{compiler}")


def read_versions(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Z0-9_]+)=(\S+)\s*$", line)
        if match:
            pins[match.group(1)] = match.group(2)
    return pins


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env_cmd = sub.add_parser("env", help="print the build environment as shell exports, and HOROVOD_CACHE_KEY")
    env_cmd.add_argument("--gpu", choices=("0", "1"), default="0")
    env_cmd.add_argument("--cache", type=Path, required=True)
    env_cmd.add_argument("--mpi", default="", help="what `mpirun --version` prints")
    env_cmd.add_argument("--versions", type=Path, default=Path(__file__).with_name("versions.env"))
    key_cmd = sub.add_parser("mpi4py-key", help="print the mpi4py wheel cache key")
    key_cmd.add_argument("--mpi", default="", help="what `mpirun --version` prints")
    key_cmd.add_argument("--versions", type=Path, default=Path(__file__).with_name("versions.env"))
    patch_cmd = sub.add_parser("patch-sdist", help="apply the C++17 fix to an unpacked Horovod sdist")
    patch_cmd.add_argument("src", type=Path)
    args = parser.parse_args(argv)
    if args.command == "patch-sdist":
        try:
            changed = patch_sdist(args.src)
        except BuildError as exc:
            print(f"[setup] {exc}", file=sys.stderr)
            return 2
        print(f"[setup]   C++17 patch: {len(changed)} file(s) changed in {args.src}", file=sys.stderr)
        return 0
    if args.command == "mpi4py-key":
        python = f"cp{sys.version_info[0]}{sys.version_info[1]}"
        pins = read_versions(args.versions)
        print(mpi4py_key(pins["MPI4PY_VERSION"], python, args.mpi, compiler_id(os.environ)))
        return 0
    try:
        build_env, key, notes = plan(os.environ, args.gpu == "1", args.cache, args.mpi, read_versions(args.versions))
    except BuildError as exc:
        print(f"[setup] {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"[setup]   {note}", file=sys.stderr)
    for name in sorted(build_env):
        print(f"export {name}={shlex.quote(build_env[name])}")
    print(f"HOROVOD_CACHE_KEY={shlex.quote(key)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
