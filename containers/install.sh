#!/usr/bin/env bash
# The one install step of every hpcdl image, run INSIDE the image being built, as root:
#
#   Singularity.def           (GPU, CUDA base)   %post: bash /opt/hpcdl/src/containers/install.sh --gpu
#   containers/hpcdl-cpu.def  (CPU, debootstrap) %post: bash /opt/hpcdl/src/containers/install.sh
#   containers/build.sh       (make image)       runs it in an mmdebstrap root through ch-run -w
#
# Steps: the Debian/Ubuntu packages (Python, a compiler, the MPI) where missing -> a check of the
# MPI family -> scripts/setup.sh (the same procedure as on a bare machine) into /opt/hpcdl/venv ->
# version labels -> cleanup. Options:
#   --gpu               Horovod with NCCL (HPCDL_GPU=1 setup; needs the CUDA toolkit: the CUDA base)
#   --mpi openmpi|mpich the MPI family inside the image (default openmpi: Open MPI 4.1)
#   --packages          print the packages this step needs, one line, and stop
# Environment: HPCDL_WHEELHOUSE (offline install from that folder), HPCDL_CACHE (Horovod/mpi4py
# wheel cache; wheels are reused only when their key matches), HPCDL_KEEP_CACHE=1 (do not delete it).
set -euo pipefail

GPU=0
MPI=openmpi
PRINT=0
while [ "$#" -gt 0 ]; do
  case "$1" in
    --gpu) GPU=1; shift ;;
    --mpi) MPI="${2:?--mpi needs openmpi or mpich}"; shift 2 ;;
    --packages) PRINT=1; shift ;;
    *) echo "[install] unknown option $1" >&2; exit 2 ;;
  esac
done
case "$MPI" in
  openmpi) MPI_PACKAGES="openmpi-bin libopenmpi-dev" ;;
  mpich) MPI_PACKAGES="mpich libmpich-dev" ;;
  *) echo "[install] --mpi must be openmpi or mpich (got '$MPI')" >&2; exit 2 ;;
esac
# Python for the venv, a compiler for Horovod and mpi4py, certificates, procps (ps, for the doctor).
PACKAGES="python3 python3-venv python3-dev build-essential ca-certificates procps $MPI_PACKAGES"
if [ "$PRINT" = 1 ]; then
  echo "$PACKAGES"
  exit 0
fi

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
say() { printf '[install] %s\n' "$*"; }

# shellcheck disable=SC2086 # a list of packages, split on purpose
if ! dpkg-query -W $PACKAGES >/dev/null 2>&1; then
  say "apt-get install $PACKAGES"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null
fi

# The family is what makes the host's launcher able to start these ranks (docs/cluster.md).
mpi_line="$(mpirun --version 2>&1 | grep -v -e '^\[' -e '^ *$' -e 'Report bugs' | head -n 2 | tr -s ' \n' '  ')"
case "$MPI:$mpi_line" in
  openmpi:*"Open MPI"*" 4.1."*) ;;
  mpich:*HYDRA*) ;;
  *) echo "[install] expected $MPI, mpiexec says: $mpi_line" >&2; exit 1 ;;
esac
say "MPI inside: $mpi_line"

HPCDL_GPU="$GPU" PYTHON=python3 HPCDL_VENV=/opt/hpcdl/venv HPCDL_CACHE="${HPCDL_CACHE:-/tmp/hpcdl-cache}" \
  bash "$SRC/scripts/setup.sh"

# Which hpcdl runs is a decision (containers/hpcdl_code.py): the image's own, a checkout's only when HPCDL_CODE
# asks. The image's environment sets PYTHONSAFEPATH=1 (the working folder is not put first on sys.path); this
# .pth runs the choice at every start. A link, so that the source layer's copy is the one that runs.
site="$(/opt/hpcdl/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ln -sfn /opt/hpcdl/src/containers/hpcdl_code.py "$site/hpcdl_code.py"
echo "import hpcdl_code" >"$site/hpcdl_code.pth"

# What is inside, for `apptainer inspect`, ch-run and the doctor (hpcdl.tools.doctor reads it).
# shellcheck source=scripts/versions.env
. "$SRC/scripts/versions.env"
{
  echo "hpcdl.mpi.family $MPI"
  echo "hpcdl.mpi.version $mpi_line"
  echo "hpcdl.torch $TORCH_VERSION"
  echo "hpcdl.torchvision $TORCHVISION_VERSION"
  echo "hpcdl.horovod $HOROVOD_VERSION"
  echo "hpcdl.mpi4py $MPI4PY_VERSION"
  echo "hpcdl.gpu $GPU"
} >/opt/hpcdl/labels
labels="${APPTAINER_LABELS:-${SINGULARITY_LABELS:-}}"
if [ -n "$labels" ]; then cat /opt/hpcdl/labels >>"$labels"; fi

if [ "${HPCDL_KEEP_CACHE:-0}" != 1 ]; then rm -rf "${HPCDL_CACHE:-/tmp/hpcdl-cache}"; fi
rm -rf /root/.cache/pip
apt-get clean
rm -rf /var/lib/apt/lists/*
say "done"
