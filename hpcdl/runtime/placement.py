"""Placement check: one rank per GPU, and enough cores per rank, before any training step.

Three mistakes cost GPU users hours and print nothing useful on their own:

* two ranks on one GPU -- NCCL fails 14 s later in ``ncclCommInitRank`` ("invalid usage") with a
  traceback on every rank, never saying which ranks share which GPU;
* more ranks on a node than GPUs -- the surplus ranks have no GPU of their own;
* a CUDA build of torch with no GPU visible when a GPU run was asked for (a job without ``--gres``).

And one that only slows a run down: a rank bound to far fewer cores than its share of the node
(Open MPI binds each rank to one core by default for two ranks or fewer; the DataLoader's workers
inherit that binding, so 8 workers then share one core).

:func:`verify` gathers one :class:`RankRow` per rank and decides with pure functions over those
rows (:func:`placement_error`, :func:`placement_warnings`), so the decisions are tested with
simulated device counts and affinities. Every rank reaches the same verdict from the same rows:
an error is the same one-line UsageError on every rank (each exits by itself, no traceback wall);
warnings are printed once, by rank 0.

Test hooks (CPU machines have no GPU to misplace): ``HPCDL_FAKE_GPU_UUIDS`` (comma-separated)
pretends this rank sees those GPUs, and ``HPCDL_FAKE_NODE_CORES`` pretends the node has that many
cores. They change only the rows this module checks, never the device a rank trains on.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from hpcdl.launching.cores import CoreShare, usable_cores
from hpcdl.runtime.errors import UsageError

FAKE_GPUS_VAR = "HPCDL_FAKE_GPU_UUIDS"
FAKE_NODE_CORES_VAR = "HPCDL_FAKE_NODE_CORES"

ONE_RANK_PER_GPU_FIX = (
    "start one rank per GPU: --ntasks-per-node (or -np per host) equal to the GPUs per node, with "
    "--gres=gpu:N or --gpus-per-task=1; do not set CUDA_VISIBLE_DEVICES to one GPU for every rank"
)


class WorldError(RuntimeError):
    """The job's layout cannot work (for example more ranks on a host than GPUs)."""


class Seat(Protocol):
    """Where a rank sits (hpcdl.runtime.world.World has these, and so does the world before it is complete)."""

    @property
    def rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def local_size(self) -> int: ...
    @property
    def hostname(self) -> str: ...
    @property
    def device(self) -> torch.device: ...


def choose_device(local_rank: int, cuda_devices: int) -> torch.device:
    """The device a rank should use.

    With one visible GPU (Slurm's --gpus-per-task=1 or a CUDA_VISIBLE_DEVICES per rank) that GPU
    is ours; with several visible (--gres=gpu:4) we take the one at our local rank.
    """
    if cuda_devices <= 0:
        return torch.device("cpu")
    if cuda_devices == 1:
        return torch.device("cuda", 0)
    if local_rank >= cuda_devices:
        raise WorldError(
            f"local rank {local_rank} has no GPU: only {cuda_devices} visible on this host; "
            "start at most one rank per GPU (e.g. --ntasks-per-node equal to the GPUs per node)"
        )
    return torch.device("cuda", local_rank)


@dataclasses.dataclass(frozen=True)
class RankRow:
    """What one rank knows about where it runs; gathered from every rank by :func:`verify`."""

    host: str
    rank: int
    local_rank: int
    local_size: int
    device: str  # what the rank trains on: "cpu" or "cuda:N"
    gpu_uuid: str  # the physical GPU behind `device` ("" on CPU)
    visible_gpus: tuple[str, ...]  # UUIDs of every GPU this rank can see
    cuda_build: bool  # torch was built with CUDA
    affinity_cores: int  # cores this process (and its loader workers) may run on
    node_cores: int  # cores the job may use on this node
    problem: str = ""  # a failure while filling in this row (a broken GPU), reported as an error


# ---------------------------------------------------------------- decisions (pure)


def _ranks(ranks: Iterable[int]) -> str:
    """'rank 3' or 'ranks 0, 1 and 2'."""
    items = sorted(set(ranks))
    if len(items) == 1:
        return f"rank {items[0]}"
    return "ranks " + ", ".join(map(str, items[:-1])) + f" and {items[-1]}"


def _by_host(rows: Sequence[RankRow]) -> dict[str, list[RankRow]]:
    hosts: dict[str, list[RankRow]] = defaultdict(list)
    for row in rows:
        hosts[row.host].append(row)
    return dict(hosts)


def placement_error(rows: Sequence[RankRow], gpu_requested: bool,
                    without_gpu: str = "run with --device cpu") -> str | None:
    """The first placement mistake as one line naming the rank(s) and the fix, or None.

    ``without_gpu``: how the calling program is told not to ask for a GPU (its own flag, not training's).

    Checked in the order a user should fix them: a rank that could not look at its GPU, GPUs
    asked for but absent, more ranks on a node than GPUs (some ranks get none), two ranks on one
    GPU (each sees one GPU, the same one: CUDA_VISIBLE_DEVICES=0 for every rank, say).
    """
    broken = [row for row in rows if row.problem]
    if broken:
        row = broken[0]
        return f"rank {row.rank} on {row.host} could not query its GPU ({row.problem}); check the GPU and driver there"

    if gpu_requested:
        blind = [row for row in rows if not row.visible_gpus]
        if blind:
            hosts = sorted({row.host for row in blind})
            if not all(row.cuda_build for row in blind):
                return (
                    f"a GPU run was asked for, but torch on {_ranks(r.rank for r in blind)} is a CPU-only build; "
                    f"install the CUDA build (HPCDL_GPU=1 make setup) or {without_gpu}"
                )
            return (
                f"a GPU run was asked for, but {_ranks(r.rank for r in blind)} on {', '.join(hosts)} see no GPU; "
                "request GPUs from the scheduler (--gres=gpu:N or --gpus-per-task=1), check CUDA_VISIBLE_DEVICES "
                f"and the driver (nvidia-smi), or {without_gpu}"
            )

    for host, members in sorted(_by_host(rows).items()):
        gpus = {uuid for row in members for uuid in row.visible_gpus}
        without = [row.rank for row in members if not row.gpu_uuid]
        if gpus and without:  # GPUs on this node, but not one for every rank (--gres style, too many tasks)
            count = f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''}"
            return (
                f"{len(members)} ranks on {host} but only {count} there: {_ranks(without)} "
                f"{'has' if len(without) == 1 else 'have'} no GPU of {'its' if len(without) == 1 else 'their'} "
                "own; " + ONE_RANK_PER_GPU_FIX
            )

    for host, members in sorted(_by_host(rows).items()):
        sharing: dict[str, list[RankRow]] = defaultdict(list)
        for row in members:
            if row.gpu_uuid:
                sharing[row.gpu_uuid].append(row)
        for uuid, users in sorted(sharing.items()):
            if len(users) > 1:
                return (
                    f"{_ranks(r.rank for r in users)} on {host} share one GPU ({users[0].device}, {uuid}); "
                    "NCCL allows one rank per GPU; " + ONE_RANK_PER_GPU_FIX
                )
    return None


def core_share(row: RankRow) -> int:
    """The cores a rank should have: its node's cores divided among the ranks on that node."""
    return CoreShare(row.node_cores, row.local_size).per_rank


def starved(row: RankRow) -> bool:
    """Bound to fewer than half of its share of the node (e.g. 1 core of a 16-core share)."""
    return row.affinity_cores * 2 < core_share(row)


def placement_warnings(rows: Sequence[RankRow]) -> list[str]:
    """One line per host whose ranks are confined to far fewer cores than their share."""
    lines = []
    for host, members in sorted(_by_host(rows).items()):
        bound = [row for row in members if starved(row)]
        if not bound:
            continue
        cores = max(row.affinity_cores for row in bound)
        share = min(core_share(row) for row in bound)
        lines.append(
            f"{_ranks(r.rank for r in bound)} on {host} may run on only {cores} core{'s' if cores > 1 else ''} "
            f"each, of a share of {share} (node: {bound[0].node_cores} cores, {bound[0].local_size} rank(s)); "
            "torch threads and data-loading workers inherit that binding -- fix: mpirun --bind-to none "
            f"(or --map-by socket:PE={share}), or srun --cpus-per-task={share}"
        )
    return lines


# ---------------------------------------------------------------- facts about this rank


def node_cores(env: Mapping[str, str] | None = None) -> int:
    """Cores the job may use on this node.

    Not os.cpu_count() alone: under Slurm a job owns part of a node (SLURM_CPUS_ON_NODE, the job's
    cgroup cpuset), and a rank bound to its cores there is not starved. mpirun's binding narrows
    only the process affinity, never the cgroup, so the cgroup says what the node offers the job.
    """
    env = os.environ if env is None else env
    for name in (FAKE_NODE_CORES_VAR, "SLURM_CPUS_ON_NODE"):
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    cgroup = _cgroup_cpuset_size()
    return cgroup or os.cpu_count() or 1


def _cgroup_cpuset_size() -> int | None:
    """Cores in this process's cgroup-v2 cpuset, or None where that is not readable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        path = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
        text = (Path("/sys/fs/cgroup") / path.lstrip("/") / "cpuset.cpus.effective").read_text().strip()
    except (OSError, StopIteration, IndexError):
        return None
    return cpu_list_size(text) or None


def cpu_list_size(text: str) -> int:
    """Cores in a Linux CPU list such as '0-3,8,10-11' (7)."""
    total = 0
    for part in filter(None, text.strip().split(",")):
        low, _, high = part.partition("-")
        total += int(high or low) - int(low) + 1
    return total


def visible_gpu_uuids() -> tuple[str, ...]:
    """UUIDs of the GPUs this process sees (or the test hook's pretend ones)."""
    fake = os.environ.get(FAKE_GPUS_VAR, "").strip()
    if fake:
        return tuple(uuid.strip() for uuid in fake.split(",") if uuid.strip())
    if not torch.cuda.is_available():
        return ()
    return tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))


def local_row(me: Seat) -> RankRow:
    """This rank's row; a failure to look at the GPU becomes the row's `problem`, never an exception,
    so that every rank still reaches the gather."""
    problem = ""
    device, uuid = str(me.device), ""
    visible: tuple[str, ...] = ()
    try:
        visible = visible_gpu_uuids()
        if os.environ.get(FAKE_GPUS_VAR, "").strip():
            try:  # which pretend GPU this rank would take, by the same rule as choose_device
                fake_device = choose_device(me.local_rank, len(visible))
                device, uuid = str(fake_device), visible[fake_device.index or 0]
            except WorldError:
                device = "cpu"
        elif me.device.type == "cuda":
            uuid = str(torch.cuda.get_device_properties(me.device).uuid)
    except Exception as exc:  # noqa: BLE001 - reported collectively by placement_error
        problem = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return RankRow(
        host=me.hostname,
        rank=me.rank,
        local_rank=me.local_rank,
        local_size=me.local_size,
        device=device,
        gpu_uuid=uuid,
        visible_gpus=visible,
        cuda_build=bool(torch.version.cuda) or bool(os.environ.get(FAKE_GPUS_VAR)),
        affinity_cores=usable_cores(),
        node_cores=node_cores(),
        problem=problem,
    )


def gather_rows(me: Seat, comm: Any) -> list[RankRow]:
    """Every rank's row, on every rank (collective)."""
    rows = comm.allgather(dataclasses.asdict(local_row(me)))
    return [RankRow(**{**row, "visible_gpus": tuple(row["visible_gpus"])}) for row in rows]


def verify(me: Seat, comm: Any, gpu_requested: bool) -> None:
    """Check the job's placement before any training step (collective: every rank calls it).

    Raises UsageError with the same one line on every rank for a placement that cannot work;
    rank 0 prints a line for each warning and the run goes on.
    """
    rows = gather_rows(me, comm)
    error = placement_error(rows, gpu_requested)
    if error:
        raise UsageError(error)
    if me.rank == 0:
        for line in placement_warnings(rows):
            print(f"hpcdl: warning: {line}", file=sys.stderr, flush=True)
