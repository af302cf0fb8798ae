#!/usr/bin/env bash
# Install what the Slurm tests (tests/support/slurm_cluster.py) and the virtual-cluster tests
# (tests/cluster, python -m hpcdl.tools.vcluster) need: Debian's slurm-wlm and munge, and iproute2
# (ip, tc) and util-linux (nsenter, unshare) for the network-namespace nodes.
#
#   bash scripts/install-slurm.sh
#
# Idempotent: when slurmctld, slurmd, sbatch, srun and munged are already on PATH it only says so.
# It installs only as root on Debian/Ubuntu; anywhere else it explains and exits 0, and the
# Slurm tests then skip with that same reason. It never starts a daemon: the test fixture starts
# its own munged, slurmctld and slurmd in a temporary folder and stops them afterwards.
set -euo pipefail

NEEDED=(slurmctld slurmd sbatch srun squeue scontrol munged ip tc nsenter unshare)

say() { printf '[install-slurm] %s\n' "$1"; }
# sbatch --version needs a slurm.conf, so ask the package database instead.
versions() {
  printf 'slurm-wlm %s, munge %s' \
    "$(dpkg-query -W -f='${Version}' slurm-wlm 2>/dev/null || echo '?')" \
    "$(dpkg-query -W -f='${Version}' munge 2>/dev/null || echo '?')"
}

missing=()
for tool in "${NEEDED[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ "${#missing[@]}" -eq 0 ]; then
  say "already installed ($(versions))"
  exit 0
fi
say "missing: ${missing[*]}"

if [ ! -f /etc/debian_version ]; then
  say "not a Debian/Ubuntu system: install Slurm and munge with your package manager; the Slurm tests will skip"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  say "not root: run 'sudo bash scripts/install-slurm.sh'; the Slurm tests will skip until then"
  exit 0
fi

# Package scripts would try to start the daemons; with no init system they must not. A
# policy-rc.d that answers 101 ("action forbidden") is Debian's documented way to say so.
# Only ours is removed afterwards; an existing one is left as it was.
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$POLICY"
  chmod 755 "$POLICY"
  trap 'rm -f "$POLICY"' EXIT
fi

export DEBIAN_FRONTEND=noninteractive
say "apt-get update"
apt-get update -qq
say "apt-get install -y slurm-wlm munge iproute2 util-linux (Slurm daemons and clients, PMIx plugin; ip, tc, nsenter)"
apt-get install -y -qq --no-install-recommends slurm-wlm slurm-wlm-basic-plugins munge iproute2 util-linux >/dev/null

for tool in "${NEEDED[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || { say "still missing after install: $tool" >&2; exit 1; }
done
say "installed ($(versions))"
