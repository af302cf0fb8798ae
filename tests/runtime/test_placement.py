"""Rank placement: which local rank a process has, and which GPU it takes.

The launcher's own variable must win (under mpirun inside an sbatch job every rank also sees
SLURM_LOCALID=0), and the GPU choice must be right both when a rank sees all the node's GPUs
(--gres=gpu:4: take the one at the local rank) and when it sees exactly one (--gpus-per-task=1:
use it, whatever the local rank). tests/launch/test_slurm.py checks the same against a real Slurm.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hpcdl.runtime.launcher import LOCAL_RANK_VARS, local_rank_from_env, local_size_from_env
from hpcdl.runtime.world import WorldError, choose_device

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier

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


# ---------------------------------------------------------------- placement verdicts (hpcdl.placement)
# Rows are simulated: a 4-GPU node under --gres=gpu:4 (every rank sees all four), under
# --gpus-per-task=1 (each sees its own one), mistakes of each kind, and core bindings.

from hpcdl.runtime.placement import RankRow, cpu_list_size, node_cores, placement_error, placement_warnings  # noqa: E402

GPUS = tuple(f"GPU-{i}" for i in range(4))


def row(rank: int, *, host: str = "n1", local_size: int = 4, visible: tuple[str, ...] = GPUS,
        local_rank: int | None = None, affinity: int = 4, cores: int = 16, cuda_build: bool = True,
        problem: str = "") -> RankRow:
    """A rank's row as world.choose_device would place it with `visible` GPUs."""
    local_rank = rank % local_size if local_rank is None else local_rank
    device, uuid = "cpu", ""
    if visible:
        try:
            chosen = choose_device(local_rank, len(visible))
            device, uuid = str(chosen), visible[chosen.index or 0]
        except WorldError:
            pass
    return RankRow(host=host, rank=rank, local_rank=local_rank, local_size=local_size, device=device, gpu_uuid=uuid,
                   visible_gpus=visible, cuda_build=cuda_build, affinity_cores=affinity, node_cores=cores,
                   problem=problem)


def test_one_rank_per_gpu_passes_under_both_slurm_styles() -> None:
    gres = [row(r) for r in range(8)] + [row(r, host="n2") for r in range(8, 12)]
    assert placement_error(gres[:4], gpu_requested=True) is None
    per_task = [row(r, visible=(GPUS[r % 4],)) for r in range(4)]  # each rank sees only its own GPU, as cuda:0
    assert {r.device for r in per_task} == {"cuda:0"}
    assert placement_error(per_task, gpu_requested=True) is None
    two_nodes = [row(r, host=f"n{r // 4}", visible=tuple(f"{h}-{g}" for h in [f'n{r // 4}'] for g in range(4)))
                 for r in range(8)]
    assert placement_error(two_nodes, gpu_requested=True) is None


def test_two_ranks_on_one_gpu_name_the_ranks_and_the_fix() -> None:
    # CUDA_VISIBLE_DEVICES=0 for every rank (set by hand in a job script): both take cuda:0, the same GPU
    rows = [row(r, local_size=2, visible=("GPU-0",)) for r in range(2)]
    line = placement_error(rows, gpu_requested=True)
    assert line is not None and "\n" not in line
    assert "ranks 0 and 1 on n1 share one GPU (cuda:0, GPU-0)" in line
    assert "one rank per GPU" in line and "CUDA_VISIBLE_DEVICES" in line


def test_the_same_uuid_on_two_hosts_is_not_sharing() -> None:
    rows = [row(0, host="a", local_size=1, visible=("GPU-0",)), row(1, host="b", local_size=1, visible=("GPU-0",))]
    assert placement_error(rows, gpu_requested=True) is None


def test_more_ranks_on_a_node_than_gpus() -> None:
    rows = [row(r, local_size=6) for r in range(6)]  # --gres=gpu:4 with 6 tasks per node
    line = placement_error(rows, gpu_requested=False)
    assert line is not None and line.startswith("6 ranks on n1 but only 4 GPUs there: ranks 4 and 5 have no GPU")
    assert "--ntasks-per-node" in line


def test_cuda_torch_without_a_visible_gpu_when_a_gpu_run_was_asked_for() -> None:
    rows = [row(r, local_size=2, visible=()) for r in range(2)]
    line = placement_error(rows, gpu_requested=True)
    assert line is not None and "ranks 0 and 1 on n1 see no GPU" in line and "--gres=gpu:N" in line
    assert placement_error(rows, gpu_requested=False) is None  # a CPU run on a CPU node is fine
    cpu_torch = [row(0, local_size=1, visible=(), cuda_build=False)]
    assert "CPU-only build" in (placement_error(cpu_torch, gpu_requested=True) or "")


def test_one_node_without_gpus_among_good_ones() -> None:
    rows = [row(r) for r in range(4)] + [row(r, host="n2", visible=()) for r in range(4, 8)]
    line = placement_error(rows, gpu_requested=True) or ""
    assert "ranks 4, 5, 6 and 7 on n2 see no GPU" in line


def test_a_rank_that_could_not_query_its_gpu_is_named() -> None:
    rows = [row(0, local_size=2), row(1, local_size=2, problem="RuntimeError: CUDA error: unknown error")]
    assert placement_error(rows, gpu_requested=True) == (
        "rank 1 on n1 could not query its GPU (RuntimeError: CUDA error: unknown error); "
        "check the GPU and driver there")


def test_cpu_runs_are_fine_without_gpus() -> None:
    assert placement_error([row(r, local_size=2, visible=(), cuda_build=False) for r in range(2)], False) is None


# ---------------------------------------------------------------- core binding (a warning)


def test_open_mpi_default_binding_on_a_16_core_node_warns_once_per_host() -> None:
    # mpirun -np 1 without --bind-to none: one core of sixteen (the 972 vs 1,823 img/s)
    lines = placement_warnings([row(0, local_size=1, affinity=1, cores=16)])
    assert len(lines) == 1
    assert "rank 0 on n1 may run on only 1 core each, of a share of 16" in lines[0]
    assert "--bind-to none" in lines[0] and "--map-by socket:PE=16" in lines[0]
    two = placement_warnings([row(r, local_size=2, affinity=1, cores=16) for r in range(2)])
    assert len(two) == 1 and "ranks 0 and 1 on n1" in two[0] and "share of 8" in two[0]


def test_a_fair_share_or_close_to_it_does_not_warn() -> None:
    assert placement_warnings([row(r, affinity=4, cores=16) for r in range(4)]) == []  # --map-by socket:PE=4
    assert placement_warnings([row(r, affinity=16, cores=16) for r in range(4)]) == []  # --bind-to none
    assert placement_warnings([row(r, local_size=2, affinity=1, cores=2) for r in range(2)]) == []  # 1 of 1
    assert placement_warnings([row(0, local_size=1, affinity=1, cores=2)]) == []  # half of the share: not "far"


def test_only_the_starved_host_is_named() -> None:
    rows = [row(0, host="a", local_size=1, affinity=16), row(1, host="b", local_size=1, affinity=2)]
    lines = placement_warnings(rows)
    assert len(lines) == 1 and lines[0].startswith("rank 1 on b")


def test_node_cores_prefers_the_jobs_allocation() -> None:
    assert node_cores({"SLURM_CPUS_ON_NODE": "8"}) == 8
    assert node_cores({"HPCDL_FAKE_NODE_CORES": "16", "SLURM_CPUS_ON_NODE": "8"}) == 16
    assert node_cores({}) >= 1
    assert cpu_list_size("0-3,8,10-11") == 7 and cpu_list_size("5") == 1 and cpu_list_size("") == 0


# ---------------------------------------------------------------- a real job: every rank stops, one line


def _train_args(tmp_path) -> list[str]:
    return ["-m", "hpcdl.train", "--epochs", "1", "--output-dir", str(tmp_path / "run")]


def test_two_ranks_on_one_pretend_gpu_stop_every_rank_with_one_line(tmp_path) -> None:
    import time

    from tests.support.mpi_harness import run_mpi

    start = time.monotonic()
    result = run_mpi(2, _train_args(tmp_path), timeout=120, env={"HPCDL_FAKE_GPU_UUIDS": "GPU-fake-0"})
    elapsed = time.monotonic() - start
    assert result.returncode not in (0, 124), result.stderr
    # rank 0's one line (the other rank reached the same verdict and exits quietly); the rest is mpirun's banner
    lines = [line for line in result.stderr.splitlines() if "hpcdl" in line or "rror" in line.split(":")[0]]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hpcdl.train: error: ranks 0 and 1 on ")
    assert "share one GPU (cuda:0, GPU-fake-0)" in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())
    assert elapsed < 60, f"took {elapsed:.0f} s"


def test_a_rank_bound_to_one_core_of_a_pretend_16_core_node_warns_and_trains(tmp_path) -> None:
    import shutil
    import subprocess

    from tests.support.mpi_harness import PYTHON, REPO, mpi_env

    cmd = [shutil.which("mpirun") or "mpirun", "-np", "1", "--bind-to", "core", PYTHON, *_train_args(tmp_path),
           "--max-steps", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO,
                            env=mpi_env({"HPCDL_FAKE_NODE_CORES": "16"}))
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("hpcdl: warning:")]
    assert len(warnings) == 1 and "rank 0" in warnings[0] and "of a share of 16" in warnings[0], result.stderr
    assert "--bind-to none" in warnings[0]
