#!/usr/bin/env bash
# One-command, idempotent setup of hpcdl's environment in .venv at the repository root.
#
#   bash scripts/setup.sh            # CPU build (what CI and laptops use)
#   HPCDL_GPU=1 bash scripts/setup.sh  # also build Horovod with NCCL (needs CUDA toolkit + NCCL)
#
# Steps: MPI -> virtual environment -> torch/torchvision -> Horovod (cached wheel) -> mpi4py ->
# hpcdl itself with test tools -> a final import check. A second run only checks, in seconds.
# Singularity.def calls this same script, so the container and a bare machine are built one way.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HPCDL_VENV:-$ROOT/.venv}"
PY_BOOT="${PYTHON:-python3}"
CACHE="${HPCDL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpcdl}"
GPU_BUILD="${HPCDL_GPU:-0}"
# Versions live in one place: scripts/versions.env (pyproject and environment.yml are tested against it).
# shellcheck source=scripts/versions.env
source "$ROOT/scripts/versions.env"

STEP="start"
step() { STEP="$1"; printf '\033[1m[setup] %s\033[0m\n' "$1"; }
ok() { printf '[setup]   %s\n' "$1"; }
fail() {
  printf '[setup] FAILED at step "%s": %s\n' "$STEP" "$1" >&2
  exit 1
}
trap 'rc=$?; if [ $rc -ne 0 ]; then printf "[setup] FAILED at step \"%s\" (exit %s). Read the output above; rerun with bash -x scripts/setup.sh for detail.\n" "$STEP" "$rc" >&2; fi' EXIT

# pip, quiet, without the noise a partial local package mirror makes.
pip_q() {
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}

# ---------------------------------------------------------------- MPI
step "1/6 MPI"
if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
  ok "using the MPI on PATH: $(command -v mpirun) ($(mpirun --version 2>&1 | head -n 1))"
elif [ -f /etc/debian_version ] && [ "$(id -u)" = 0 ]; then
  ok "no MPI on PATH: installing Debian's Open MPI (libopenmpi-dev openmpi-bin)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || fail "apt-get update failed; check network access to the Debian mirrors"
  apt-get install -y -qq libopenmpi-dev openmpi-bin >/dev/null || fail "apt-get install of Open MPI failed"
  ok "installed $(mpirun --version 2>&1 | head -n 1)"
else
  fail "no mpicc/mpirun on PATH. On a cluster run 'module load openmpi' (or your site's MPI) first; on Debian/Ubuntu run as root so setup can install Open MPI."
fi
MPI_ID="$(mpirun --version 2>&1 | head -n 1 | tr -c 'A-Za-z0-9.\n' '_' | tr -s '_')"

# ---------------------------------------------------------------- venv
step "2/6 virtual environment at $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY_BOOT" -m venv "$VENV" || fail "'$PY_BOOT -m venv' failed; install python3-venv (Debian) or load a Python module"
  ok "created"
else
  ok "exists ($("$VENV/bin/python" --version))"
fi
PYVER="$("$VENV/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"

# ---------------------------------------------------------------- torch
step "3/6 torch $TORCH_VERSION + torchvision $TORCHVISION_VERSION"
torch_ok() {
  "$VENV/bin/python" - "$TORCH_VERSION" "$TORCHVISION_VERSION" <<'PY' 2>/dev/null
import sys
import torch, torchvision
from torchvision.ops import nms  # fails when torchvision's extension does not match torch
want_t, want_v = sys.argv[1], sys.argv[2]
assert torch.__version__.split("+")[0] == want_t and torchvision.__version__.split("+")[0] == want_v
nms(torch.rand(2, 4), torch.rand(2), 0.5)
PY
}
if torch_ok; then
  ok "already installed and importing together"
else
  # PyPI's torchvision links against the CUDA build of torch, so a CPU-only torch (a "+cpu" wheel in a
  # local folder) cannot be used: exclude it explicitly. The CUDA build runs fine without a GPU.
  pip_q install "torch==$TORCH_VERSION,!=$TORCH_VERSION+cpu" "torchvision==$TORCHVISION_VERSION" ||
    fail "pip could not install torch/torchvision; check access to PyPI"
  torch_ok || fail "torch and torchvision are installed but do not import together"
  ok "installed"
fi
TORCH_FULL="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"

# ---------------------------------------------------------------- Horovod
step "4/6 Horovod $HOROVOD_VERSION (MPI + Gloo$([ "$GPU_BUILD" = 1 ] && echo ' + NCCL'))"
hvd_ok() {
  "$VENV/bin/python" - "$HOROVOD_VERSION" "$GPU_BUILD" <<'PY' 2>/dev/null
import sys
import horovod
import horovod.torch as hvd
assert horovod.__version__ == sys.argv[1]
assert hasattr(hvd, "init") and hvd.mpi_built() and hvd.gloo_built()
if sys.argv[2] == "1":
    assert hvd.nccl_built()
PY
}
if hvd_ok; then
  ok "already installed with its extension"
else
  pip_q install "cmake>=3.13" packaging psutil pyyaml cloudpickle wheel setuptools || fail "could not install Horovod's build tools"
  KEY="horovod-$HOROVOD_VERSION-$PYVER-torch$TORCH_FULL-$MPI_ID-gpu$GPU_BUILD-patch$HOROVOD_PATCH_REV"
  WHEEL_DIR="$CACHE/wheels/$KEY"
  WHEEL="$(ls "$WHEEL_DIR"/horovod-*.whl 2>/dev/null | head -n 1 || true)"
  if [ -n "$WHEEL" ]; then
    ok "using cached wheel $WHEEL"
  else
    ok "building from the sdist (about 5 minutes on 2 cores); cache: $WHEEL_DIR"
    BUILD="$(mktemp -d)"
    pip_q download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD" || fail "could not download the Horovod sdist"
    tar -xzf "$BUILD"/horovod-"$HOROVOD_VERSION".tar.gz -C "$BUILD"
    SRC="$BUILD/horovod-$HOROVOD_VERSION"
    # PyTorch >= 2.1 headers need C++17; 0.28.1 pins C++14 (fixed upstream after the release).
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt" || fail "the C++17 patch did not apply to the Horovod sdist"
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
    export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI
    export MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}"
    # The PyPI torch is a CUDA build, so Horovod's torch extension needs the CUDA toolkit headers.
    CUDA_DIR="${CUDA_HOME:-}"
    if [ -z "$CUDA_DIR" ]; then
      if [ -d /usr/local/cuda/include ]; then CUDA_DIR=/usr/local/cuda
      elif command -v nvcc >/dev/null; then CUDA_DIR="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
      fi
    fi
    if "$VENV/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)'; then
      [ -n "$CUDA_DIR" ] && [ -d "$CUDA_DIR/include" ] || fail "torch is a CUDA build but no CUDA toolkit was found; 'module load cuda' or set CUDA_HOME"
      export CUDA_HOME="$CUDA_DIR" HOROVOD_CUDA_HOME="$CUDA_DIR"
      export HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-75,80,90}"
    fi
    if [ "$GPU_BUILD" = 1 ]; then
      [ -n "${HOROVOD_NCCL_HOME:-${NCCL_HOME:-}}" ] || fail "HPCDL_GPU=1 needs NCCL: set NCCL_HOME (or 'module load nccl')"
      export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME="${HOROVOD_NCCL_HOME:-$NCCL_HOME}"
    fi
    mkdir -p "$WHEEL_DIR"
    (cd "$SRC" && "$VENV/bin/python" -m pip wheel -q --no-build-isolation --no-deps . -w "$BUILD/dist") >"$BUILD/build.log" 2>&1 ||
      { tail -n 30 "$BUILD/build.log" >&2; fail "Horovod did not build; full log: $BUILD/build.log"; }
    cp "$BUILD"/dist/horovod-*.whl "$WHEEL_DIR/"
    WHEEL="$(ls "$WHEEL_DIR"/horovod-*.whl | head -n 1)"
    rm -rf "$BUILD"
    ok "built and cached $WHEEL"
  fi
  pip_q install --force-reinstall --no-deps "$WHEEL" || fail "could not install $WHEEL"
  pip_q install cloudpickle psutil pyyaml packaging
  hvd_ok || fail "Horovod installed but its extension does not load (run: $VENV/bin/horovodrun --check-build)"
  ok "installed"
fi

# ---------------------------------------------------------------- mpi4py
step "5/6 mpi4py $MPI4PY_VERSION against $(command -v mpicc)"
mpi4py_ok() {
  "$VENV/bin/python" -c "import mpi4py, sys; sys.exit(0 if mpi4py.__version__ == '$MPI4PY_VERSION' else 1)" 2>/dev/null
}
if mpi4py_ok; then
  ok "already installed"
else
  # --no-binary: build against the MPI on PATH, never a wheel carrying some other MPI.
  pip_q install --no-binary mpi4py "mpi4py==$MPI4PY_VERSION" || fail "mpi4py did not build; is mpicc working? (mpicc --version)"
  ok "installed"
fi

# ---------------------------------------------------------------- hpcdl
step "6/6 hpcdl (editable) with test tools"
STAMP="$VENV/.hpcdl-installed"
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$ROOT/pyproject.toml" ]; then
  ok "already installed"
else
  pip_q install -e "$ROOT[test]" || fail "pip install -e .[test] failed"
  touch "$STAMP"
  ok "installed"
fi
"$VENV/bin/python" -c 'import hpcdl, kfac, horovod.torch, mpi4py.MPI, pytest_mpi' || fail "final import check failed"
printf '[setup] ready: %s (activate with: source %s/bin/activate)\n' "$VENV" "$VENV"
