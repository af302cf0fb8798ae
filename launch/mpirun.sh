#!/usr/bin/env bash
# Start hpcdl with mpirun on this machine or on the hosts of a hostfile.
# Run with --help for the options and the rule for which words are the launcher's; the others go
# to python -m hpcdl.train (or --entry's module). hpcdl.launch decides everything (launch/common.sh).
set -euo pipefail

# The repository: HPCDL_ROOT, this file's, that of the file sbatch was given (under sbatch this file runs
# from a copy in Slurm's spool folder), or the submit folder. launch/common.sh does the rest.
for hpcdl_root in "${HPCDL_ROOT:-}" "$(dirname -- "${BASH_SOURCE[0]}")/.." "$(scontrol show job "${SLURM_JOB_ID:-none}" 2>/dev/null | sed -n 's|^ *Command=\([^ ]*/\)[^/ ]*\( .*\)*$|\1..|p')" "${SLURM_SUBMIT_DIR:-}"; do if [ -f "$hpcdl_root/launch/common.sh" ]; then break; fi; done
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$hpcdl_root/launch/common.sh" 2>/dev/null || { echo "error: cannot find the hpcdl repository; set HPCDL_ROOT (HPCDL_ROOT=/path/to/hpcdl sbatch ...)" >&2; exit 2; }
hpcdl_launch mpirun "$@"
