# shellcheck shell=bash
# The one procedure every launch script shares; source it, do not run it.
#
# It turns a few settings into the command that starts ONE rank:
#
#   [apptainer|singularity exec --nv [--bind ...] IMAGE] PYTHON -m ENTRY [ARGS...]
#   [ch-run --join --set-env --unset-env=... -b ... --cd DIR IMAGE --] PYTHON -m ENTRY [ARGS...]
#
# and it knows how to read the flags common to all launch scripts, how many OpenMP threads a
# rank gets, and how a batch job asks to be requeued when its time limit is near. The scripts
# (mpirun.sh, slurm.sbatch, frontera-rtx.sbatch) only add their launcher in front.
#
# Settings (environment variables; each also has a flag, see hpcdl_parse_common_flag):
#   HPCDL_PYTHON   interpreter for the ranks   default: the repo's .venv/bin/python, or python
#                                               inside a container, else python3
#   HPCDL_ENTRY    Python module to run         default: hpcdl.train
#   HPCDL_IMAGE    container image; empty = run on the host. A .sif file runs under Apptainer or
#                  Singularity; a directory or .sqfs (make image) under Charliecloud's ch-run
#   HPCDL_RUNTIME  apptainer, singularity or charliecloud   default: by the image's kind (a .sif:
#                  whichever of apptainer, singularity is on PATH; a directory or .sqfs: charliecloud)
#   HPCDL_BIND     extra bind mounts for the container, comma separated SRC[:DST] (e.g. /scratch,/work)
#   HPCDL_NV       1/0: pass --nv to the runtime   default: 1 when nvidia-smi exists
#   HPCDL_DRY_RUN  1 = print the command, do not run it
#   HPCDL_JOIN_CT  ranks per host for ch-run --join where the launcher does not say it (mpirun.sh sets it
#                  for MPICH-family launchers; Open MPI and Slurm set variables ch-run reads)

HPCDL_ENTRY="${HPCDL_ENTRY:-hpcdl.train}"
HPCDL_IMAGE="${HPCDL_IMAGE:-}"
HPCDL_RUNTIME="${HPCDL_RUNTIME:-}"
HPCDL_BIND="${HPCDL_BIND:-}"
HPCDL_NV="${HPCDL_NV:-}"
HPCDL_PYTHON="${HPCDL_PYTHON:-}"
HPCDL_DRY_RUN="${HPCDL_DRY_RUN:-0}"
HPCDL_SHIFT=0     # set by the flag parsers below: how many words the caller should shift
HPCDL_RANK_CMD=() # set by hpcdl_rank_command

# One-line error and a non-zero exit (2 = bad usage, like argparse).
hpcdl_die() {
  printf 'error: %s\n' "$*" >&2
  exit 2
}

hpcdl_note() {
  printf '[hpcdl] %s\n' "$*" >&2
}

hpcdl_is_count() {
  [[ "$1" =~ ^[1-9][0-9]*$ ]]
}

# Usage: hpcdl_need_value FLAG "$@" -- stops with a clear error when FLAG has no value after it.
hpcdl_need_value() {
  if [ "$#" -lt 3 ] || [ -z "$3" ]; then
    hpcdl_die "$1 needs a value (see --help)"
  fi
}

# Reads one flag shared by every launch script from "$@". Returns 0 and sets HPCDL_SHIFT
# to the number of words it used, or returns 1 when "$1" is not one of them.
# shellcheck disable=SC2034  # HPCDL_SHIFT is read by the calling script
hpcdl_parse_common_flag() {
  HPCDL_SHIFT=2
  case "$1" in
    --python) hpcdl_need_value "$1" "$@"; HPCDL_PYTHON="$2" ;;
    --entry) hpcdl_need_value "$1" "$@"; HPCDL_ENTRY="$2" ;;
    --image) hpcdl_need_value "$1" "$@"; HPCDL_IMAGE="$2" ;;
    --runtime) hpcdl_need_value "$1" "$@"; HPCDL_RUNTIME="$2" ;;
    --bind) hpcdl_need_value "$1" "$@"; HPCDL_BIND="$2" ;;
    --no-nv) HPCDL_NV=0; HPCDL_SHIFT=1 ;;
    --dry-run) HPCDL_DRY_RUN=1; HPCDL_SHIFT=1 ;;
    *) return 1 ;;
  esac
}

# Help text for the common flags, appended to each script's own --help.
hpcdl_common_help() {
  cat <<'EOF'
Options every launch script takes (each also read from the environment variable shown):
  --python PATH     interpreter for the ranks (HPCDL_PYTHON; default: <repo>/.venv/bin/python,
                    'python' inside a container)
  --entry MODULE    Python module each rank runs (HPCDL_ENTRY; default: hpcdl.train;
                    hpcdl.doctor shows the rank -> GPU mapping)
  --image IMAGE     run every rank inside this image (HPCDL_IMAGE): a .sif (Apptainer/Singularity),
                    or the directory or .sqfs that make image builds (Charliecloud's ch-run)
  --runtime NAME    apptainer, singularity or charliecloud (HPCDL_RUNTIME; default: by the
                    image's kind)
  --bind LIST       extra container bind mounts, comma separated SRC[:DST] (HPCDL_BIND)
  --no-nv           do not pass --nv to the container runtime (HPCDL_NV=0; default: --nv
                    when nvidia-smi exists)
  --dry-run         print the command and stop (HPCDL_DRY_RUN=1)
  -h, --help        this text
  --                end of launcher options; everything after it goes to the entry module
HPCDL_JOIN_CT (environment only): ranks per host for ch-run --join where the launcher does not
say it (srun and Open MPI set variables ch-run reads)
HPCDL_ROOT (environment only) is the repository; it is found by itself, set it when the
script cannot tell (a copy of the script submitted from elsewhere).
EOF
}

# What kind of image a path is: "sif" (Apptainer/Singularity), "charliecloud" (a directory, the
# form `make image` writes, or a SquashFS file that ch-run mounts). Anything else: one-line error.
hpcdl_image_kind() {
  case "$1" in
    *.sif) printf sif ;;
    *.sqfs | *.squashfs) printf charliecloud ;;
    *) if [ -d "$1" ]; then printf charliecloud; else hpcdl_die "not a container image: $1 (expected a .sif file, a .sqfs file or an image directory; build one with: make image)"; fi ;;
  esac
}

# The container runtime to use (its program on PATH): HPCDL_RUNTIME if set, else by the image's kind.
hpcdl_container_runtime() {
  local kind name candidates
  kind="$(hpcdl_image_kind "$HPCDL_IMAGE")" || exit 2
  case "$HPCDL_RUNTIME" in
    "") if [ "$kind" = sif ]; then candidates="apptainer singularity"; else candidates=ch-run; fi ;;
    apptainer | singularity) candidates="$HPCDL_RUNTIME" ;;
    charliecloud | ch-run)
      [ "$kind" = charliecloud ] || hpcdl_die "Charliecloud cannot run a SIF ($HPCDL_IMAGE): give it the image directory or .sqfs that make image writes, or use --runtime apptainer"
      candidates=ch-run ;;
    *) hpcdl_die "--runtime must be apptainer, singularity or charliecloud, got '$HPCDL_RUNTIME'" ;;
  esac
  for name in $candidates; do
    if command -v "$name" >/dev/null 2>&1; then
      printf '%s' "$name"
      return 0
    fi
  done
  if [ "$candidates" = ch-run ]; then
    hpcdl_die "no container runtime found (ch-run, Charliecloud's, is not on PATH): install charliecloud-runtime (bash containers/prereqs.sh) or module load charliecloud"
  fi
  hpcdl_die "no container runtime found (${HPCDL_RUNTIME:-apptainer or singularity}); on TACC systems: module load tacc-apptainer"
}

# Every bind source must exist on the host: one line here, not one error per rank later.
hpcdl_check_binds() {
  local item src
  local -a items
  IFS=, read -r -a items <<<"$HPCDL_BIND"
  for item in ${items[@]+"${items[@]}"}; do
    src="${item%%:*}"
    [ -z "$src" ] || [ -e "$src" ] || hpcdl_die "bind source not found: $src (in --bind $HPCDL_BIND)"
  done
}

# Host folders no bind may cover in an image: they are the image's own system.
HPCDL_IMAGE_SYSTEM_DIRS=" bin boot dev etc lib lib32 lib64 libx32 opt proc run sbin sys usr var ch "

# ch-run's words for one rank. What Charliecloud needs that Apptainer does not:
#   --join          one container (user namespace) per node for all its ranks: ranks in different
#                   namespaces cannot use the kernel's single-copy (CMA) between them, and Open MPI's
#                   shared-memory messages of about 4 MiB and more hang (docs/cluster.md);
#   --set-env       the image's environment (/ch/environment: its venv first on PATH); without it the
#                   host's environment is used as it is;
#   --unset-env     what must not leak in from the host: a venv's VIRTUAL_ENV, PYTHONPATH, PIP_*, ...;
#   -b              binds: ch-run binds only /tmp (and /dev, /proc, /sys) by itself, and a bind's
#                   destination must already exist in a read-only image: the working directory's
#                   top folder is bound (make image makes /work, /scratch1, /home1, ..., the building
#                   checkout's and $HOME's top folders, and HPCDL_MOUNT_POINTS');
#   --cd            the working directory (Apptainer keeps it by itself);
#   --home          the host's $HOME at /home/$USER (Apptainer binds $HOME by itself);
#   $USER           ch-run refuses to start without it.
# Apptainer binds $HOME, /tmp and $PWD by itself, applies the image's %environment, needs --nv for
# GPUs and no --join (its ranks share the host's user namespace).
hpcdl_chrun_words() {
  local cwd top item src dst
  local -a items
  export USER="${USER:-$(id -un)}"
  HPCDL_RANK_CMD+=(ch-run)
  # One ch-run per rank: they join one container per node. With a launcher inside the image
  # (frontera-rtx.sbatch --launcher image-mpirun, argument 1 > 0) there is one ch-run: nothing to join.
  if [ "${1:-0}" = 0 ]; then
    HPCDL_RANK_CMD+=(--join)
    # ch-run counts its peers from Open MPI's or Slurm's variables; other launchers say it here.
    if [ -n "${HPCDL_JOIN_CT:-}" ]; then HPCDL_RANK_CMD+=(--join-ct "$HPCDL_JOIN_CT"); fi
    # Under srun every task sees the same SLURM_STEP_ID, whichever job: name the group by the job.
    if [ -n "${SLURM_JOB_ID:-}" ]; then HPCDL_RANK_CMD+=(--join-tag "hpcdl-$SLURM_JOB_ID-$$"); fi
  fi
  # --home: the host's $HOME at /home/$USER, as Apptainer binds it (caches such as matplotlib's write there).
  HPCDL_RANK_CMD+=(--set-env --home)
  for item in VIRTUAL_ENV PYTHONPATH PYTHONHOME PYTHONSTARTUP PYTHONUSERBASE 'PIP_*' 'CONDA_*' LD_LIBRARY_PATH LD_PRELOAD; do
    HPCDL_RANK_CMD+=("--unset-env=$item")
  done
  cwd="$(pwd -P)"
  case "$cwd" in
    /tmp | /tmp/*) ;; # ch-run shares the host's /tmp by itself
    /) hpcdl_die "run from a working directory, not / (ch-run binds the working directory's top folder)" ;;
    *)
      top="${cwd#/}"
      top="/${top%%/*}"
      case "$HPCDL_IMAGE_SYSTEM_DIRS" in
        *" ${top#/} "*) hpcdl_die "cannot run in $cwd with Charliecloud: $top is the image's own; run from a folder under /tmp or a file system such as /work or /scratch" ;;
      esac
      if [ -d "$HPCDL_IMAGE" ] && [ ! -d "$HPCDL_IMAGE$top" ]; then
        hpcdl_die "the image $HPCDL_IMAGE has no $top to bind the working directory $cwd onto (Charliecloud binds only onto existing folders); run from under /tmp or a folder the image has, or rebuild it with HPCDL_MOUNT_POINTS=$top make image"
      fi
      HPCDL_RANK_CMD+=(-b "$top:$top") ;;
  esac
  IFS=, read -r -a items <<<"$HPCDL_BIND"
  for item in ${items[@]+"${items[@]}"}; do
    [ -n "$item" ] || continue
    src="${item%%:*}"
    dst="${item#*:}"
    [ "$dst" != "$item" ] || dst="$src"
    dst="${dst%%:*}" # an Apptainer-style ":ro" suffix is not ch-run's
    if [ -d "$HPCDL_IMAGE" ] && [ ! -e "$HPCDL_IMAGE$dst" ]; then
      hpcdl_die "bind destination $dst does not exist in the image $HPCDL_IMAGE (ch-run cannot create it in a read-only image): bind to a folder the image has, e.g. $src:/mnt/0"
    fi
    HPCDL_RANK_CMD+=(-b "$src:$dst")
  done
  HPCDL_RANK_CMD+=(--cd "$cwd" "$HPCDL_IMAGE" --)
}

# Fills the array HPCDL_RANK_CMD with the words that start one rank (see the top of this file).
# Words after REPO_ROOT go between the container and python: a launcher that runs inside the
# image (frontera-rtx.sbatch --launcher image-mpirun).
# Usage: hpcdl_rank_command REPO_ROOT [INNER_LAUNCHER_WORDS...]
hpcdl_rank_command() {
  local root="$1" runtime python="$HPCDL_PYTHON"
  shift
  HPCDL_RANK_CMD=()
  if [ -n "$HPCDL_IMAGE" ]; then
    [ -e "$HPCDL_IMAGE" ] || hpcdl_die "container image not found: $HPCDL_IMAGE (build it with: apptainer build hpcdl.sif Singularity.def, or make image)"
    runtime="$(hpcdl_container_runtime)" || exit 2
    hpcdl_check_binds
    if [ "$runtime" = ch-run ]; then
      hpcdl_chrun_words "$#"
      HPCDL_RANK_CMD+=("$@" "${python:-python}" -m "$HPCDL_ENTRY")
      return 0
    fi
    HPCDL_RANK_CMD+=("$runtime" exec)
    if [ "${HPCDL_NV:-}" = 1 ] || { [ -z "${HPCDL_NV:-}" ] && command -v nvidia-smi >/dev/null 2>&1; }; then
      HPCDL_RANK_CMD+=(--nv)
    fi
    if [ -n "$HPCDL_BIND" ]; then
      HPCDL_RANK_CMD+=(--bind "$HPCDL_BIND")
    fi
    HPCDL_RANK_CMD+=("$HPCDL_IMAGE")
    # Inside the image, its own environment (%environment) puts the right python first on PATH.
    python="${python:-python}"
  else
    if [ -z "$python" ]; then
      if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python="python3"; fi
    fi
    command -v "$python" >/dev/null 2>&1 || hpcdl_die "python not found: $python (run: bash scripts/setup.sh, or pass --python)"
  fi
  HPCDL_RANK_CMD+=("$@" "$python" -m "$HPCDL_ENTRY")
}

# The MPI family inside an hpcdl image (openmpi, mpich), from the labels containers/install.sh
# writes; empty when unknown (a SIF, or an image not built by hpcdl).
hpcdl_image_mpi_family() {
  local labels=""
  if [ -d "$1" ]; then
    labels="$(cat "$1/opt/hpcdl/labels" 2>/dev/null || true)"
  elif [[ "$1" == *.sqfs || "$1" == *.squashfs ]] && command -v unsquashfs >/dev/null 2>&1; then
    labels="$(unsquashfs -cat "$1" opt/hpcdl/labels 2>/dev/null || true)"
  fi
  printf '%s\n' "$labels" | sed -n 's/^hpcdl\.mpi\.family //p' | head -n 1
}

# A host launcher of the other MPI family starts N processes that each see a world of 1 and train
# alone: refuse it here, in one line, before anything starts.
# Usage: hpcdl_check_image_mpi LAUNCHER_FAMILY (openmpi or mpich) DESCRIPTION
hpcdl_check_image_mpi() {
  local inside
  [ -n "$HPCDL_IMAGE" ] || return 0
  inside="$(hpcdl_image_mpi_family "$HPCDL_IMAGE")"
  if [ -n "$inside" ] && [ "$inside" != "$1" ]; then
    hpcdl_die "the image's MPI is $inside but the launcher is $2 ($1 family): every rank would start alone as rank 0 of 1; use an $inside launcher (docs/cluster.md, the MPI-compatibility rule) or the image built for $1"
  fi
}

# OpenMP/intra-op threads for one rank: the cores of a host shared by the ranks on it.
# Usage: hpcdl_threads_per_rank CORES RANKS_ON_THE_HOST
hpcdl_threads_per_rank() {
  local cores="$1" ranks="$2" threads
  hpcdl_is_count "$cores" || cores=1
  hpcdl_is_count "$ranks" || ranks=1
  threads=$((cores / ranks))
  [ "$threads" -ge 1 ] || threads=1
  printf '%s' "$threads"
}

# Prints a command to stderr, shell-quoted so that it can be pasted into a terminal; logs of
# batch jobs then show exactly what ran.
# Usage: hpcdl_show_command WORDS...
hpcdl_show_command() {
  local quoted
  quoted="$(printf '%q ' "$@")"
  printf '[hpcdl] %s\n' "${quoted% }" >&2
}

# ---------------------------------------------------------------- batch jobs
# Settings only the batch scripts use (flags in hpcdl_parse_batch_flag).
HPCDL_OUTPUT_DIR="${HPCDL_OUTPUT_DIR:-runs/${SLURM_JOB_NAME:-hpcdl}-${SLURM_JOB_ID:-local}}"
HPCDL_RESUME="${HPCDL_RESUME:-1}"
HPCDL_REQUEUE="${HPCDL_REQUEUE:-1}"
HPCDL_ENTRY_ARGS=() # set by hpcdl_entry_args

# Like hpcdl_parse_common_flag, for the flags of the batch scripts.
# shellcheck disable=SC2034  # HPCDL_SHIFT is read by the calling script
hpcdl_parse_batch_flag() {
  HPCDL_SHIFT=2
  case "$1" in
    --output-dir) hpcdl_need_value "$1" "$@"; HPCDL_OUTPUT_DIR="$2" ;;
    --no-resume) HPCDL_RESUME=0; HPCDL_SHIFT=1 ;;
    --no-requeue) HPCDL_REQUEUE=0; HPCDL_SHIFT=1 ;;
    *) return 1 ;;
  esac
}

hpcdl_batch_help() {
  cat <<'EOF'
  --output-dir DIR   where hpcdl.train writes checkpoints and summary.json
                     (HPCDL_OUTPUT_DIR; default: runs/<job name>-<job id>, kept across requeues)
  --no-resume        start a new run: no --resume for hpcdl.train, which then refuses an output
                     folder holding an earlier run's checkpoints (HPCDL_RESUME=0). A requeued
                     start of the job (SLURM_RESTART_COUNT > 0) resumes its own run all the same
  --no-requeue       do not requeue when the time limit is near (HPCDL_REQUEUE=0)
EOF
}

# "on" or "off", for the job summary line.
hpcdl_requeue_state() {
  if [ "$HPCDL_REQUEUE" = 1 ]; then printf on; else printf off; fi
}

# Stops with a clear message when a batch script is run outside a Slurm job (dry runs excepted).
# Usage: hpcdl_require_job HOW_TO_SUBMIT
hpcdl_require_job() {
  if [ -z "${SLURM_JOB_ID:-}" ] && [ "$HPCDL_DRY_RUN" != 1 ]; then
    hpcdl_die "not inside a Slurm job: $1 (or add --dry-run to see the command)"
  fi
}

# Fills HPCDL_ENTRY_ARGS with what a batch job adds for hpcdl.train: the output folder and
# --resume, so that a requeued job continues from its checkpoint. They come before the user's
# own arguments, so the same flag given by the user wins. --no-resume is about the job's first
# start (a new run, not an earlier one's folder); a requeued start is the same job, whose own
# checkpoints are the ones in the folder, so it resumes whatever the first start was told.
hpcdl_entry_args() {
  HPCDL_ENTRY_ARGS=()
  if [ "$HPCDL_ENTRY" = hpcdl.train ]; then
    HPCDL_ENTRY_ARGS+=(--output-dir "$HPCDL_OUTPUT_DIR")
    if [ "$HPCDL_RESUME" = 1 ] || [ "${SLURM_RESTART_COUNT:-0}" != 0 ]; then HPCDL_ENTRY_ARGS+=(--resume); fi
  fi
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
# requeues the job when the time-limit signal interrupted it. Returns the step's exit status.
# Usage: hpcdl_run_step WORDS...
hpcdl_run_step() {
  local pid rc
  hpcdl_show_command "$@"
  [ "$HPCDL_DRY_RUN" = 1 ] && return 0
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
  if [ "$HPCDL_TIME_LIMIT_NEAR" = 1 ] && [ "$HPCDL_REQUEUE" = 1 ]; then
    hpcdl_note "step ended (exit $rc) after the time-limit signal: requeueing job ${SLURM_JOB_ID:-?}; it resumes from its checkpoint"
    scontrol requeue "${SLURM_JOB_ID:?}"
  fi
  return "$rc"
}
