#!/usr/bin/env bash
# Start hpcdl with mpirun on this machine or on the hosts of a hostfile.
# Run with --help for the options; everything it does not know goes to python -m hpcdl.train.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/mpirun.sh [options] [--] [hpcdl.train options]

Runs one rank per GPU (or per slot on a CPU machine) with mpirun and the flags Horovod
recommends: -bind-to none -map-by slot, the environment exported to every rank, and
OMP_NUM_THREADS set so that the ranks of a host share its cores instead of fighting over them.

  launch/mpirun.sh -np 2                          # 2 ranks, digits, defaults of hpcdl.train
  launch/mpirun.sh -np 4 --epochs 5 --output-dir runs/try1
  launch/mpirun.sh -np 8 --hostfile hosts.txt --image hpcdl.sif -- --dataset cifar10
  launch/mpirun.sh -np 2 --entry hpcdl.doctor     # show which rank got which GPU

Options (each also read from the environment variable shown):
  -np, -n N          number of ranks (HPCDL_NP; default: GPUs on this host, or 2 without GPUs)
  --hostfile FILE    Open MPI hostfile, one 'host slots=N' line per node (HPCDL_HOSTFILE)
  --threads N        OpenMP threads per rank (OMP_NUM_THREADS; default: cores / ranks per host)
  --oversubscribe    allow more ranks than cores (HPCDL_OVERSUBSCRIBE=1; added by itself when
                     -np exceeds the cores of this machine and there is no hostfile)
  --mpirun CMD       the mpirun to use (HPCDL_MPIRUN; default: mpirun on PATH)
  --mpi-args "ARGS"  extra words for mpirun, e.g. "-mca pml ob1 -mca btl ^openib" to force TCP
                     when RDMA misbehaves (HPCDL_MPI_ARGS)
  --export "VARS"    more environment variables to pass to every rank (HPCDL_EXPORT)
EOF
  hpcdl_common_help
}

# ---------------------------------------------------------------- find the repository
hpcdl_root=""
for dir in "${HPCDL_ROOT:-}" "$(dirname -- "${BASH_SOURCE[0]}")/.."; do
  if [ -n "$dir" ] && [ -f "$dir/launch/common.sh" ]; then
    hpcdl_root="$(cd -- "$dir" && pwd)"
    break
  fi
done
[ -n "$hpcdl_root" ] || { echo "error: cannot find the hpcdl repository; set HPCDL_ROOT" >&2; exit 2; }
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$hpcdl_root/launch/common.sh"

# ---------------------------------------------------------------- settings
NP="${HPCDL_NP:-}"
HOSTFILE="${HPCDL_HOSTFILE:-}"
THREADS="${OMP_NUM_THREADS:-}"
OVERSUBSCRIBE="${HPCDL_OVERSUBSCRIBE:-0}"
MPIRUN="${HPCDL_MPIRUN:-mpirun}"
MPI_ARGS="${HPCDL_MPI_ARGS:-}"
EXPORT_VARS="${HPCDL_EXPORT:-}"

while [ "$#" -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    -np | -n | --np) hpcdl_need_value "$1" "$@"; NP="$2"; shift 2 ;;
    --hostfile) hpcdl_need_value "$1" "$@"; HOSTFILE="$2"; shift 2 ;;
    --threads) hpcdl_need_value "$1" "$@"; THREADS="$2"; shift 2 ;;
    --oversubscribe) OVERSUBSCRIBE=1; shift ;;
    --mpirun) hpcdl_need_value "$1" "$@"; MPIRUN="$2"; shift 2 ;;
    --mpi-args) hpcdl_need_value "$1" "$@"; MPI_ARGS="$2"; shift 2 ;;
    --export) hpcdl_need_value "$1" "$@"; EXPORT_VARS="$2"; shift 2 ;;
    --) shift; break ;;
    *)
      if hpcdl_parse_common_flag "$@"; then
        shift "$HPCDL_SHIFT"
      else
        break # the first word we do not know starts the arguments for the entry module
      fi
      ;;
  esac
done

if [ -z "$NP" ]; then
  gpus=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
  fi
  if hpcdl_is_count "$gpus"; then NP="$gpus"; else NP=2; fi
fi
hpcdl_is_count "$NP" || hpcdl_die "-np must be a positive whole number, got '$NP'"
if [ -n "$THREADS" ] && ! hpcdl_is_count "$THREADS"; then
  hpcdl_die "--threads must be a positive whole number, got '$THREADS'"
fi
if [ -n "$HOSTFILE" ] && [ ! -r "$HOSTFILE" ]; then
  hpcdl_die "hostfile not readable: $HOSTFILE"
fi
command -v "$MPIRUN" >/dev/null 2>&1 || hpcdl_die "$MPIRUN not found; load your MPI (e.g. module load openmpi) or pass --mpirun"

# ---------------------------------------------------------------- ranks per host and threads
CORES="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)"  # nproc obeys OMP_NUM_THREADS otherwise
RANKS_PER_HOST="$NP"
if [ -n "$HOSTFILE" ]; then
  hosts="$(grep -cEv '^[[:space:]]*(#|$)' "$HOSTFILE" || true)"
  hpcdl_is_count "$hosts" || hpcdl_die "hostfile lists no hosts: $HOSTFILE"
  RANKS_PER_HOST=$(((NP + hosts - 1) / hosts))
elif [ "$NP" -gt "$CORES" ] && [ "$OVERSUBSCRIBE" != 1 ]; then
  hpcdl_note "$NP ranks on $CORES cores: adding --oversubscribe"
  OVERSUBSCRIBE=1
fi
THREADS="${THREADS:-$(hpcdl_threads_per_rank "$CORES" "$RANKS_PER_HOST")}"
export OMP_NUM_THREADS="$THREADS"
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- the mpirun command
hpcdl_rank_command "$hpcdl_root"
CMD=("$MPIRUN")
if "$MPIRUN" --version 2>&1 | grep -q 'Open MPI'; then
  CMD+=(-np "$NP" -bind-to none -map-by slot)
  if [ -n "$HOSTFILE" ]; then CMD+=(--hostfile "$HOSTFILE"); fi
  if [ "$OVERSUBSCRIBE" = 1 ]; then CMD+=(--oversubscribe); fi
  if [ "$(id -u)" = 0 ]; then CMD+=(--allow-run-as-root); fi
  # Local ranks inherit the whole environment; -x also sends these to the other hosts.
  names=(OMP_NUM_THREADS PYTHONUNBUFFERED PATH LD_LIBRARY_PATH PYTHONPATH)
  while IFS= read -r name; do names+=("$name"); done < <(compgen -e | grep -E '^(NCCL|HOROVOD|HPCDL|UCX)_' || true)
  read -r -a extra_names <<<"$EXPORT_VARS"
  # (the ${a[@]+...} form keeps bash 4.2, still on some clusters, quiet about empty arrays)
  for name in "${names[@]}" ${extra_names[@]+"${extra_names[@]}"}; do
    if [ -n "${!name+set}" ]; then CMD+=(-x "$name"); fi
  done
else
  # MPICH-family launchers (MPICH, Intel MPI, MVAPICH2) pass the whole environment by default.
  CMD+=(-n "$NP")
  if [ -n "$HOSTFILE" ]; then CMD+=(-f "$HOSTFILE"); fi
  CMD+=(-genv OMP_NUM_THREADS "$THREADS")
fi
read -r -a mpi_words <<<"$MPI_ARGS"
CMD+=(${mpi_words[@]+"${mpi_words[@]}"})
CMD+=("${HPCDL_RANK_CMD[@]}" "$@")

hpcdl_note "$NP ranks, $RANKS_PER_HOST per host, $THREADS threads each"
hpcdl_show_command "${CMD[@]}"
[ "$HPCDL_DRY_RUN" = 1 ] && exit 0
exec "${CMD[@]}"
