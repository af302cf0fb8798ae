"""Small MPI programs to run first on a new cluster: python -m hpcdl.demos.<name> under mpirun/srun/ibrun."""
