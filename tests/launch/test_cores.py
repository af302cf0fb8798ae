"""A host's cores per rank (hpcdl/launching/cores.py), against cases worked by hand: the one rule the launch plan's
--threads default, each rank's torch threads and the placement check's core share all read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpcdl.launching import args as launch_args
from hpcdl.launching import plan as launch_plan
from hpcdl.launching.cores import CoreShare, given_threads, threads_per_rank, usable_cores
from hpcdl.runtime import placement


@pytest.mark.parametrize("cores, ranks, per_rank", [
    (16, 4, 4),   # an even split
    (8, 3, 2),    # 8 // 3: the remainder stays idle, no rank gets a third core's worth of threads
    (12, 1, 12),  # one rank takes the host
    (2, 3, 1),    # more ranks than cores: one each, never zero
    (1, 1, 1),
    (0, 2, 1),    # nothing known about the cores: still one
    (8, 0, 8),    # no rank count (a world not yet seated): the host's cores
])
def test_the_share_per_rank(cores: int, ranks: int, per_rank: int) -> None:
    assert CoreShare(cores, ranks).per_rank == per_rank


def test_a_given_thread_count_wins_over_the_share() -> None:
    assert CoreShare(16, 4).threads() == 4
    assert CoreShare(16, 4).threads(3) == 3
    assert CoreShare(2, 4).threads(8) == 8  # the user's choice, even past the share
    assert CoreShare(16, 4).threads(None) == 4


@pytest.mark.parametrize("value, threads", [
    ("2", 2), (" 3 ", 3), ("16", 16),
    ("0", None), ("-1", None), ("", None), ("two", None), ("1.5", None), ("\u00b2", None),  # superscript two
])
def test_omp_num_threads_as_a_given_count(value: str, threads: int | None) -> None:
    assert given_threads({"OMP_NUM_THREADS": value}) == threads
    assert given_threads({}) is None


@pytest.mark.parametrize("ranks, cores, env, threads", [
    (4, 16, {}, 4),
    (3, 2, {}, 1),
    (3, 8, {}, 2),
    (4, 16, {"OMP_NUM_THREADS": "2"}, 2),   # the launch script's --threads (or Slurm's --cpus-per-task) wins
    (1, 2, {"OMP_NUM_THREADS": "6"}, 6),
    (4, 16, {"OMP_NUM_THREADS": "0"}, 4),   # not a count: the share
    (4, 16, {"OMP_NUM_THREADS": "x"}, 4),
])
def test_threads_per_rank(ranks: int, cores: int, env: dict[str, str], threads: int) -> None:
    assert threads_per_rank(ranks, cores=cores, env=env) == threads


@pytest.fixture()
def narrowed_affinity():
    """Runs the test with this thread's affinity set by the test (restored after), where Linux lets it."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this system")
    before = os.sched_getaffinity(0)
    try:
        yield before
    finally:
        os.sched_setaffinity(0, before)


def test_usable_cores_follow_an_affinity_mask_narrower_than_the_machine(narrowed_affinity: set[int]) -> None:
    """A taskset, a job step or mpirun's binding leaves a process fewer cores than os.cpu_count() says; the share
    is of those."""
    allowed = sorted(narrowed_affinity)
    assert usable_cores() == len(allowed) <= (os.cpu_count() or 1)
    os.sched_setaffinity(0, allowed[:1])
    assert usable_cores() == 1
    assert threads_per_rank(1, env={}) == 1
    assert threads_per_rank(2, env={}) == 1
    assert threads_per_rank(2, env={"OMP_NUM_THREADS": "4"}) == 4
    if len(allowed) >= 2:
        os.sched_setaffinity(0, allowed[:2])
        assert usable_cores() == 2
        assert threads_per_rank(1, env={}) == 2
        assert threads_per_rank(2, env={}) == 1


class OpenMpiMachine(launch_plan.Machine):
    def is_open_mpi(self, mpirun: str) -> bool:
        return True


@pytest.mark.parametrize("cores, ranks, threads", [(16, 4, 4), (8, 3, 2), (2, 3, 1), (12, 1, 12)])
def test_the_plan_the_rank_and_the_placement_check_agree(cores: int, ranks: int, threads: int, tmp_path: Path) -> None:
    """The launch plan's threads for ranks on one host, each rank's own threads without OMP_NUM_THREADS, and the
    share the placement check holds a bound rank against are the same count."""
    (tmp_path / "mpirun").write_text("#!/bin/sh\n")
    (tmp_path / "mpirun").chmod(0o755)
    options, entry = launch_args.split_words(launch_args.mpirun_parser({}), ["-np", str(ranks)], {})
    machine = OpenMpiMachine(env={}, path=str(tmp_path), cores=cores, root="/repo", gpus=0)
    planned = launch_plan.decide_mpirun(options, entry, machine).threads
    row = placement.RankRow(host="n1", rank=0, local_rank=0, local_size=ranks, device="cpu", gpu_uuid="",
                            visible_gpus=(), cuda_build=False, affinity_cores=cores, node_cores=cores)
    assert (planned, threads_per_rank(ranks, cores=cores, env={}), placement.core_share(row)) == (threads,) * 3
