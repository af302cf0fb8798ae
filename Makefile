# The two commands README promises. Each sets everything up first (idempotent, seconds when done).
NP ?= 2

.PHONY: setup train test test-fast wheelhouse image image-mpich image-sif image-prereqs

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

# The CPU container image (containers/build.sh: Debian 12 via mmdebstrap, scripts/setup.sh inside,
# offline from the wheelhouse; cached: a second build takes seconds). Root; prints the image's path.
# Needs `make wheelhouse DIR=~/.cache/hpcdl/wheelhouse` once (or HPCDL_WHEELHOUSE=<folder>).
image:
	bash containers/build.sh

# The same image with MPICH 4.0.2 inside, for MPICH-ABI launchers (built on demand, not in CI).
image-mpich:
	bash containers/build.sh --mpi mpich

# The CPU image also as SquashFS and SIF (siftool; no Apptainer has run it here).
image-sif:
	bash containers/build.sh --sif

# The Debian packages the image build needs (Charliecloud, mmdebstrap, squashfs-tools, siftool); root.
image-prereqs:
	bash containers/prereqs.sh
