#!/usr/bin/env bash
# README's test command (via `make test`): set up from nothing if needed, then run
#   0. ruff and mypy on hpcdl/ and kfac/,
#   1. the plain tests (unit tests, and tests that launch whole jobs with mpirun/srun), then
#   2. the in-process collective tests under mpiexec on 4 ranks, and
#   3. the collective algorithms again on an odd world size (3 ranks).
# Every MPI run sits under `timeout`, and tests/conftest.py aborts all ranks when one fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
if [ -f scripts/install-slurm.sh ]; then
  bash scripts/install-slurm.sh || echo "[test] Slurm could not be installed: its tests will say why they skip"
fi

PY="$ROOT/.venv/bin/python"
# CI installs Slurm (scripts/install-slurm.sh): there its tests must run, never skip.
if [ "${CI:-}" = true ]; then export HPCDL_REQUIRE_SLURM=1; fi

# The CPU image that tests/cluster/test_container_runs.py runs ranks in (containers/build.sh: cached,
# seconds when built; a fresh machine downloads the wheelhouse once and builds). In CI it must be
# built and its tests must run; elsewhere it is built where root and a wheelhouse are at hand.
if [ "${CI:-}" = true ]; then export HPCDL_REQUIRE_IMAGE=1; fi
WHEELHOUSE="${HPCDL_WHEELHOUSE:-${HPCDL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpcdl}/wheelhouse}"
if [ "$(id -u)" = 0 ] && { [ -f "$WHEELHOUSE/hpcdl-wheelhouse.txt" ] || [ "${HPCDL_REQUIRE_IMAGE:-}" = 1 ]; }; then
  echo "[test] the container image (make image)"
  if [ ! -f "$WHEELHOUSE/hpcdl-wheelhouse.txt" ]; then bash scripts/wheelhouse.sh "$WHEELHOUSE"; fi
  HPCDL_WHEELHOUSE="$WHEELHOUSE" bash containers/build.sh >/dev/null ||
    echo "[test] the image could not be built (above): its tests say why they skip, or fail in CI"
fi
# The tests see empty data and run caches (MNIST, torch.compile's), as on a fresh machine; the build
# caches above (Horovod's wheels, the wheelhouse, the image) stay.
# shellcheck source=scripts/fresh_caches.sh
source scripts/fresh_caches.sh
hpcdl_fresh_caches
echo "[test] data and run caches: $HPCDL_FRESH_CACHES (empty; removed at the end)"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1

echo "[test] 0/3 ruff and mypy on hpcdl/ and kfac/ (configured in pyproject.toml)"
"$ROOT/.venv/bin/ruff" check hpcdl kfac
"$ROOT/.venv/bin/mypy"

echo "[test] 1/3 plain tests"
status=0
"$PY" -m pytest -q -ra --junitxml="$ROOT/.pytest-times.xml" "$@" tests || status=$?
"$PY" scripts/test_times.py "$ROOT/.pytest-times.xml" || true  # time per directory (tests/cluster: the virtual nodes)
if [ "$status" != 0 ]; then exit "$status"; fi

echo "[test] 2/3 collective tests on 4 ranks"
timeout 1500 mpiexec -n 4 --bind-to none "$PY" -m pytest -q --color=no --with-mpi -m mpi -p no:cacheprovider tests

if compgen -G "tests/collectives/test_*.py" >/dev/null; then
  echo "[test] 3/3 collective algorithms on 3 ranks"
  timeout 600 mpiexec -n 3 --bind-to none "$PY" -m pytest -q --color=no --with-mpi -m mpi -p no:cacheprovider tests/collectives/test_*.py
fi
echo "[test] all passed"
