"""Rank placement: which local rank a process has, and which GPU it takes.

The launcher's own variable must win (under mpirun inside an sbatch job every rank also sees
SLURM_LOCALID=0), and the GPU choice must be right both when a rank sees all the node's GPUs
(--gres=gpu:4: take the one at the local rank) and when it sees exactly one (--gpus-per-task=1:
use it, whatever the local rank). tests/test_slurm.py checks the same against a real Slurm.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hpcdl import world
from hpcdl.world import LOCAL_RANK_VARS, WorldError, choose_device, local_rank_from_env, local_size_from_env

# The order the issue asks for: MPI launchers first, then Slurm.
EXPECTED_ORDER = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def test_the_order_is_mpi_launchers_then_slurm() -> None:
    assert tuple(LOCAL_RANK_VARS) == EXPECTED_ORDER


@pytest.mark.parametrize("name", EXPECTED_ORDER)
def test_each_launcher_variable_alone_is_read(name: str) -> None:
    assert local_rank_from_env({name: "3"}) == 3


@pytest.mark.parametrize("earlier, later", list(itertools.combinations(EXPECTED_ORDER, 2)))
def test_an_earlier_variable_wins(earlier: str, later: str) -> None:
    # e.g. mpirun inside sbatch: OMPI_COMM_WORLD_LOCAL_RANK=1 while SLURM_LOCALID=0 for every rank
    assert local_rank_from_env({earlier: "1", later: "0"}) == 1


def test_mpirun_inside_sbatch() -> None:
    """The case that goes wrong most: Slurm says 0 to every rank started by mpirun."""
    ranks = [local_rank_from_env({"SLURM_LOCALID": "0", "SLURM_PROCID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": str(r)})
             for r in range(4)]
    assert ranks == [0, 1, 2, 3]


def test_no_launcher_variable_means_unknown() -> None:
    assert local_rank_from_env({}) is None
    assert local_rank_from_env({"PATH": "/bin", "SLURM_PROCID": "5"}) is None  # a global rank is not a local one


def test_unusable_values_fall_through_to_the_next_variable() -> None:
    assert local_rank_from_env({"OMPI_COMM_WORLD_LOCAL_RANK": "", "SLURM_LOCALID": "2"}) == 2
    assert local_rank_from_env({"MPI_LOCALRANKID": "x", "SLURM_LOCALID": "1"}) == 1
    assert local_rank_from_env({"MPI_LOCALRANKID": " 4 "}) == 4


def test_local_size_from_the_mpi_launcher() -> None:
    assert local_size_from_env({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == 4
    assert local_size_from_env({"MPI_LOCALNRANKS": "2"}) == 2
    assert local_size_from_env({}) is None


# ---------------------------------------------------------------- GPU choice


def test_no_gpu_means_cpu() -> None:
    for local_rank in range(4):
        assert choose_device(local_rank, 0) == torch.device("cpu")


def test_gres_all_gpus_visible_takes_the_local_rank() -> None:
    """--gres=gpu:4: every rank sees 0,1,2,3 and each must take a different one."""
    devices = [choose_device(local_rank, 4) for local_rank in range(4)]
    assert devices == [torch.device("cuda", i) for i in range(4)]


def test_gpus_per_task_one_visible_is_used_by_any_local_rank() -> None:
    """--gpus-per-task=1: each rank sees one GPU (as device 0) whatever its local rank."""
    for local_rank in range(8):
        assert choose_device(local_rank, 1) == torch.device("cuda", 0)


def test_more_ranks_than_gpus_is_a_clear_error() -> None:
    with pytest.raises(WorldError, match=r"local rank 4 has no GPU: only 4 visible"):
        choose_device(4, 4)


def test_physical_gpus_are_distinct_under_both_slurm_styles() -> None:
    """Follow each rank to the physical GPU it would drive (the independent check: no two share one)."""
    gres = {rank: "0,1,2,3" for rank in range(4)}  # what Slurm sets with --gres=gpu:4
    per_task = {rank: str(rank) for rank in range(4)}  # what it sets with --gpus-per-task=1
    for visible_by_rank in (gres, per_task):
        physical = []
        for local_rank, visible in visible_by_rank.items():
            ids = visible.split(",")
            device = choose_device(local_rank_from_env({"SLURM_LOCALID": str(local_rank)}), len(ids))
            physical.append(ids[device.index])
        assert sorted(physical) == ["0", "1", "2", "3"]


def test_threads_per_rank_share_the_cores() -> None:
    assert world.threads_per_rank(4, cores=16, env={}) == 4
    assert world.threads_per_rank(3, cores=2, env={}) == 1  # never zero
    assert world.threads_per_rank(4, cores=16, env={"OMP_NUM_THREADS": "2"}) == 2  # the launch script's choice wins
