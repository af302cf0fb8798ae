#!/usr/bin/env bash
# Gather everything scripts/setup.sh installs into one folder, on a machine with network access, so
# that setup completes on a compute node without any:
#
#   make wheelhouse DIR=/scratch/hpcdl-wheels             # here: wheels, sdists, build requirements
#   HPCDL_WHEELHOUSE=/scratch/hpcdl-wheels make setup     # there: pip --no-index --find-links, only
#
# The folder holds torch + torchvision with their CUDA libraries (about 2.6 GB), every pin of
# pyproject.toml with the test extra, the Horovod sdist and what building it needs (cmake, cffi,
# pycparser, ...), and the mpi4py sdist with its build requirements (both are compiled on the node,
# against the node's MPI and CUDA). Options, for a node unlike this machine:
#   --python-version 3.12   wheels for that Python (x86-64 manylinux), not this one's
#   --no-torch              leave torch/torchvision out (the node has its own: HPCDL_TORCH=existing)
#   --only "NAME..."        only these requirements (and what they need), plus the two sdists
# Run it again to refresh: pip skips files already there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/versions.env
source "$ROOT/scripts/versions.env"
PY="${PYTHON:-python3}"
[ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && PY="$ROOT/.venv/bin/python"

usage() { sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
DIR=""
TARGET_PY=""
WITH_TORCH=1
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) TARGET_PY="${2:?--python-version needs a version, e.g. 3.12}"; shift 2 ;;
    --no-torch) WITH_TORCH=0; shift ;;
    --only) ONLY="${2:?--only needs a list of requirements}"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "wheelhouse: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) DIR="$1"; shift ;;
  esac
done
# Everything asked for is checked before the first (2.6 GB) download.
die() { echo "wheelhouse: $1" >&2; exit 2; }
[ -n "$DIR" ] || die "which folder? e.g. make wheelhouse DIR=/scratch/hpcdl-wheels"
command -v "$PY" >/dev/null || die "PYTHON=$PY: no such program"
[ -z "$TARGET_PY" ] || [[ "$TARGET_PY" =~ ^3\.[0-9]+$ ]] || die "--python-version takes 3.N, e.g. 3.12 (got '$TARGET_PY')"
MKDIR_ERR="$(mkdir -p -- "$DIR" 2>&1)" || die "cannot make the folder $DIR (${MKDIR_ERR##*: })"
[ -w "$DIR" ] && [ -x "$DIR" ] || die "the folder $DIR is not writable"
DIR="$(cd "$DIR" && pwd)"

pip_dl() {
  "$PY" -m pip --disable-pip-version-check -q download -d "$DIR" "$@" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}
# Wheels for another Python: pip then needs binary-only downloads and the platform tags to accept.
BINARY=(--only-binary=:all:)
if [ -n "$TARGET_PY" ]; then
  BINARY+=(--python-version "$TARGET_PY" --implementation cp --abi "cp${TARGET_PY/./}")
  for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64 linux_x86_64; do
    BINARY+=(--platform "$tag")
  done
  BINARY+=(--abi abi3 --abi none)
fi

echo "[wheelhouse] into $DIR (python ${TARGET_PY:-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')})"
if [ -n "$ONLY" ]; then
  # shellcheck disable=SC2086 # a list of requirements, split on purpose
  pip_dl "${BINARY[@]}" $ONLY
else
  if [ "$WITH_TORCH" = 1 ]; then
    echo "[wheelhouse] torch $TORCH_VERSION + torchvision $TORCHVISION_VERSION with their CUDA libraries (~2.6 GB)"
    # The CUDA build (PyPI's torchvision needs it; it runs without a GPU too), never a local +cpu wheel.
    pip_dl "${BINARY[@]}" "torch==$TORCH_VERSION,!=$TORCH_VERSION+cpu" "torchvision==$TORCHVISION_VERSION"
  fi
  echo "[wheelhouse] hpcdl's pins (with the test extra) and build requirements"
  mapfile -t PINS < <("$PY" "$ROOT/scripts/pins.py" all)
  # shellcheck disable=SC2086 # lists of requirements, split on purpose
  pip_dl "${BINARY[@]}" "${PINS[@]}" $HOROVOD_BUILD_REQUIREMENTS $SDIST_BUILD_REQUIREMENTS
fi
echo "[wheelhouse] sdists compiled on the node: horovod $HOROVOD_VERSION, mpi4py $MPI4PY_VERSION"
pip_dl --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION"
pip_dl --no-deps --no-binary mpi4py "mpi4py==$MPI4PY_VERSION"
for sdist in "horovod-$HOROVOD_VERSION.tar.gz" "mpi4py-$MPI4PY_VERSION.tar.gz"; do
  [ -f "$DIR/$sdist" ] || { echo "wheelhouse: $sdist is missing from $DIR" >&2; exit 1; }
done
{
  echo "# hpcdl wheelhouse: HPCDL_WHEELHOUSE=$DIR make setup"
  echo "python=${TARGET_PY:-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')} torch=$WITH_TORCH only=${ONLY:-all}"
  grep -E '^[A-Z0-9_]+_VERSION=' "$ROOT/scripts/versions.env"
} >"$DIR/hpcdl-wheelhouse.txt"
echo "[wheelhouse] ready: $(find "$DIR" -maxdepth 1 -type f | wc -l) files, $(du -sh "$DIR" | cut -f1); use: HPCDL_WHEELHOUSE=$DIR make setup"
