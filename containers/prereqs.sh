#!/usr/bin/env bash
# Install the Debian packages `make image` needs on the BUILD machine (idempotent; root only):
# Charliecloud (ch-run: the runtime the tests use), mmdebstrap (a Debian base from Debian's archive,
# no registry), squashfs-tools + squashfuse + fuse3 (a one-file image ch-run mounts), siftool (SIF).
#   bash containers/prereqs.sh          # installs what is missing, prints one line when all are there
#   bash containers/prereqs.sh --check  # installs nothing: names what is missing, exit 1
#   bash containers/prereqs.sh --quiet  # as the first, silent when nothing is missing
set -euo pipefail
PACKAGES=(charliecloud-runtime charliecloud-builders squashfuse fuse3 mmdebstrap squashfs-tools siftool)
missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if [ "${#missing[@]}" = 0 ]; then
  [ "${1:-}" = --quiet ] || echo "[image] build tools present: ${PACKAGES[*]}"
  exit 0
fi
if [ "${1:-}" = --check ]; then
  echo "[image] missing Debian packages: ${missing[*]} (install them as root: bash containers/prereqs.sh)" >&2
  exit 1
fi
[ -f /etc/debian_version ] || { echo "[image] needs Debian 12 (or a derivative) to install ${missing[*]}; install Charliecloud 0.31+, mmdebstrap, squashfs-tools and siftool yourself" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "[image] missing ${missing[*]}: run 'sudo bash containers/prereqs.sh' once (apt-get needs root)" >&2; exit 1; }
echo "[image] installing ${missing[*]} (apt-get, about 30 s)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null || { echo "[image] apt-get update failed: no access to the Debian archive?" >&2; exit 1; }
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
  { echo "[image] apt-get install ${missing[*]} failed" >&2; exit 1; }
echo "[image] installed ${missing[*]}"
