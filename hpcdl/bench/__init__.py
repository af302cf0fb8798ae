"""Benchmarks run under mpirun: each module is a command (python -m hpcdl.bench.<name>)."""
