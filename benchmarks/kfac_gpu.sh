#!/usr/bin/env bash
# K-FAC's overhead on one GPU beside SGD and kfac-pytorch: one command, no setup (benchmarks/kfac_gpu.py says what).
#   bash benchmarks/kfac_gpu.sh --out DIR --budget SECONDS [--dry-run] [--kfac-pytorch PATH]
# Runs with the machine's own Python (PYTHON, default python3) and PYTHONPATH=. from the repository's root.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" benchmarks/kfac_gpu.py "$@"
