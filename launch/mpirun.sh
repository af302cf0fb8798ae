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
  -H, --host LIST    hosts as HOST:SLOTS,HOST:SLOTS (HPCDL_HOSTS). Neither -H nor --hostfile
                     inside a Slurm job: Open MPI uses the job's nodes, -np defaults to SLURM_NTASKS
  --iface IF         the network the job uses, an interface name (ib0, eth0) or a subnet
                     (10.1.2.0/24) (HPCDL_IFACE): Open MPI's TCP transport and its daemons'
                     out-of-band channel (btl_tcp_if_include, oob_tcp_if_include); a name also
                     goes to Horovod's Gloo (HOROVOD_GLOO_IFACE) and NCCL (NCCL_SOCKET_IFNAME)
  --vcluster NAME    run on a virtual cluster (python -m hpcdl.tools.vcluster up) (HPCDL_VCLUSTER):
                     its nodes as hosts, its subnet as --iface, launch/vcluster-rsh to reach them;
                     the clusters are listed in HPCDL_VCLUSTER_STATE (default /run/hpcdl-vcluster)
  --abort-grace S    when a rank aborts the job (a lost node, a stall) and mpirun has not ended
                     S seconds later, kill it (HPCDL_ABORT_GRACE; default 20; 0 = no supervisor)
HPCDL_OOB_KEEPALIVE (environment only): "TIME INTVL PROBES" of Open MPI's daemon keepalives
                     (default "10 5 3": a cut node is noticed in 10-25 s; "" = Open MPI's 8 min)
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
HOSTS="${HPCDL_HOSTS:-}"
IFACE="${HPCDL_IFACE:-}"
VCLUSTER="${HPCDL_VCLUSTER:-}"
ABORT_GRACE="${HPCDL_ABORT_GRACE:-20}"
# Open MPI's daemons notice a peer that stopped answering on an idle connection after
# TIME + INTVL x PROBES seconds (defaults 300 + 20 x 9 = 8 min): "TIME INTVL PROBES", "" = defaults.
OOB_KEEPALIVE="${HPCDL_OOB_KEEPALIVE-10 5 3}"

while [ "$#" -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    -np | -n | --np) hpcdl_need_value "$1" "$@"; NP="$2"; shift 2 ;;
    --hostfile) hpcdl_need_value "$1" "$@"; HOSTFILE="$2"; shift 2 ;;
    -H | --host) hpcdl_need_value "$1" "$@"; HOSTS="$2"; shift 2 ;;
    --iface) hpcdl_need_value "$1" "$@"; IFACE="$2"; shift 2 ;;
    --vcluster) hpcdl_need_value "$1" "$@"; VCLUSTER="$2"; shift 2 ;;
    --abort-grace) hpcdl_need_value "$1" "$@"; ABORT_GRACE="$2"; shift 2 ;;
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

RSH_AGENT=""
if [ -n "$VCLUSTER" ]; then
  vc_state="${HPCDL_VCLUSTER_STATE:-/run/hpcdl-vcluster}"
  [ -r "$vc_state/$VCLUSTER.hosts" ] || hpcdl_die "no virtual cluster named '$VCLUSTER' (python -m hpcdl.tools.vcluster up --name $VCLUSTER)"
  vc_nodes="$(awk 'END {print NR}' "$vc_state/$VCLUSTER.hosts")"
  [ -n "$NP" ] || NP=$((2 * vc_nodes))
  hpcdl_is_count "$NP" || hpcdl_die "-np must be a positive whole number, got '$NP'"
  if [ -z "$HOSTS" ] && [ -z "$HOSTFILE" ]; then
    HOSTS="$(awk -v s=$(((NP + vc_nodes - 1) / vc_nodes)) '{printf "%s%s:%d", (NR > 1 ? "," : ""), $1, s}' "$vc_state/$VCLUSTER.hosts")"
  fi
  [ -n "$IFACE" ] || IFACE="$(sed -n 's/.*"subnet": "\([^"]*\)".*/\1/p' "$vc_state/$VCLUSTER.json")"
  RSH_AGENT="$hpcdl_root/launch/vcluster-rsh"
fi
if [ -n "$HOSTS" ] && [ -n "$HOSTFILE" ]; then
  hpcdl_die "give -H or --hostfile, not both"
fi
if [ -z "$NP" ] && [ -n "${SLURM_NTASKS:-}" ] && [ -z "$HOSTS$HOSTFILE" ]; then
  NP="$SLURM_NTASKS"
fi
if [ -z "$NP" ] && [ -n "$HOSTS" ]; then
  NP=0
  IFS=, read -r -a host_words <<<"$HOSTS"
  for word in "${host_words[@]}"; do
    slots="${word##*:}"
    if [ "$slots" = "$word" ]; then slots=1; fi
    hpcdl_is_count "$slots" || hpcdl_die "-H wants HOST:SLOTS,HOST:SLOTS, got '$HOSTS'"
    NP=$((NP + slots))
  done
fi
if [ -n "$ABORT_GRACE" ] && ! [[ "$ABORT_GRACE" =~ ^[0-9]+$ ]]; then
  hpcdl_die "--abort-grace must be a whole number of seconds, got '$ABORT_GRACE'"
fi

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
elif [ -n "$HOSTS" ]; then
  IFS=, read -r -a host_words <<<"$HOSTS"
  RANKS_PER_HOST=$(((NP + ${#host_words[@]} - 1) / ${#host_words[@]}))
elif [ -n "${SLURM_JOB_NUM_NODES:-}" ] && hpcdl_is_count "${SLURM_JOB_NUM_NODES}"; then
  RANKS_PER_HOST=$(((NP + SLURM_JOB_NUM_NODES - 1) / SLURM_JOB_NUM_NODES))
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
  if [ -n "$HOSTS" ]; then CMD+=(-H "$HOSTS"); fi
  if [ -n "$RSH_AGENT" ]; then CMD+=(--mca plm_rsh_agent "$RSH_AGENT" --mca btl "tcp,self,vader"); fi
  if [ -n "$IFACE" ]; then
    # One network for everything: ranks' TCP traffic and the daemons' control channel.
    CMD+=(--mca btl_tcp_if_include "$IFACE" --mca oob_tcp_if_include "$IFACE")
    if [[ ! "$IFACE" =~ / ]]; then export HOROVOD_GLOO_IFACE="$IFACE" NCCL_SOCKET_IFNAME="$IFACE"; fi
  fi
  if [ -n "$OOB_KEEPALIVE" ]; then
    read -r ka_time ka_intvl ka_probes <<<"$OOB_KEEPALIVE"
    CMD+=(--mca oob_tcp_keepalive_time "$ka_time" --mca oob_tcp_keepalive_intvl "${ka_intvl:-5}"
      --mca oob_tcp_keepalive_probes "${ka_probes:-3}")
  fi
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

# Which ranks each host gets (-map-by slot fills a host's slots in order), for the supervisor's
# "node X lost (ranks ...)" line.
RANK_MAP=""
if [ -n "$HOSTS" ]; then
  next=0
  IFS=, read -r -a host_words <<<"$HOSTS"
  for word in "${host_words[@]}"; do
    slots="${word##*:}"
    if [ "$slots" = "$word" ]; then slots=1; fi
    ranks=""
    for ((i = 0; i < slots && next < NP; i++)); do ranks+="${ranks:+,}$next"; next=$((next + 1)); done
    RANK_MAP+="${word%%:*}=$ranks;"
  done
fi

hpcdl_note "$NP ranks, $RANKS_PER_HOST per host, $THREADS threads each"
hpcdl_show_command "${CMD[@]}"
[ "$HPCDL_DRY_RUN" = 1 ] && exit 0
if [ "$ABORT_GRACE" != 0 ] && "$MPIRUN" --version 2>&1 | grep -q 'Open MPI' && command -v python3 >/dev/null 2>&1; then
  # The job must see this PATH, not the one a python3 shim (pyenv) sets up for the supervisor itself.
  HPCDL_JOB_PATH="$PATH" exec python3 "$hpcdl_root/launch/supervise.py" --grace "$ABORT_GRACE" --map "$RANK_MAP" -- "${CMD[@]}"
fi
exec "${CMD[@]}"
