# The two commands README promises. Each sets everything up first (idempotent, seconds when done).
NP ?= 2

.PHONY: setup train test test-fast wheelhouse

setup:
	bash scripts/setup.sh

train: setup
	bash launch/mpirun.sh -np $(NP)

test:
	bash scripts/test.sh

# The fast tier: no process started, under 2 minutes on 2 cores; run it all the time.
test-fast: setup
	.venv/bin/python -m pytest -q --fast tests

# For compute nodes without network: `make wheelhouse DIR=/scratch/w` here, `HPCDL_WHEELHOUSE=/scratch/w make setup` there.
wheelhouse:
	@test -n "$(DIR)" || { echo "usage: make wheelhouse DIR=<folder> [WHEELHOUSE_ARGS='--python-version 3.12 --no-torch']"; exit 2; }
	bash scripts/wheelhouse.sh $(WHEELHOUSE_ARGS) "$(DIR)"
