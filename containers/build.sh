#!/usr/bin/env bash
# `make image`: build hpcdl's CPU image on this machine, with no registry and no PyPI:
#
#   Debian 12 base (mmdebstrap, from Debian's archive)
#   -> containers/install.sh inside it (scripts/setup.sh offline from the wheelhouse: the same
#      procedure as Singularity.def and a bare machine)            = the environment, cached by a key
#   -> the repository's hpcdl/kfac/launch source on top            = the image, cached by the source
#
#   bash containers/build.sh [--mpi openmpi|mpich] [--sqfs] [--sif] [--link PATH]
#
# The environment's key is a hash of everything that changes it (the recipe files, setup.sh,
# versions.env, pyproject.toml, the wheelhouse's file list, the Debian packages); a second build with
# the same inputs takes seconds. Horovod and mpi4py wheels from the host's wheel cache
# ($HPCDL_CACHE/wheels) are used inside only when setup.sh's own key for them matches there (same
# MPI, Python ABI, torch, compiler, flags); otherwise they are built inside and cached.
# Prints the image's path as its last line; --link PATH (default images/hpcdl-cpu, or
# images/hpcdl-mpich) points a symlink at it. --sqfs also writes IMAGE.sqfs (one file, ch-run mounts it),
# --sif also writes IMAGE.sif (siftool; Apptainer has not run it here).
# Settings: HPCDL_WHEELHOUSE (default $HPCDL_CACHE/wheelhouse, made by make wheelhouse),
# HPCDL_CACHE (default ~/.cache/hpcdl), HPCDL_IMAGES (default $HPCDL_CACHE/images),
# HPCDL_DEBIAN_MIRROR (default http://deb.debian.org/debian), CUDA_HOME (default /usr/local/cuda),
# HPCDL_MOUNT_POINTS (extra paths whose top folders the image gets as mount points, comma-separated).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${HPCDL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpcdl}"
IMAGES="${HPCDL_IMAGES:-$CACHE/images}"
WHEELHOUSE="${HPCDL_WHEELHOUSE:-$CACHE/wheelhouse}"
MIRROR="${HPCDL_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
CUDA="${CUDA_HOME:-/usr/local/cuda}"
MPI=openmpi
SQFS=0
SIF=0
LINK=""
T0=$SECONDS

die() { printf '[image] error: %s\n' "$*" >&2; exit 1; }
say() { printf '[image] %4ss %s\n' "$((SECONDS - T0))" "$*" >&2; }

while [ "$#" -gt 0 ]; do
  case "$1" in
    --mpi) MPI="${2:-}"; shift 2 || die "--mpi needs openmpi or mpich" ;;
    --sqfs) SQFS=1; shift ;;
    --sif) SQFS=1; SIF=1; shift ;;
    --link) LINK="${2:-}"; shift 2 || die "--link needs a path" ;;
    -h | --help) sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
case "$MPI" in openmpi) VARIANT=cpu ;; mpich) VARIANT=mpich ;; *) die "--mpi must be openmpi or mpich (got '$MPI')" ;; esac
LINK="${LINK:-$ROOT/images/hpcdl-$VARIANT}"
# Mount points: ch-run binds only onto folders that exist in a read-only image, and launch/common.sh
# binds the working directory's top folder. The usual HPC file systems' names (TACC's numbered ones
# included), this repository's and $HOME's top folders, and HPCDL_MOUNT_POINTS (comma-separated) are made.
MOUNT_POINTS=(work work1 work2 scratch scratch1 scratch2 scratch3 home home1 data gpfs lustre project projects corral corral-repl fs global)
IFS=, read -r -a extra <<<"${HPCDL_MOUNT_POINTS:-}"
for path in "$ROOT" "$HOME" ${extra[@]+"${extra[@]}"}; do
  [[ "$path" == /?* ]] || die "HPCDL_MOUNT_POINTS holds absolute paths, comma-separated (got '$path')"
  top="${path#/}"
  top="${top%%/*}"
  case " bin boot dev etc lib lib32 lib64 libx32 opt proc run sbin sys usr var ch tmp root mnt " in
    *" $top "*) ;; # the image's own folders: launch/common.sh refuses to bind over them
    *) MOUNT_POINTS+=("$top") ;;
  esac
done
mapfile -t MOUNT_POINTS < <(printf '%s\n' "${MOUNT_POINTS[@]}" | LC_ALL=C sort -u)

# ---------------------------------------------------------------- prerequisites, each one line
[ "$(id -u)" = 0 ] || die "building the image needs root (mmdebstrap writes a Debian root, ch-run -w installs into it); run make image as root, or use a prebuilt image"
bash "$ROOT/containers/prereqs.sh" --quiet >&2 || exit 1
export USER="${USER:-root}" # ch-run refuses to start without it
if [ ! -f "$WHEELHOUSE/hpcdl-wheelhouse.txt" ]; then
  die "no wheelhouse at $WHEELHOUSE (PyPI is not reachable inside the image): make wheelhouse DIR=$WHEELHOUSE first (about 2.6 GB, once), or set HPCDL_WHEELHOUSE"
fi
# shellcheck source=scripts/versions.env
source "$ROOT/scripts/versions.env"
compgen -G "$WHEELHOUSE/torch-$TORCH_VERSION-*.whl" >/dev/null ||
  die "the wheelhouse $WHEELHOUSE has no torch $TORCH_VERSION wheel: make wheelhouse DIR=$WHEELHOUSE"
# PyPI's torch is a CUDA build; Horovod builds against it only with a CUDA toolkit (the image needs
# none to run: torch brings its CUDA libraries). The toolkit is bound read-only during the build.
[ -d "$CUDA/include" ] || die "no CUDA toolkit at $CUDA (Horovod's build against PyPI's CUDA torch needs one, at build time only): install it or set CUDA_HOME"

# ---------------------------------------------------------------- keys
PACKAGES="$(bash "$ROOT/containers/install.sh" --mpi "$MPI" --packages)"
RECIPE=(containers/build.sh containers/install.sh scripts/setup.sh scripts/horovod_build.py scripts/versions.env scripts/pins.py pyproject.toml)
env_key() { # SOURCE_DIR: the hash of what the environment is built from
  (
    cd "$1"
    {
      printf '%s\n' "$SUITE $MIRROR $MPI $PACKAGES"
      sha256sum "${RECIPE[@]}"
      (cd "$WHEELHOUSE" && find . -maxdepth 1 -type f -printf '%f %s\n' | LC_ALL=C sort)
    } | sha256sum | cut -c1-12
  )
}
ENV_KEY="$(env_key "$ROOT")"
# The source on top: what `pip install -e` of setup.sh points at.
SOURCES=(pyproject.toml README.md hpcdl kfac launch scripts containers)
SRC_KEY="$(
  cd "$ROOT"
  find "${SOURCES[@]}" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-8
)"
SRC_KEY="$(printf '%s %s\n' "$SRC_KEY" "${MOUNT_POINTS[*]}" | sha256sum | cut -c1-8)"
ENV_DIR="$IMAGES/env-$VARIANT-$ENV_KEY"
IMAGE="$IMAGES/hpcdl-$VARIANT-$ENV_KEY-$SRC_KEY"
mkdir -p "$IMAGES"
say "hpcdl-$VARIANT image: environment $ENV_KEY, source $SRC_KEY ($IMAGES)"

# Each build works in its own scratch folder (concurrent builds never share one) and renames the
# result into place at the end; the scratch is removed on any exit.
SCRATCH=""
cleanup() { if [ -n "$SCRATCH" ] && [ -e "$SCRATCH" ]; then rm -rf --one-file-system "$SCRATCH"; fi; }
trap cleanup EXIT
trap 'exit 143' TERM INT HUP # so that the EXIT trap removes the scratch on a kill too

copy_source() { # DEST: the repository's files, as Singularity.def's %files copies them
  mkdir -p "$1"
  (cd "$ROOT" && tar --exclude=__pycache__ --exclude='*.pyc' -cf - "${SOURCES[@]}") | tar -C "$1" -xf -
}

# ---------------------------------------------------------------- 1. the environment
if [ -f "$ENV_DIR/opt/hpcdl/labels" ]; then
  say "environment cached: $ENV_DIR"
else
  # The Debian base alone is cached too (by suite, mirror and packages): a changed recipe reinstalls
  # on a copy of it without downloading Debian again.
  BASE_KEY="$(printf '%s\n' "$SUITE $MIRROR $PACKAGES" | sha256sum | cut -c1-12)"
  BASE_DIR="$IMAGES/base-$VARIANT-$BASE_KEY"
  if [ ! -f "$BASE_DIR/etc/debian_version" ]; then
    SCRATCH="$IMAGES/.build-base-$VARIANT-$BASE_KEY-$$"
    say "1/3 Debian $SUITE base with $PACKAGES (mmdebstrap, 1-3 min)"
    # shellcheck disable=SC2086 # the package list, split on purpose
    mmdebstrap --quiet --variant=minbase --include="$(echo $PACKAGES | tr ' ' ',')" \
      --aptopt='Acquire::Retries "3"' "$SUITE" "$SCRATCH" "$MIRROR" >&2 ||
      die "mmdebstrap could not make the Debian base (no access to $MIRROR?)"
    mv -T "$SCRATCH" "$BASE_DIR" 2>/dev/null || [ -f "$BASE_DIR/etc/debian_version" ] || die "could not move the base into $BASE_DIR"
  else
    say "1/3 Debian base cached: $BASE_DIR"
  fi
  SCRATCH="$IMAGES/.build-env-$VARIANT-$ENV_KEY-$$"
  cp -a "$BASE_DIR" "$SCRATCH"
  copy_source "$SCRATCH/opt/hpcdl/src"
  mkdir -p "$SCRATCH/opt/hpcdl/wheelhouse" "$SCRATCH/opt/hpcdl/cache/wheels" "$SCRATCH$CUDA" "$CACHE/wheels"
  say "2/3 containers/install.sh inside (setup.sh offline from $WHEELHOUSE; Horovod/mpi4py wheels from $CACHE/wheels when their key matches)"
  # A clean environment inside: nothing of the host's (PIP_*, PYTHONPATH, a venv) reaches the build.
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin USER=root HOME=/root \
    ch-run -w --no-passwd -b "$WHEELHOUSE:/opt/hpcdl/wheelhouse" -b "$CACHE/wheels:/opt/hpcdl/cache/wheels" \
    -b "$CUDA:$CUDA" -c / "$SCRATCH" -- \
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 TERM=dumb \
    HPCDL_WHEELHOUSE=/opt/hpcdl/wheelhouse HPCDL_CACHE=/opt/hpcdl/cache HPCDL_KEEP_CACHE=1 \
    bash /opt/hpcdl/src/containers/install.sh --mpi "$MPI" >&2 ||
    die "the install step failed inside the image (output above); the half-built root is removed"
  # Named by what was really built (a file edited during the build changes the key).
  BUILT_KEY="$(env_key "$SCRATCH/opt/hpcdl/src")"
  if [ "$BUILT_KEY" != "$ENV_KEY" ]; then
    say "the recipe changed during the build: environment $BUILT_KEY, not $ENV_KEY; run make image again for the new one"
    ENV_KEY="$BUILT_KEY" ENV_DIR="$IMAGES/env-$VARIANT-$BUILT_KEY" IMAGE="$IMAGES/hpcdl-$VARIANT-$BUILT_KEY-$SRC_KEY"
  fi
  rmdir "$SCRATCH/opt/hpcdl/wheelhouse" "$SCRATCH/opt/hpcdl/cache/wheels" "$SCRATCH/opt/hpcdl/cache" 2>/dev/null || true
  mkdir -p "$SCRATCH"/mnt/{0,1,2,3,4,5,6,7,8,9} # --bind SRC:/mnt/N for anything else
  # ch-run's --set-env reads /ch/environment; Apptainer reads /.singularity.d (for the SIF).
  mkdir -p "$SCRATCH/ch" "$SCRATCH/.singularity.d/env" "$SCRATCH/.singularity.d/actions"
  cat >"$SCRATCH/ch/environment" <<ENV
PATH=/opt/hpcdl/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
HPCDL_VENV=/opt/hpcdl/venv
HPCDL_IN_CONTAINER=1
HPCDL_IMAGE_KIND=hpcdl-$VARIANT
PYTHONUNBUFFERED=1
LC_ALL=C.UTF-8
PYTHONSAFEPATH=1
ENV
  sed 's/^/export /' "$SCRATCH/ch/environment" >"$SCRATCH/.singularity.d/env/90-environment.sh"
  printf '#!/bin/sh\nexec python -m hpcdl.train "$@"\n' >"$SCRATCH/.singularity.d/runscript"
  # shellcheck disable=SC2016 # written for the image's shell to expand
  printf '#!/bin/sh\nfor f in /.singularity.d/env/*.sh; do . "$f"; done\nexec "$@"\n' >"$SCRATCH/.singularity.d/actions/exec"
  # shellcheck disable=SC2016
  printf '#!/bin/sh\nfor f in /.singularity.d/env/*.sh; do . "$f"; done\nexec /.singularity.d/runscript "$@"\n' >"$SCRATCH/.singularity.d/actions/run"
  chmod 755 "$SCRATCH/.singularity.d/runscript" "$SCRATCH/.singularity.d/actions/"*
  ln -sfn .singularity.d/runscript "$SCRATCH/singularity"
  mv -T "$SCRATCH" "$ENV_DIR" 2>/dev/null || { [ -f "$ENV_DIR/opt/hpcdl/labels" ] || die "could not move the environment into $ENV_DIR"; }
  SCRATCH=""
  say "environment built: $ENV_DIR ($(du -sh "$ENV_DIR" | cut -f1))"
fi

# ---------------------------------------------------------------- 2. the source on top
if [ -f "$IMAGE/opt/hpcdl/image" ]; then
  say "image cached: $IMAGE"
else
  SCRATCH="$IMAGES/.build-$VARIANT-$ENV_KEY-$SRC_KEY-$$"
  say "3/3 the repository's source into the image (hard links to the environment: seconds)"
  cp -al "$ENV_DIR" "$SCRATCH"
  rm -rf "$SCRATCH/opt/hpcdl/src" # new files, never the environment's hard-linked ones
  copy_source "$SCRATCH/opt/hpcdl/src"
  for top in "${MOUNT_POINTS[@]}"; do mkdir -p "$SCRATCH/$top"; done
  # Compiled once here: at run time the image is read-only.
  chroot "$SCRATCH" /opt/hpcdl/venv/bin/python -m compileall -q /opt/hpcdl/src/hpcdl /opt/hpcdl/src/kfac >/dev/null
  printf 'hpcdl-%s environment=%s source=%s built=%s\n' "$VARIANT" "$ENV_KEY" "$SRC_KEY" "$(date -u +%FT%TZ)" >"$SCRATCH/opt/hpcdl/image"
  mv -T "$SCRATCH" "$IMAGE" 2>/dev/null || { [ -f "$IMAGE/opt/hpcdl/image" ] || die "could not move the image into $IMAGE"; }
  SCRATCH=""
fi
touch -c "$IMAGE" # the newest used is kept longest

# ---------------------------------------------------------------- one-file forms
if [ "$SQFS" = 1 ] && [ ! -f "$IMAGE.sqfs" ]; then
  say "SquashFS: $IMAGE.sqfs (zstd)"
  SCRATCH="$IMAGE.sqfs.$$"
  mksquashfs "$IMAGE" "$SCRATCH" -noappend -all-root -comp zstd -quiet -no-progress >&2
  mv "$SCRATCH" "$IMAGE.sqfs"
  SCRATCH=""
fi
if [ "$SIF" = 1 ] && [ ! -f "$IMAGE.sif" ]; then
  say "SIF: $IMAGE.sif (siftool: the definition and the squashfs as amd64 system partition)"
  SCRATCH="$IMAGE.sif.$$"
  siftool new "$SCRATCH"
  siftool add --datatype 1 --groupid 1 "$SCRATCH" "$ROOT/containers/hpcdl-cpu.def"
  siftool add --datatype 4 --parttype 2 --partfs 1 --partarch 2 --groupid 1 "$SCRATCH" "$IMAGE.sqfs"
  mv "$SCRATCH" "$IMAGE.sif"
  SCRATCH=""
fi

# ---------------------------------------------------------------- keep the cache small
# The 3 newest images of this variant stay (they share the environment's files); older ones and
# environments no kept image uses go.
mapfile -t old < <(find "$IMAGES" -maxdepth 1 -type d -name "hpcdl-$VARIANT-*" -printf '%T@ %p\n' | sort -rn | tail -n +4 | cut -d' ' -f2-)
for dir in "${old[@]}"; do rm -rf --one-file-system "$dir" "$dir.sqfs" "$dir.sif"; done
for env_dir in "$IMAGES/env-$VARIANT-"*; do
  [ -d "$env_dir" ] || continue
  key="${env_dir##*-}"
  compgen -G "$IMAGES/hpcdl-$VARIANT-$key-*" >/dev/null || rm -rf --one-file-system "$env_dir"
done

mkdir -p "$(dirname "$LINK")"
ln -sfn "$IMAGE" "$LINK"
say "ready ($(du -sh "$ENV_DIR" | cut -f1)); $LINK -> $IMAGE"
for form in sqfs sif; do [ -f "$IMAGE.$form" ] && say "also $IMAGE.$form ($(du -h "$IMAGE.$form" | cut -f1))"; done
echo "$IMAGE"
