# The two commands README promises. Each sets everything up first (idempotent, seconds when done).
NP ?= 2

.PHONY: setup train test

setup:
	bash scripts/setup.sh

train: setup
	bash launch/mpirun.sh -np $(NP)

test:
	bash scripts/test.sh
