# shellcheck shell=bash
# Sourced by scripts/test.sh so that the tests run as on a fresh machine: no test may lean on what an
# earlier run left behind (MNIST fetched once, a torch.compile or Triton cache, matplotlib's fonts).
#
#   hpcdl_fresh_caches   the user's cache folder (XDG_CACHE_HOME, where hpcdl.fetch_mnist puts MNIST),
#                        torch.compile's and Triton's caches become one new empty folder, removed when
#                        the shell exits; the caches setup itself makes are kept: HPCDL_CACHE (Horovod's
#                        wheels, the wheelhouse, the images) and pip's downloads (PIP_CACHE_DIR).
#                        Sets HPCDL_FRESH_CACHES to the new folder.

hpcdl_fresh_caches() {
  local user_cache="${XDG_CACHE_HOME:-$HOME/.cache}"
  # Pinned first: both default to a folder under XDG_CACHE_HOME, which moves below.
  export HPCDL_CACHE="${HPCDL_CACHE:-$user_cache/hpcdl}"
  export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$user_cache/pip}"
  HPCDL_FRESH_CACHES="$(mktemp -d "${TMPDIR:-/tmp}/hpcdl-test-caches.XXXXXX")"
  export HPCDL_FRESH_CACHES
  # shellcheck disable=SC2064  # the folder's name now, not at exit
  trap "rm -rf '$HPCDL_FRESH_CACHES'" EXIT
  export XDG_CACHE_HOME="$HPCDL_FRESH_CACHES/cache"
  export TORCHINDUCTOR_CACHE_DIR="$HPCDL_FRESH_CACHES/torchinductor"
  export TRITON_CACHE_DIR="$HPCDL_FRESH_CACHES/triton"
  mkdir -p "$XDG_CACHE_HOME"
}
