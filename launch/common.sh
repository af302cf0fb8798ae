# shellcheck shell=bash
# What every launch script (mpirun.sh, slurm.sbatch, frontera-rtx.sbatch) does; source it, do not run it.
#
# The scripts only find the repository and call hpcdl_launch. Every decision (the options, the host
# lists, ranks and threads, the container and its runtime, the MPI family, the batch job's output
# folder) is Python's: `python -m hpcdl.launch` (hpcdl/launching/args.py and plan.py)
# prints it as shell. What stays here is what only the shell can do: load modules into itself,
# requeue the job when Slurm signals it, and exec the command.

hpcdl_root="$(cd -- "$hpcdl_root" && pwd)"

# One-line error and exit 2 (bad usage, like every launch error).
hpcdl_die() {
  printf 'error: %s\n' "$*" >&2
  exit 2
}

hpcdl_note() {
  printf '[hpcdl] %s\n' "$*" >&2
}

# Asks hpcdl.launch, with the repository's interpreter where setup made one (any python3 otherwise):
# standard library only, it runs before a virtual environment is known. The repository goes first on
# its PYTHONPATH; it decides with the caller's PATH and PYTHONPATH (and a python3 shim, pyenv's, may
# change PATH), handed over as LAUNCH_CALLER_*.
# Usage: hpcdl_decide SCRIPT STEP ARGS...
hpcdl_decide() {
  local python=python3
  local -a caller=("LAUNCH_CALLER_PATH=$PATH")
  if [ -x "$hpcdl_root/.venv/bin/python" ]; then python="$hpcdl_root/.venv/bin/python"; fi
  command -v "$python" >/dev/null 2>&1 || hpcdl_die "python3 not found: the launch scripts need it to read their arguments"
  if [ -n "${PYTHONPATH+set}" ]; then caller+=("LAUNCH_CALLER_PYTHONPATH=$PYTHONPATH"); fi
  env "${caller[@]}" PYTHONPATH="$hpcdl_root" "$python" -m hpcdl.launch "$1" "$2" "$hpcdl_root" "${@:3}"
}

# Loads modules into this shell (frontera-rtx.sbatch), so that the command found after sees them.
hpcdl_load_modules() {
  local -a names
  read -r -a names <<<"$1"
  if ! command -v module >/dev/null 2>&1; then
    hpcdl_note "no 'module' command here: not loading $1"
    return 0
  fi
  hpcdl_note "module load ${names[*]}"
  # Lmod's scripts are not written for 'set -u'.
  set +u
  module load "${names[@]}" || hpcdl_die "module load ${names[*]} failed; set HPCDL_MODULES to what your site has ('module avail')"
  set -u
}

# Requeue near the time limit. The batch scripts ask Slurm for SIGUSR1 to the batch shell
# (--signal=B:USR1@SECONDS) a while before the limit. The shell passes it on to every task of the
# job's steps (scancel --signal, which reaches the ranks under srun and under ibrun alike);
# hpcdl.train checkpoints and exits; then the shell requeues the job, which resumes.
HPCDL_TIME_LIMIT_NEAR=0

hpcdl_on_time_limit() {
  HPCDL_TIME_LIMIT_NEAR=1
  hpcdl_note "time limit near: asking the ranks of job ${SLURM_JOB_ID:-?} to checkpoint (SIGUSR1)"
  scancel --signal=USR1 "${SLURM_JOB_ID:?}" || hpcdl_note "scancel --signal=USR1 failed"
}

# Runs a job step in the background so that the shell can react to SIGUSR1, waits for it, and
# requeues the job when the time-limit signal interrupted it (unless REQUEUE is 0). Returns the
# step's exit status.
# Usage: hpcdl_run_step REQUEUE WORDS...
hpcdl_run_step() {
  local requeue="$1" pid rc
  shift
  trap hpcdl_on_time_limit USR1
  "$@" &
  pid=$!
  while :; do
    rc=0
    wait "$pid" || rc=$?
    # wait also returns when a trapped signal arrives; go on waiting while the step still runs.
    kill -0 "$pid" 2>/dev/null || break
  done
  trap - USR1
  if [ "$HPCDL_TIME_LIMIT_NEAR" = 1 ] && [ "$requeue" = 1 ]; then
    hpcdl_note "step ended (exit $rc) after the time-limit signal: requeueing job ${SLURM_JOB_ID:-?}; it resumes from its checkpoint"
    scontrol requeue "${SLURM_JOB_ID:?}"
  fi
  return "$rc"
}

# The whole launch: decide, load the modules asked for, decide the command with them loaded, run it.
# Usage: hpcdl_launch SCRIPT ARGS... (SCRIPT: mpirun, slurm or frontera-rtx)
hpcdl_launch() {
  local decided LAUNCH_MODULES="" LAUNCH_HOW="" LAUNCH_REQUEUE=""
  local -a LAUNCH_WORDS=()
  decided="$(hpcdl_decide "$1" modules "${@:2}")" || exit "$?"
  eval "$decided"
  if [ -n "$LAUNCH_MODULES" ]; then hpcdl_load_modules "$LAUNCH_MODULES"; fi
  decided="$(hpcdl_decide "$1" command "${@:2}")" || exit "$?"
  eval "$decided"
  case "$LAUNCH_HOW" in
    dry-run) exit 0 ;;
    step) hpcdl_run_step "$LAUNCH_REQUEUE" "${LAUNCH_WORDS[@]}" ;;
    *) exec "${LAUNCH_WORDS[@]}" ;;
  esac
}
