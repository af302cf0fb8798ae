#!/usr/bin/env bash
# One-command, idempotent setup of hpcdl's environment in .venv at the repository root.
#
#   bash scripts/setup.sh                        # CPU build (what CI and laptops use)
#   HPCDL_GPU=1 bash scripts/setup.sh            # Horovod with NCCL too (CUDA toolkit; NCCL is found by itself)
#   HPCDL_WHEELHOUSE=DIR bash scripts/setup.sh   # no network: everything from DIR (make wheelhouse DIR=...)
#   HPCDL_TORCH=existing bash scripts/setup.sh   # build against the torch $PYTHON already has (site module,
#                                                # conda env, NGC container) instead of installing a second one
#   HPCDL_HOROVOD=0 bash scripts/setup.sh        # no Horovod: hpcdl.train then defaults to --backend torch
#                                                # (1: Horovod must build; auto, the default: it is left out,
#                                                # said in one line, when its build fails, e.g. on aarch64)
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
WHEELHOUSE="${HPCDL_WHEELHOUSE:-}"
TORCH_MODE="${HPCDL_TORCH:-auto}" # auto | pip | existing
HOROVOD_MODE="${HPCDL_HOROVOD:-auto}" # auto | 1 | 0
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
# shellcheck disable=SC2154 # rc is assigned inside the trap's own string
trap 'rc=$?; if [ $rc -ne 0 ]; then printf "[setup] FAILED at step \"%s\" (exit %s). Read the output above; rerun with bash -x scripts/setup.sh for detail.\n" "$STEP" "$rc" >&2; fi' EXIT

# pip, quiet, without the noise a partial local package mirror makes.
pip_q() {
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}

case "$TORCH_MODE" in auto | pip | existing) ;; *) fail "HPCDL_TORCH must be auto, pip or existing (got '$TORCH_MODE')" ;; esac
case "$HOROVOD_MODE" in auto | 1 | 0) ;; *) fail "HPCDL_HOROVOD must be auto, 1 or 0 (got '$HOROVOD_MODE')" ;; esac
# What was asked for is checked before anything is built or linked: PYTHON must be a Python, and
# HPCDL_TORCH=existing needs a torch in it (whatever this venv already holds).
PY_WHO="${PYTHON:+PYTHON=}$PY_BOOT"
if ! command -v "$PY_BOOT" >/dev/null; then
  fail "$PY_WHO: no such program (set PYTHON to a python3 executable, e.g. PYTHON=\$(command -v python3))"
fi
PY_CHECK="$("$PY_BOOT" -c 'import sys; assert sys.version_info >= (3, 9), sys.version.split()[0]' 2>&1)" ||
  fail "$PY_WHO is not a usable Python 3.9 or newer ($(printf '%s' "$PY_CHECK" | tail -n 1))"
if [ "$TORCH_MODE" = existing ]; then
  if [ -x "$VENV/bin/python" ] && [ ! -f "$VENV/.hpcdl-existing-torch" ]; then
    fail "HPCDL_TORCH=existing, but $VENV was made with its own torch; remove it or choose another HPCDL_VENV"
  fi
  if [ -f "$VENV/.hpcdl-existing-torch" ] &&
    [ "$(readlink -f "$(command -v "$(cat "$VENV/.hpcdl-existing-torch")")" 2>/dev/null)" != "$(readlink -f "$(command -v "$PY_BOOT")")" ]; then
    fail "$VENV is linked to the torch of $(cat "$VENV/.hpcdl-existing-torch"), not of $PY_BOOT; remove it or choose another HPCDL_VENV"
  fi
  PY_CHECK="$("$PY_BOOT" -c 'import torch, torchvision.ops as o; o.nms(torch.rand(2, 4), torch.rand(2), 0.5)' 2>&1)" ||
    fail "HPCDL_TORCH=existing, but $PY_WHO cannot use its torch and torchvision ($(printf '%s' "$PY_CHECK" | tail -n 1)); set PYTHON to the python that has them (module load ..., conda activate ...)"
fi
if [ -n "$WHEELHOUSE" ]; then
  [ -d "$WHEELHOUSE" ] || fail "HPCDL_WHEELHOUSE=$WHEELHOUSE is not a folder (make one with: make wheelhouse DIR=...)"
  WHEELHOUSE="$(cd "$WHEELHOUSE" && pwd)"
  # Every pip below, and the pips that build isolated sdists, read these: nothing comes from a network.
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE"
  printf '[setup] offline: installing only from %s\n' "$WHEELHOUSE"
fi

# ---------------------------------------------------------------- MPI
step "1/6 MPI"
if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
  ok "using the MPI on PATH: $(command -v mpirun) ($(mpirun --version 2>&1 | grep -v "^\[" | head -n 1))"
elif [ -z "$WHEELHOUSE" ] && [ -f /etc/debian_version ] && [ "$(id -u)" = 0 ]; then
  ok "no MPI on PATH: installing Debian's Open MPI (libopenmpi-dev openmpi-bin)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || fail "apt-get update failed; check network access to the Debian mirrors"
  apt-get install -y -qq libopenmpi-dev openmpi-bin >/dev/null || fail "apt-get install of Open MPI failed"
  ok "installed $(mpirun --version 2>&1 | head -n 1)"
else
  fail "no mpicc/mpirun on PATH. On a cluster run 'module load openmpi' (or your site's MPI) first; on Debian/Ubuntu run as root so setup can install Open MPI."
fi

# ---------------------------------------------------------------- venv
# Which torch: "pip" installs the pinned one into the venv; "existing" uses the torch that $PYTHON
# already imports (a site module, a conda env, an NGC container) through a .pth file in the venv, so
# no second torch (2.6 GB) is installed. "auto" takes an existing torch only where that is safe.
EXISTING_MARK="$VENV/.hpcdl-existing-torch"
# torch and torchvision that import and work together in $PY_BOOT: prints torch's version.
boot_torch() {
  "$PY_BOOT" -c 'import torch, torchvision.ops as o; o.nms(torch.rand(2, 4), torch.rand(2), 0.5); print(torch.__version__)' 2>/dev/null
}
if [ "$TORCH_MODE" = auto ]; then
  TORCH_MODE=pip
  if [ -f "$EXISTING_MARK" ]; then
    TORCH_MODE=existing # chosen when this venv was made
  elif [ ! -x "$VENV/bin/python" ] && BOOT_TORCH="$(boot_torch)"; then
    if [ "${BOOT_TORCH%%+*}" = "$TORCH_VERSION" ] || [ -n "${NVIDIA_PYTORCH_VERSION:-}" ] ||
      { [ -n "$WHEELHOUSE" ] && ! compgen -G "$WHEELHOUSE/torch-*.whl" >/dev/null; }; then
      TORCH_MODE=existing # the pinned version, an NGC container, or a wheelhouse without torch
    else
      ok "$PY_BOOT has torch $BOOT_TORCH; installing torch $TORCH_VERSION instead (HPCDL_TORCH=existing builds against $BOOT_TORCH)"
    fi
  fi
fi

step "2/6 virtual environment at $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PY_BOOT" -c 'import ensurepip, venv' 2>/dev/null; then
    fail "$PY_WHO has no venv/ensurepip module; install python3-venv (Debian) or load a Python module that has it"
  fi
  VENV_ERR="$("$PY_BOOT" -m venv "$VENV" 2>&1)" ||
    fail "'$PY_BOOT -m venv $VENV' failed: $(printf '%s' "$VENV_ERR" | tail -n 1)"
  ok "created"
else
  ok "exists ($("$VENV/bin/python" --version))"
fi
if [ "$TORCH_MODE" = existing ] && ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  boot_torch >/dev/null || fail "HPCDL_TORCH=existing, but '$PY_BOOT' cannot import torch and torchvision; set PYTHON to the python that has them (module load ..., conda activate ...)"
  # The existing environment's package folders go on the venv's path AFTER its own site-packages:
  # what setup installs here wins, everything else (torch, its CUDA libraries) comes from there.
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$PY_BOOT" - >"$SITE/_hpcdl_existing_torch.pth" <<'PY' || fail "could not list $PY_BOOT's package folders"
import os, sys, sysconfig
stdlib = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
for entry in sys.path:
    real = os.path.realpath(entry) if entry else ""
    if real and os.path.isdir(real) and real not in stdlib and not real.endswith("lib-dynload"):
        print(real)
PY
  echo "$PY_BOOT" >"$EXISTING_MARK"
  ok "linked to the torch of $PY_BOOT ($SITE/_hpcdl_existing_torch.pth)"
fi

# ---------------------------------------------------------------- torch
torch_ok() {
  "$VENV/bin/python" - "$TORCH_VERSION" "$TORCHVISION_VERSION" "$TORCH_MODE" <<'PY' 2>/dev/null
import sys
import torch, torchvision
from torchvision.ops import nms  # fails when torchvision's extension does not match torch
want_t, want_v, mode = sys.argv[1:4]
if mode != "existing":
    assert torch.__version__.split("+")[0] == want_t and torchvision.__version__.split("+")[0] == want_v
nms(torch.rand(2, 4), torch.rand(2), 0.5)
PY
}
if [ "$TORCH_MODE" = existing ]; then
  step "3/6 torch (existing)"
  torch_ok || fail "the existing torch and torchvision do not import together in $VENV (torchvision must be the one built for that torch)"
  ok "using $("$VENV/bin/python" -c 'import torch, os; print(torch.__version__, "from", os.path.dirname(torch.__file__))')"
else
  step "3/6 torch $TORCH_VERSION + torchvision $TORCHVISION_VERSION"
  if torch_ok; then
    ok "already installed and importing together"
  else
    # PyPI's torchvision links against the CUDA build of torch, so a CPU-only torch (a "+cpu" wheel in a
    # local folder) cannot be used: exclude it explicitly. The CUDA build runs fine without a GPU.
    pip_q install "torch==$TORCH_VERSION,!=$TORCH_VERSION+cpu" "torchvision==$TORCHVISION_VERSION" ||
      fail "pip could not install torch/torchvision; check access to PyPI${WHEELHOUSE:+ (or that $WHEELHOUSE has them)}"
    torch_ok || fail "torch and torchvision are installed but do not import together"
    ok "installed"
  fi
fi

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
# Builds and installs Horovod; returns non-zero (after saying why on stderr) when it cannot.
install_horovod() {
  # shellcheck disable=SC2086 # a list of requirements, split on purpose
  pip_q install $HOROVOD_BUILD_REQUIREMENTS || { echo "could not install Horovod's build tools ($HOROVOD_BUILD_REQUIREMENTS)" >&2; return 1; }
  # Build settings, NCCL discovery, CUDA architectures and the cache key: scripts/horovod_build.py.
  BUILD_ENV="$("$VENV/bin/python" "$ROOT/scripts/horovod_build.py" env --gpu "$GPU_BUILD" --cache "$CACHE" \
    --mpi "$(mpirun --version 2>&1)")" || return 1
  KEY="$(printf '%s\n' "$BUILD_ENV" | sed -n 's/^HOROVOD_CACHE_KEY=//p' | tr -d "'")"
  WHEEL_DIR="$CACHE/wheels/$KEY"
  WHEEL="$(find "$WHEEL_DIR" -maxdepth 1 -name 'horovod-*.whl' 2>/dev/null | head -n 1 || true)"
  if [ -n "$WHEEL" ]; then
    ok "using cached wheel $WHEEL"
  else
    ok "building from the sdist (about 5 minutes on 2 cores, 2 on 16); cache: $WHEEL_DIR"
    BUILD="$(mktemp -d)"
    if [ -n "$WHEELHOUSE" ]; then
      cp "$WHEELHOUSE/horovod-$HOROVOD_VERSION.tar.gz" "$BUILD/" || { echo "$WHEELHOUSE has no horovod-$HOROVOD_VERSION.tar.gz (rebuild it with make wheelhouse)" >&2; return 1; }
    else
      pip_q download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD" || { echo "could not download the Horovod sdist" >&2; return 1; }
    fi
    # --no-same-owner: as root in a container's user namespace the sdist's owners (uid 1001) do not exist.
    tar --no-same-owner -xzf "$BUILD"/horovod-"$HOROVOD_VERSION".tar.gz -C "$BUILD"
    SRC="$BUILD/horovod-$HOROVOD_VERSION"
    # PyTorch >= 2.1 headers need C++17; 0.28.1 pins C++14 (every Horovod build fix: horovod_build.py).
    "$VENV/bin/python" "$ROOT/scripts/horovod_build.py" patch-sdist "$SRC" || return 1
    mkdir -p "$WHEEL_DIR"
    # The venv's bin first: Horovod's setup.py looks for `cmake` on PATH (the pip-installed one above),
    # and without one it tries to download CMake (no network inside an image build).
    (eval "$BUILD_ENV" && export PATH="$VENV/bin:$PATH" && cd "$SRC" && "$VENV/bin/python" -m pip wheel -q --no-build-isolation --no-deps . -w "$BUILD/dist") >"$BUILD/build.log" 2>&1 ||
      { tail -n 30 "$BUILD/build.log" >&2; echo "Horovod did not build; full log: $BUILD/build.log" >&2; return 1; }
    cp "$BUILD"/dist/horovod-*.whl "$WHEEL_DIR/"
    WHEEL="$(find "$WHEEL_DIR" -maxdepth 1 -name 'horovod-*.whl' | head -n 1)"
    rm -rf "$BUILD"
    ok "built and cached $WHEEL"
  fi
  pip_q install --force-reinstall --no-deps "$WHEEL" || { echo "could not install $WHEEL" >&2; return 1; }
  pip_q install cloudpickle psutil pyyaml packaging
  hvd_ok || { echo "Horovod installed but its extension does not load (run: $VENV/bin/horovodrun --check-build)" >&2; return 1; }
}
if [ "$HOROVOD_MODE" = 0 ]; then
  ok "left out (HPCDL_HOROVOD=0): hpcdl.train defaults to --backend torch"
elif hvd_ok; then
  ok "already installed with its extension"
elif install_horovod; then
  ok "installed"
elif [ "$HOROVOD_MODE" = 1 ]; then
  fail "Horovod did not install (see the lines above); HPCDL_HOROVOD=1 asks for it, HPCDL_HOROVOD=0 leaves it out"
else
  ok "Horovod could not be built here (see the lines above): continuing without it; hpcdl.train defaults to --backend torch (HPCDL_HOROVOD=1 makes this an error)"
fi

# ---------------------------------------------------------------- mpi4py
step "5/6 mpi4py $MPI4PY_VERSION against $(command -v mpicc)"
mpi4py_ok() {
  # Installed in this venv (an existing environment's mpi4py may be built against another MPI).
  "$VENV/bin/python" - "$MPI4PY_VERSION" "$VENV" <<'PY' 2>/dev/null
import os, sys
import mpi4py
inside = os.path.realpath(mpi4py.__file__).startswith(os.path.realpath(sys.argv[2]) + os.sep)
sys.exit(0 if mpi4py.__version__ == sys.argv[1] and inside else 1)
PY
}
if mpi4py_ok; then
  ok "already installed"
else
  # Built from the sdist against the MPI on PATH (never a wheel carrying some other MPI), once: the
  # wheel is cached under a key naming that MPI, the Python ABI and the compiler (an image build
  # reuses it only when its own key is the same).
  M_KEY="$("$VENV/bin/python" "$ROOT/scripts/horovod_build.py" mpi4py-key --mpi "$(mpirun --version 2>&1)")" || fail "see the line above"
  M_DIR="$CACHE/wheels/$M_KEY"
  M_WHEEL="$(find "$M_DIR" -maxdepth 1 -name "mpi4py-$MPI4PY_VERSION-*.whl" 2>/dev/null | head -n 1 || true)"
  if [ -n "$M_WHEEL" ]; then
    ok "using cached wheel $M_WHEEL"
  else
    M_BUILD="$(mktemp -d)"
    pip_q wheel --no-deps --no-binary mpi4py "mpi4py==$MPI4PY_VERSION" -w "$M_BUILD" || fail "mpi4py did not build; is mpicc working? (mpicc --version)"
    mkdir -p "$M_DIR" && cp "$M_BUILD"/mpi4py-*.whl "$M_DIR/" && rm -rf "$M_BUILD"
    M_WHEEL="$(find "$M_DIR" -maxdepth 1 -name "mpi4py-$MPI4PY_VERSION-*.whl" | head -n 1)"
    ok "built and cached $M_WHEEL"
  fi
  pip_q install --ignore-installed --no-deps "$M_WHEEL" || fail "could not install $M_WHEEL"
  ok "installed"
fi

# ---------------------------------------------------------------- hpcdl
step "6/6 hpcdl (editable) with test tools"
STAMP="$VENV/.hpcdl-installed"
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$ROOT/pyproject.toml" ]; then
  ok "already installed"
else
  if [ "$TORCH_MODE" = existing ]; then
    # Next to an existing torch: only the pins whose package is absent (scripts/pins.py says why).
    mapfile -t MISSING < <("$VENV/bin/python" "$ROOT/scripts/pins.py" missing --group deps)
    if [ "${#MISSING[@]}" -gt 0 ] && [ -n "${MISSING[0]}" ]; then
      pip_q install "${MISSING[@]}" || fail "could not install ${MISSING[*]}"
    fi
    # Test tools: each one that can be had (a small wheelhouse may leave linters out; their tests skip).
    mapfile -t MISSING < <("$VENV/bin/python" "$ROOT/scripts/pins.py" missing --group test)
    for requirement in "${MISSING[@]}"; do
      [ -n "$requirement" ] && { pip_q install "$requirement" 2>/dev/null || ok "test tool $requirement not installed (not available)"; }
    done
    pip_q install --no-deps -e "$ROOT" || fail "pip install -e . failed"
  else
    pip_q install -e "${ROOT}[test]" || fail "pip install -e .[test] failed"
  fi
  touch "$STAMP"
  ok "installed"
fi
"$VENV/bin/python" -c 'import hpcdl, kfac, mpi4py.MPI, pytest_mpi, torch.distributed as d; assert d.is_gloo_available()' ||
  fail "final import check failed"
if hvd_ok; then
  ok "backends: horovod (the default) and torch"
else
  ok "backends: torch only (no Horovod); hpcdl.train defaults to --backend torch"
fi
printf '[setup] ready: %s (activate with: source %s/bin/activate)\n' "$VENV" "$VENV"
