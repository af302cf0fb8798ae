#!/usr/bin/env bash
# Start hpcdl with mpirun on this machine or on the hosts of a hostfile.
# Run with --help for the options and the rule for which words are the launcher's; the others go
# to python -m hpcdl.train (or --entry's module).
set -euo pipefail

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

# ---------------------------------------------------------------- the arguments
# A real parser reads them (hpcdl/runtime/launch_args.py: which words are whose, host lists, slots,
# every value checked) and prints the decided settings as shell assignments: NP, HOSTS, HOSTFILE,
# IFACE, RSH_AGENT, THREADS, ..., ENTRY_ARGS (the words for the entry module). Standard library
# only, so any python3 runs it; one "error: ..." line and exit 2 on a bad value.
launch_python=python3
if [ -x "$hpcdl_root/.venv/bin/python" ]; then launch_python="$hpcdl_root/.venv/bin/python"; fi
command -v "$launch_python" >/dev/null 2>&1 || hpcdl_die "python3 not found: launch/mpirun.sh needs it to read its arguments"
decided="$(LAUNCH_CALLER_PATH="$PATH" "$launch_python" "$hpcdl_root/hpcdl/runtime/launch_args.py" mpirun "$hpcdl_root" "$@")" || exit "$?"
# Declared here so that shellcheck knows them; the eval sets every one.
NP="" HOSTS="" HOSTFILE="" IFACE="" VCLUSTER="" VCLUSTER_STATE="" RSH_AGENT="" ABORT_GRACE="" THREADS=""
RANKS_PER_HOST="" OVERSUBSCRIBE="" MPIRUN="" OPEN_MPI="" RANK_MAP=""
MPI_WORDS=() EXPORT_NAMES=() OOB_KEEPALIVE=() ENTRY_ARGS=()
eval "$decided"
set -- ${ENTRY_ARGS[@]+"${ENTRY_ARGS[@]}"}
export OMP_NUM_THREADS="$THREADS"
export PYTHONUNBUFFERED=1
if [ -n "$VCLUSTER" ]; then
  # launch/vcluster-rsh looks hosts up in this cluster only.
  export HPCDL_VCLUSTER="$VCLUSTER" HPCDL_VCLUSTER_STATE="$VCLUSTER_STATE"
fi

# ---------------------------------------------------------------- the mpirun command
# ch-run --join learns the ranks per host from Open MPI's variables; MPICH's Hydra sets none it reads.
if [ "$OPEN_MPI" != 1 ] && [[ "$RANKS_PER_HOST" =~ ^[0-9]+$ ]]; then HPCDL_JOIN_CT="$RANKS_PER_HOST"; fi
hpcdl_rank_command "$hpcdl_root"
if [ -n "$HPCDL_IMAGE" ]; then
  # The image's MPI must be this launcher's family; the doctor inside names the launcher's version.
  if [ "$OPEN_MPI" = 1 ]; then hpcdl_check_image_mpi openmpi "$MPIRUN"; else hpcdl_check_image_mpi mpich "$MPIRUN"; fi
  HPCDL_HOST_MPI="$("$MPIRUN" --version 2>/dev/null | grep -v -e '^\[' -e '^ *$' | head -n 1 || true)"
  export HPCDL_HOST_MPI
fi
CMD=("$MPIRUN")
if [ "$OPEN_MPI" = 1 ]; then
  # PMIx's shared-memory store (gds ds21) takes a lock that two jobs starting at the same moment on one
  # machine can fail in ("PMIX ERROR ... gds_ds21_lock_pthread.c"); its hash store takes none.
  export PMIX_MCA_gds="${PMIX_MCA_gds:-hash}"
  CMD+=(-np "$NP" -bind-to none -map-by slot)
  if [ -n "$HOSTFILE" ]; then CMD+=(--hostfile "$HOSTFILE"); fi
  if [ -n "$HOSTS" ]; then CMD+=(-H "$HOSTS"); fi
  if [ -n "$RSH_AGENT" ]; then CMD+=(--mca plm_rsh_agent "$RSH_AGENT" --mca btl "tcp,self,vader"); fi
  if [ -n "$IFACE" ]; then
    # One network for everything: ranks' TCP traffic and the daemons' control channel.
    CMD+=(--mca btl_tcp_if_include "$IFACE" --mca oob_tcp_if_include "$IFACE")
    if [[ ! "$IFACE" =~ / ]]; then export HOROVOD_GLOO_IFACE="$IFACE" NCCL_SOCKET_IFNAME="$IFACE"; fi
  fi
  if [ "${#OOB_KEEPALIVE[@]}" = 3 ]; then
    CMD+=(--mca oob_tcp_keepalive_time "${OOB_KEEPALIVE[0]}" --mca oob_tcp_keepalive_intvl "${OOB_KEEPALIVE[1]}"
      --mca oob_tcp_keepalive_probes "${OOB_KEEPALIVE[2]}")
  fi
  if [ "$OVERSUBSCRIBE" = 1 ]; then CMD+=(--oversubscribe); fi
  if [ "$(id -u)" = 0 ]; then CMD+=(--allow-run-as-root); fi
  # Local ranks inherit the whole environment; -x also sends these to the other hosts.
  names=(OMP_NUM_THREADS PYTHONUNBUFFERED PATH LD_LIBRARY_PATH PYTHONPATH PMIX_MCA_gds)
  while IFS= read -r name; do names+=("$name"); done < <(compgen -e | grep -E '^(NCCL|HOROVOD|HPCDL|UCX)_' || true)
  # (the ${a[@]+...} form keeps bash 4.2, still on some clusters, quiet about empty arrays)
  for name in "${names[@]}" ${EXPORT_NAMES[@]+"${EXPORT_NAMES[@]}"}; do
    if [ -n "${!name+set}" ]; then CMD+=(-x "$name"); fi
  done
else
  # MPICH-family launchers (MPICH, Intel MPI, MVAPICH2) pass the whole environment by default.
  CMD+=(-n "$NP")
  if [ -n "$HOSTFILE" ]; then CMD+=(-f "$HOSTFILE"); fi
  if [ -n "$HOSTS" ]; then CMD+=(-hosts "$HOSTS"); fi
  CMD+=(-genv OMP_NUM_THREADS "$THREADS")
fi
CMD+=(${MPI_WORDS[@]+"${MPI_WORDS[@]}"})
CMD+=("${HPCDL_RANK_CMD[@]}" "$@")

hpcdl_note "$NP ranks, $RANKS_PER_HOST per host, $THREADS threads each"
hpcdl_show_command "${CMD[@]}"
[ "$HPCDL_DRY_RUN" = 1 ] && exit 0
if [ "$ABORT_GRACE" != 0 ] && [ "$OPEN_MPI" = 1 ] && command -v python3 >/dev/null 2>&1; then
  # RANK_MAP: which ranks each host gets, for the supervisor's "node X lost (ranks ...)" line.
  # The job must see this PATH, not the one a python3 shim (pyenv) sets up for the supervisor itself.
  HPCDL_JOB_PATH="$PATH" exec python3 "$hpcdl_root/launch/supervise.py" --grace "$ABORT_GRACE" --map "$RANK_MAP" -- "${CMD[@]}"
fi
exec "${CMD[@]}"
