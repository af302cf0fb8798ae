"""Helpers shared by the tests: MPI job runners, dataset writers, a one-machine Slurm."""
