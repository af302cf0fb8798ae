"""hpcdl: data-parallel PyTorch training on HPC clusters with Horovod and MPI."""

__version__ = "0.1.0"
