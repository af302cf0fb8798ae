"""What distributed K-FAC puts on the wire per step beside the gradients, and what that costs at scale.

    # 1. counted: short hpcdl.train runs of the large-batch cell on 4 ranks, each grad-worker fraction, whose
    #    K-FAC communicator counts every collective (--kfac-impl kfac_traffic:counted), beside the byte model
    .venv/bin/python benchmarks/kfac_traffic.py count --ranks 4 --fractions 1 0.5 0.25
    # 2. measured on a network (as root, a virtual cluster of 2 nodes x 2 ranks over 1 Gbit/s links): Horovod
    #    allreduce at several sizes fits alpha and B; K-FAC's own per-step collectives, replayed, are held out
    .venv/bin/python -m hpcdl.tools.vcluster up --nodes 2 --name lb --rate 1gbit
    PYTHONPATH=benchmarks launch/mpirun.sh --vcluster lb -np 4 --entry kfac_traffic -- measure --out runs/bench/traffic
    # 3. the alpha-beta model's prediction for ResNet-50 at 64-1,024 ranks from the byte model and the fit
    .venv/bin/python benchmarks/kfac_traffic.py predict --measured runs/bench/traffic_measure.json

Counted bytes are the payloads this rank hands to each collective (a ring allreduce of n bytes moves
2(N-1)/N n in and out of every rank; a broadcast delivers n to every other member). The byte model
(:func:`kfac_round_bytes`) derives the same payloads from the layers' factor sizes and kfac's own work
assignment; ``count`` checks it equals the counts, so that it can stand in for a ResNet-50 run this
machine cannot make. Everything is written under ``--out`` (default runs/bench/); benchmarks/results only
with --refresh-results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch
from figures import results, save_json, table, times
from studies import check_mnist
from torch import Tensor, nn

from hpcdl.bench.alphabeta import AlphaBeta, fit_ring, network
from hpcdl.persistence import outputs
from hpcdl.runtime.console import RankZeroParser
from hpcdl.runtime.errors import UsageError, run_main
from hpcdl.runtime.numbers import integer, real
from hpcdl.tools.fetch_mnist import DEFAULT_OUTPUT
from kfac.assignment import assign_work
from kfac.comm import Communicator, Group, Handle, chunk_overlaps
from kfac.default_comm import default_communicator
from kfac.factors import upper_size
from kfac.layers import find_layers
from kfac.methods import METHODS
from kfac.sharing import share_by

REPO = Path(__file__).resolve().parents[1]
KINDS = ("factors", "decompositions", "directions")
# The large-batch cell (kfac_large_batch.md): global batch 4096 on 4 ranks is 1024 each.
CELL = ["--dataset", "mnist", "--model", "mnist_cnn", "--batch-size", "1024", "--kfac-preset", "large-batch",
        "--base-lr", "0.1", "--device", "cpu", "--no-progress", "--stall-timeout", "0", "--log-every", "1000"]
RANKS_AT_SCALE = (64, 128, 256, 512, 1024)
FP32 = 4


# ---- counting: a Communicator that watches the real one ---------------------------------------------------


class _CountingGroup(Group):
    """A group whose collectives add (payload bytes this rank hands over, one round) to the tally of their kind.

    A share by scatter is one round of two collectives: the alltoall opens it, the allgather of chunks that
    follows it adds its bytes to that round."""

    def __init__(self, inner: Group, tally: dict[str, list[int]]) -> None:
        super().__init__(inner.ranks)
        self._inner, self._tally = inner, tally
        self._scatter_open = False  # an alltoall was counted; the next allgather is the same round's second half

    def _count(self, tensor: Tensor, name: str, new_round: bool = True) -> None:
        kind = name.split(".")[1]  # kfac.decompositions, kfac.directions
        self._tally[kind][0] += tensor.numel() * tensor.element_size()
        self._tally[kind][1] += new_round

    def allgather_async(self, tensor: Tensor, sizes: Sequence[int], name: str) -> Handle:
        self._count(tensor, name, new_round=not self._scatter_open)
        self._scatter_open = False
        return self._inner.allgather_async(tensor, sizes, name)

    def wait_gathered(self, handle: Handle) -> list[Tensor]:
        return self._inner.wait_gathered(handle)

    def allreduce_sum_async(self, tensor: Tensor, name: str) -> Handle:
        self._count(tensor, name)
        return self._inner.allreduce_sum_async(tensor, name)

    def wait_sum(self, handle: Handle) -> Tensor:
        return self._inner.wait_sum(handle)

    def alltoall_async(self, tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                       name: str) -> Handle:
        self._count(tensor, name)
        self._scatter_open = True
        return self._inner.alltoall_async(tensor, send_splits, recv_splits, name)

    def wait_alltoall(self, handle: Handle) -> Tensor:
        return self._inner.wait_alltoall(handle)


class CountingCommunicator(Communicator):
    """The job's communicator, counting bytes and rounds per kind of collective."""

    def __init__(self, inner: Communicator) -> None:
        self._inner = inner
        self.rank, self.size = inner.rank, inner.size
        self.tally: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # kind -> [bytes, rounds]

    def allreduce_sum_async(self, tensor: Tensor, name: str) -> Handle:
        self.tally["factors"][0] += tensor.numel() * tensor.element_size()
        self.tally["factors"][1] += name == "kfac.factors.0"  # one round: every bucket of a factor update
        return self._inner.allreduce_sum_async(tensor, name)

    def wait(self, handle: Handle) -> Tensor:
        return self._inner.wait(handle)

    def groups(self, partition: Sequence[Sequence[int]]) -> Group:
        return _CountingGroup(self._inner.groups(partition), self.tally)


class _Counted:
    """hpcdl's K-FAC with a counting communicator; after every step this rank's counts go to
    $KFAC_TRAFFIC_DIR/rank<R>.json (a job may end without running exit handlers)."""

    def __init__(self, preconditioner: Any, comm: CountingCommunicator, model: nn.Module) -> None:
        self._preconditioner, self._comm, self._steps = preconditioner, comm, 0
        self._gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self._out = Path(os.environ["KFAC_TRAFFIC_DIR"]) / f"rank{comm.rank}.json"

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._preconditioner.step(*args, **kwargs)
        self._steps += 1
        self._out.write_text(json.dumps(dict(
            rank=self._comm.rank, world=self._comm.size, steps=self._steps, gradient_bytes=self._gradient_bytes,
            tally={kind: dict(bytes=b, rounds=r) for kind, (b, r) in self._comm.tally.items()})))

    def __getattr__(self, name: str) -> Any:  # state_dict, load_state_dict, timings, ...
        return getattr(self._preconditioner, name)


def counted(config: Any, model: nn.Module, current_lr: Any, scaler: Any) -> _Counted:
    """``--kfac-impl kfac_traffic:counted``: hpcdl's own K-FAC, its collectives counted."""
    from hpcdl.training.optimizers import build_preconditioner

    comm = CountingCommunicator(default_communicator())
    preconditioner = build_preconditioner(replace(config, kfac_impl="hpcdl"), model, current_lr, scaler, comm)
    return _Counted(preconditioner, comm, model)


# ---- the byte model ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layers:
    """What K-FAC's traffic depends on, per preconditioned layer: factor sizes and gradient elements."""

    a_dims: tuple[int, ...]
    g_dims: tuple[int, ...]
    grad_numels: tuple[int, ...]
    parameters: int  # all trainable parameters: the gradient allreduce

    @classmethod
    def of(cls, model: nn.Module) -> Layers:
        layers = find_layers(model, ())
        return cls(tuple(layer.a_dim for layer in layers), tuple(layer.g_dim for layer in layers),
                   tuple(layer.a_dim * layer.g_dim for layer in layers),
                   sum(p.numel() for p in model.parameters() if p.requires_grad))


def _numel(shapes: Sequence[Sequence[int]]) -> int:
    return sum(math.prod(shape) for shape in shapes)


def member_parts(layers: Layers, world: int, fraction: float, method: str = "eigen") -> dict[str, list[list[int]]]:
    """Per kind, per group (worker groups for decompositions, receiver blocks for directions), the elements each
    member contributes in one round: the real owners of kfac's own work assignment (most ranks own nothing
    when there are more ranks than layers), each decomposition in ``method``'s wire form."""
    a, g = layers.a_dims, layers.g_dims
    work = assign_work(list(a), list(g), world, fraction)
    form = METHODS[method]()
    owned = {r: _numel([s for i, kind in work.owned_factors(r)
                        for s in form.wire_shapes(a[i] if kind == "A" else g[i])]) for r in range(world)}
    sources: dict[int, int] = defaultdict(int)
    for block in work.receiver_blocks():
        for i in range(len(a)):
            sources[work.gradient_source(i, block[0])] += layers.grad_numels[i]
    return dict(decompositions=[[owned[r] for r in group] for group in work.worker_groups()],
                directions=[[sources[r] for r in block] for block in work.receiver_blocks()])


def handed_elements(parts: Sequence[int], member: int) -> int:
    """What ``member`` (an index into ``parts``) hands to the collectives that share ``parts`` (kfac's share_by):
    its own part to an allgather; the whole zero-padded buffer (in int32 words of fp32 elements) to a sum; its own
    part to scatter's alltoall, then one equal chunk, ceil(Σ / W), to its allgather."""
    if len(parts) < 2:
        return 0
    rule = share_by(parts)
    if rule == "allgather":
        return parts[member]
    if rule == "scatter":
        return parts[member] + scatter_chunk(tuple(parts))
    return sum(parts)


@cache
def scatter_chunk(parts: tuple[int, ...]) -> int:
    """The equal chunk scatter's allgather hands on (kfac's chunk_overlaps), kept: the price of every design at
    every scale asks it of the same few part lists, and each answer walks every element."""
    return chunk_overlaps(parts)[1]


def factor_elements(layers: Layers) -> int:
    """Elements of one round of factor statistics: both factors' upper triangles and two counts per layer."""
    return sum(upper_size(x) + upper_size(y) + 2 for x, y in zip(layers.a_dims, layers.g_dims, strict=True))


def kfac_round_bytes(layers: Layers, world: int, fraction: float, rank: int = 0,
                     method: str = "eigen") -> dict[str, int]:
    """Payload bytes ``rank`` hands to collectives in one round of each kind (fp32):

    factors: the upper triangles of both factors and two counts of every layer, in bucketed allreduces;
    decompositions: one collective in the rank's worker group sharing the decompositions of the factors each
    member owns, in ``method``'s wire form (eigen: eigenvectors and eigenvalues; inverse, newton: the inverses'
    upper triangles); directions (fraction < 1): one collective in the rank's receiver block sharing the
    preconditioned gradients of the layers each member is the grad worker for.
    """
    out = dict(factors=factor_elements(layers) * FP32)
    for kind, groups in member_parts(layers, world, fraction, method).items():
        group = next(k for k, grp in enumerate(_groups(world, fraction, kind)) if rank in grp)
        members = _groups(world, fraction, kind)[group]
        out[kind] = handed_elements(groups[group], members.index(rank)) * FP32
    return out


def _groups(world: int, fraction: float, kind: str) -> list[tuple[int, ...]]:
    work = assign_work([1], [1], world, fraction)  # the groups depend on the world and the fraction only
    return work.worker_groups() if kind == "decompositions" else work.receiver_blocks()


# ---- the alpha-beta model of one step's collectives ---------------------------------------------------------
# Each backend's algorithms, with a message of n bytes between two ranks costing alpha + n/B:
#   MPI (Horovod on CPUs, Open MPI's tuned collectives): broadcast = the better of a binomial tree and
#     scatter + allgather; allgatherv = ring, whose every step waits for the largest part; allreduce = ring.
#   NCCL (GPUs): broadcast = a pipelined ring (p-1 hops of latency, the bytes once); allgather = ring over parts
#     padded to the largest; allreduce = ring.
# "broadcasts": K-FAC before one collective per group: every member of a group broadcasts its part in turn
# (a member without one still broadcasts one number); "one collective": kfac's share_by (allgather, sum, or
# scatter: an alltoall then an allgather of equal chunks).

BACKENDS = ("mpi", "nccl")


def broadcast_seconds(model: AlphaBeta, nbytes: float, ranks: int, backend: str = "mpi") -> float:
    if ranks < 2:
        return 0.0
    if backend == "nccl":
        return (ranks - 1) * model.alpha + nbytes / model.bandwidth
    steps = math.ceil(math.log2(ranks))
    tree = steps * (model.alpha + nbytes / model.bandwidth)
    scatter_allgather = (steps + ranks - 1) * model.alpha + 2 * (ranks - 1) / ranks * nbytes / model.bandwidth
    return min(tree, scatter_allgather)


def share_seconds(model: AlphaBeta, parts_bytes: Sequence[float], design: str, backend: str = "mpi",
                  element_bytes: int = FP32) -> float:
    """Seconds to give every member of one group every other member's part (``element_bytes`` a shared element:
    kfac's share_by decides in elements). Scatter is a pairwise-exchange alltoall (p-1 steps; the link of the
    largest part's owner carries it), then a ring allgather of p equal chunks."""
    p = len(parts_bytes)
    if p < 2:
        return 0.0
    if design == "broadcasts":
        return sum(broadcast_seconds(model, max(FP32, n), p, backend) for n in parts_bytes)
    rule = share_by([int(n) // element_bytes for n in parts_bytes])
    if rule == "allgather":
        return (p - 1) * (model.alpha + max(parts_bytes) / model.bandwidth)
    if rule == "scatter":
        chunk_bytes = scatter_chunk(tuple(int(n) // element_bytes for n in parts_bytes)) * element_bytes
        alltoall = (p - 1) * model.alpha + max(parts_bytes) / model.bandwidth
        return alltoall + (p - 1) * (model.alpha + chunk_bytes / model.bandwidth)
    return model.ring_seconds(sum(parts_bytes), p)


def step_seconds(model: AlphaBeta, layers: Layers, world: int, fraction: float, factor_every: int,
                 inverse_every: int, design: str = "one collective", backend: str = "mpi",
                 share_bytes: int = FP32, factor_bytes: int = FP32,
                 parts: dict[str, list[list[int]]] | None = None) -> dict[str, float]:
    """Seconds per optimizer step of each kind of collective, none overlapped with anything. Groups of one kind
    run side by side on disjoint ranks, so a round costs its slowest group. ``share_bytes``: bytes per shared
    element (2 for --kfac-comm-precision bf16); ``factor_bytes``: per summed factor element (2 for
    --kfac-factor-precision bf16, whose exact counts, 2 per layer, take one small allreduce more: recursive
    doubling, the latency-bound algorithm MPI and NCCL's tree use at that size). ``parts``: member_parts of this
    world and fraction, when the caller prices several designs of one (it walks kfac's whole work assignment)."""
    factors = factor_elements(layers) * factor_bytes
    by_kind = parts or member_parts(layers, world, fraction)
    shared = {kind: max(share_seconds(model, [n * share_bytes for n in parts], design, backend, share_bytes)
                        for parts in groups)
              for kind, groups in by_kind.items()}
    counts = 0.0
    if factor_bytes != FP32 and world > 1:
        counts = math.ceil(math.log2(world)) * (model.alpha + 2 * len(layers.a_dims) * FP32 / model.bandwidth)
    # The per-layer factors travel in buckets, priced as one ring of all their bytes: the buckets' own latencies
    # overlap backward (kfac.exchange starts each as soon as backward has passed its layers).
    return dict(gradients=model.ring_seconds(layers.parameters * FP32, world),
                factors=(model.ring_seconds(factors, world) + counts) / factor_every,
                decompositions=shared["decompositions"] / inverse_every, directions=shared["directions"])


# ---- 1. count ---------------------------------------------------------------------------------------------------


def mnist_layers() -> Layers:
    from hpcdl.training.models import build_model

    return Layers.of(build_model("mnist_cnn", 10, 1))


def count(args: argparse.Namespace) -> dict[str, Any]:
    """Short real runs per fraction; each rank's counts beside the byte model's."""
    from hpcdl.training.config import parse_config

    preset = parse_config(["--kfac-preset", "large-batch"])
    layers, runs = mnist_layers(), []
    for fraction in args.fractions:
        folder = args.scratch / f"f{fraction:g}"
        folder.mkdir(parents=True, exist_ok=True)
        train = [*CELL, "--epochs", "1", "--max-steps", str(args.steps), "--data-dir", str(args.data_dir),
                 "--kfac-grad-worker-fraction", repr(fraction), "--kfac-impl", "kfac_traffic:counted",
                 "--output-dir", str(folder / "run")]
        where = ["--vcluster", args.vcluster] if args.vcluster else []  # virtual nodes: over their shaped links
        command = ["bash", str(REPO / "launch" / "mpirun.sh"), *where, "-np", str(args.ranks), "--threads", "1",
                   "--mpi-args=-x KFAC_TRAFFIC_DIR", "--", *train]
        env = dict(os.environ, KFAC_TRAFFIC_DIR=str(folder), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO / "benchmarks"), str(REPO)]))
        print(f"[count] fraction {fraction:g}: {args.ranks} ranks, {args.steps} steps", flush=True)
        done = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            tail = [line for line in (done.stdout + done.stderr).splitlines() if line.strip(" -")][-1:]
            raise UsageError(f"the counted run (fraction {fraction:g}) failed: {' '.join(tail)}")
        summary = json.loads((folder / "run" / "summary.json").read_text())
        seconds_per_step = summary["train_seconds"] / summary["global_steps"]
        for rank in range(args.ranks):
            counts = json.loads((folder / f"rank{rank}.json").read_text())
            model = kfac_round_bytes(layers, args.ranks, fraction, rank)
            runs.append(dict(fraction=fraction, rank=rank, steps=counts["steps"], counted=counts["tally"],
                             gradient_bytes=counts["gradient_bytes"], model_round_bytes=model,
                             seconds_per_step=seconds_per_step))
    return dict(kind="count", ranks=args.ranks, steps=args.steps, vcluster=args.vcluster, load=os.getloadavg()[0],
                layers=dict(a_dims=layers.a_dims, g_dims=layers.g_dims, parameters=layers.parameters),
                factor_every=preset.kfac_factor_update_freq, inverse_every=preset.kfac_inv_update_freq, runs=runs)


def check_counts(report: dict[str, Any]) -> list[str]:
    """Where the byte model and the counts disagree (per round of each kind), as lines; none when they agree."""
    wrong = []
    for run in report["runs"]:
        for kind in KINDS:
            tally = run["counted"].get(kind, dict(bytes=0, rounds=0))
            per_round = tally["bytes"] / tally["rounds"] if tally["rounds"] else 0
            if per_round != run["model_round_bytes"][kind]:
                wrong.append(f"fraction {run['fraction']:g} rank {run['rank']} {kind}: counted {per_round:.0f} B a "
                             f"round, the model says {run['model_round_bytes'][kind]}")
    return wrong


# ---- 2. measure (under mpirun, on the network to model) --------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """Fit alpha and B to Horovod allreduces; then time K-FAC's own per-step collectives, held out of the fit."""
    import horovod.torch as hvd

    hvd.init()
    world, rank = hvd.size(), hvd.rank()
    if world < 2:
        raise UsageError("measure times collectives between ranks and was started as one process; run it under a "
                         "launcher: PYTHONPATH=benchmarks launch/mpirun.sh -np 4 --entry kfac_traffic -- measure")
    torch.set_num_threads(1)

    def timed(run: Any, repeats: int) -> float:
        run()  # warm: Horovod negotiates a new name once
        hvd.allreduce(torch.zeros(1), name="barrier")
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        return float(hvd.allreduce(torch.tensor(best), op=hvd.Max, name="max").item())  # the slowest rank

    sizes = [2**k for k in range(12, 25, 2)]  # 4 KiB .. 16 MiB
    fit_rows = []
    for nbytes in sizes:
        buffer = torch.zeros(nbytes // FP32)
        fit_rows.append((nbytes, timed(lambda b=buffer, n=nbytes: hvd.allreduce_(b, name=f"fit.{n}"), args.repeats)))
    fitted = fit_ring([n for n, _ in fit_rows], [t for _, t in fit_rows], world)

    layers = mnist_layers()
    factor_buffer = torch.zeros(kfac_round_bytes(layers, world, 1.0, rank)["factors"] // FP32)  # one bucket
    parts = member_parts(layers, world, 1.0)["decompositions"][0]  # fraction 1: one group of every rank
    mine = torch.zeros(parts[rank])
    gathered = torch.zeros(sum(parts))

    def factors() -> None:  # a factor update: the bucketed allreduce of every layer's statistics
        hvd.synchronize(hvd.allreduce_async_(factor_buffer, name="kfac.factors.0", op=hvd.Sum))

    def broadcasts() -> None:  # the former sharing: every rank broadcasts its decompositions in turn
        handles = [hvd.broadcast_async_(torch.zeros(max(1, n)) if root != rank else mine.clone() if n else
                                        torch.zeros(1), root, name=f"kfac.decompositions.{root}")
                   for root, n in enumerate(parts)]
        for handle in handles:
            hvd.synchronize(handle)

    overlaps, chunk = chunk_overlaps(parts)
    chunk_buffer = torch.zeros(chunk)

    def one_collective() -> None:  # the sharing now: kfac's share_by for these parts
        rule = share_by(parts)
        if rule == "allgather":
            hvd.synchronize(hvd.allgather_async(mine, name="kfac.decompositions"))
        elif rule == "scatter":
            splits = torch.tensor(overlaps[rank], dtype=torch.int32)
            hvd.synchronize(hvd.alltoall_async(mine, splits=splits, name="kfac.decompositions"))
            hvd.synchronize(hvd.allgather_async(chunk_buffer, name="kfac.decompositions.chunks"))
        else:
            hvd.synchronize(hvd.allreduce_async_(gathered.view(torch.int32), name="kfac.decompositions",
                                                 op=hvd.Sum))

    held_out = dict(factors=timed(factors, args.repeats), broadcasts=timed(broadcasts, args.repeats),
                    one_collective=timed(one_collective, args.repeats))
    parts_bytes = [n * FP32 for n in parts]
    predicted = dict(factors=fitted.ring_seconds(factor_buffer.numel() * FP32, world),
                     broadcasts=share_seconds(fitted, parts_bytes, "broadcasts"),
                     one_collective=share_seconds(fitted, parts_bytes, "one collective"))
    hvd.shutdown()
    if rank != 0:
        return None
    return dict(kind="measure", world=world, fit_rows=fit_rows, alpha=fitted.alpha, bandwidth=fitted.bandwidth,
                parts_bytes=parts_bytes, share_by=share_by(parts), held_out=held_out, predicted=predicted,
                error={k: (predicted[k] - held_out[k]) / held_out[k] for k in held_out},
                load=os.getloadavg()[0])


# ---- 3. predict --------------------------------------------------------------------------------------------------


def resnet50_layers() -> Layers:
    from torchvision.models import resnet50

    return Layers.of(resnet50())


# Frequencies (factor updates, decompositions) priced at scale: the large-batch preset's (every step) and
# kfac-pytorch's ImageNet defaults (factors every 10 steps, decompositions every 100).
FREQUENCIES = ((1, 1), (10, 100))
# How K-FAC shares, as priced: (design, backend, bytes per shared element, bytes per summed factor element).
# bf16 factor sums are a torch.distributed feature (Horovod 0.28 cannot sum bfloat16).
VARIANTS = (("broadcasts", "mpi", FP32, FP32), ("broadcasts", "nccl", FP32, FP32),
            ("one collective", "mpi", FP32, FP32), ("one collective", "mpi", 2, FP32), ("one collective", "mpi", 2, 2))


def predict(args: argparse.Namespace) -> dict[str, Any]:
    """K-FAC's and the gradients' seconds per step for ResNet-50 at 64-1,024 ranks: each sharing design and
    backend, fraction 1, 1/8 and 1/world (one grad worker per layer: decompositions never travel), fp32 and
    bf16 payloads, at both FREQUENCIES."""
    networks = {"HDR100 InfiniBand (100 Gbit/s, 1 us)": network(100, 1.0)}
    if args.measured:
        fit = json.loads(args.measured.read_text())
        networks["fitted on the virtual 1 Gbit/s link"] = AlphaBeta(fit["alpha"], fit["bandwidth"])
    layers, rows = resnet50_layers(), []
    for name, model in networks.items():
        for ranks in RANKS_AT_SCALE:
            for fraction in (1.0, 1 / 8, 1 / ranks):
                parts = member_parts(layers, ranks, fraction)
                for factor_every, inverse_every in FREQUENCIES:
                    for design, backend, share_bytes, factor_bytes in VARIANTS:
                        seconds = step_seconds(model, layers, ranks, fraction, factor_every, inverse_every, design,
                                               backend, share_bytes, factor_bytes, parts)
                        rows.append(dict(network=name, ranks=ranks, fraction=fraction, factor_every=factor_every,
                                         inverse_every=inverse_every, design=design, backend=backend,
                                         payload="bf16" if share_bytes == 2 else "fp32",
                                         factor_payload="bf16" if factor_bytes == 2 else "fp32", seconds=seconds))
    owners = sum(1 for parts in member_parts(layers, 1024, 1.0)["decompositions"] for n in parts if n)
    return dict(kind="predict", layers=len(layers.a_dims), parameters=layers.parameters, owners_at_1024=owners,
                rows=rows)


# ---- the command line ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = RankZeroParser(prog="benchmarks/kfac_traffic.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="phase", required=True, parser_class=RankZeroParser)
    c = sub.add_parser("count", help="counted real runs beside the byte model")
    c.add_argument("--ranks", type=integer(2), default=4)
    c.add_argument("--fractions", type=real(0, low_open=True, high=1), nargs="+", default=[1.0, 0.5, 0.25],
                   help="grad-worker fractions (k/ranks, k dividing ranks)")
    c.add_argument("--steps", type=integer(2), default=6)
    c.add_argument("--data-dir", type=Path, default=DEFAULT_OUTPUT)  # hpcdl.fetch_mnist's folder
    c.add_argument("--timeout", type=real(0, low_open=True), default=900.0, help="seconds per counted run")
    c.add_argument("--vcluster", help="run on this virtual cluster (launch/mpirun.sh --vcluster): seconds per step "
                                      "over its links besides the bytes")
    m = sub.add_parser("measure", help="(under mpirun) fit alpha-beta, time K-FAC's collectives held out")
    m.add_argument("--repeats", type=integer(1), default=5)
    p = sub.add_parser("predict", help="ResNet-50 at 64-1,024 ranks")
    p.add_argument("--measured", type=Path, help="a measure phase's .json (its fitted alpha and B)")
    for each in (c, m, p):
        each.add_argument("--out", type=Path, help="results path without suffix (default runs/bench/...)")
        outputs.add_arguments(each)
    args = parser.parse_args(argv)
    if args.phase == "count":
        from studies import check_launch

        for fraction in args.fractions:
            if abs(fraction * args.ranks - round(fraction * args.ranks)) > 1e-9 or args.ranks % round(
                    fraction * args.ranks):
                raise UsageError(f"--fractions: {fraction:g} x {args.ranks} ranks is not a whole divisor of the ranks")
        check_launch(args.ranks, args.vcluster)  # a virtual cluster that is not there: one line, before any run
        check_mnist(args.data_dir)
    if args.phase == "predict" and args.measured:
        check_measured(args.measured)
    return args


def check_measured(path: Path) -> None:
    """UsageError (one line) unless ``path`` is a measure phase's results file (its fitted alpha and B)."""
    if not path.is_file():
        raise UsageError(f"--measured: no such file {path}")
    try:
        fit = json.loads(path.read_text())
        usable = fit.get("kind") == "measure" and all(float(fit[key]) > 0 for key in ("alpha", "bandwidth"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        usable = False
    if not usable:
        raise UsageError(f"--measured {path} is not the results of the measure phase (a JSON with kind \"measure\" "
                         "and a fitted alpha and bandwidth)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    comm = None
    if args.phase == "measure":  # under mpirun: rank 0 decides where, every rank learns it
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    stem = outputs.results_stem(args.out, f"kfac_traffic_{args.phase}", (".json",),
                                refresh_results=args.refresh_results, force=args.force, flag="--out", comm=comm)
    if args.phase == "count":
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kfac_traffic-") as tmp:
            args.scratch = Path(tmp)
            report = count(args)
        wrong = check_counts(report)
        report["model_equals_counts"] = not wrong
        print("\n".join(wrong) or "the byte model equals every counted round, every rank and fraction")
    elif args.phase == "measure":
        report = measure(args)
        if report is None:
            return 0
        print(f"alpha {report['alpha'] * 1e6:.0f} us, B {report['bandwidth'] / 1e6:.0f} MB/s; held out "
              + ", ".join(f"{k} {report['held_out'][k] * 1e3:.1f} ms measured, {report['predicted'][k] * 1e3:.1f} "
                          f"predicted" for k in report["held_out"]))
    else:
        report = predict(args)
        for row in report["rows"]:
            print(f"{row['network'][:12]:12s} {row['ranks']:5d} ranks f={row['fraction']:<6.3g} "
                  f"({row['factor_every']},{row['inverse_every']}) {row['design']:14s} {row['backend']:4s} "
                  f"{row['payload']} factors {row['factor_payload']} "
                  + "  ".join(f"{k} {v * 1e3:7.1f} ms" for k, v in row["seconds"].items()))
    print(f"wrote {save_json(stem, report)}")
    return 0


# ---- the figures the documents quote (benchmarks/figures.py) -------------------------------------------

def _kb(nbytes: float) -> str:
    return f"{nbytes / 1024:,.0f}"


def _bytes() -> str:
    """Per grad-worker fraction, rank 0's payload bytes per step of each kind (counted), and seconds per step."""
    rows = []
    for run in (x for x in results("kfac_traffic_count")["runs"] if x["rank"] == 0):
        per_step = {k: v["bytes"] / run["steps"] for k, v in run["counted"].items()}
        rows.append((f"{run['fraction']:g}", _kb(run["gradient_bytes"]), _kb(per_step.get("factors", 0)),
                     _kb(per_step.get("decompositions", 0)), _kb(per_step.get("directions", 0)),
                     times(sum(per_step.values()) / run["gradient_bytes"], 1), f"{1000 * run['seconds_per_step']:.0f}"))
    return table(["grad-worker fraction", "gradients KiB / step", "K-FAC factors", "decompositions",
                  "preconditioned gradients", "K-FAC / gradients", "ms / step"], rows)


def _model_check() -> str:
    r = results("kfac_traffic_count")
    fractions = sorted({run["fraction"] for run in r["runs"]}, reverse=True)
    verdict = "equals" if r["model_equals_counts"] else "does NOT equal"
    return (f"{verdict} the counted bytes of every collective round on each of the {r['ranks']} ranks, at fractions "
            + ", ".join(f"{f:g}" for f in fractions))


def _measures() -> list[Any]:
    return [results(f"kfac_traffic_measure_{n}") for n in (2, 3, 4)]


def _held_out() -> str:
    """Per cluster size measured (one rank per virtual node), each held-out collective: measured, predicted."""
    names = {"factors": "factors", "broadcasts": "decompositions, one broadcast per rank",
             "one_collective": "decompositions, one collective"}
    rows = [(m["world"], label, f"{1000 * m['held_out'][kind]:.1f}", f"{1000 * m['predicted'][kind]:.1f}",
             f"{100 * m['error'][kind]:+.0f} %") for m in _measures() for kind, label in names.items()]
    return table(["nodes x 1 rank", "collective (held out)", "measured ms", "predicted ms", "error"], rows)


def _fit() -> str:
    return "; ".join(f"{m['world']} nodes: α = {1e6 * m['alpha']:.0f} µs, B = {m['bandwidth'] / 1e6:.0f} MB/s"
                     for m in _measures())


def _ratio1() -> str:
    """K-FAC's payload bytes per step over the gradients', fraction 1, rank 0."""
    run = next(x for x in results("kfac_traffic_count")["runs"] if x["rank"] == 0 and x["fraction"] == 1.0)
    return times(sum(v["bytes"] for v in run["counted"].values()) / run["steps"] / run["gradient_bytes"], 1)


def _predicted(ranks: int, frequencies: tuple[int, int]) -> list[dict[str, Any]]:
    return [r for r in results("kfac_traffic_predict")["rows"] if r["ranks"] == ranks
            and r["network"].startswith("HDR") and (r["factor_every"], r["inverse_every"]) == frequencies]


def _kfac_ms(row: dict[str, Any]) -> float:
    return 1000 * sum(v for k, v in row["seconds"].items() if k != "gradients")


def _best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return min((r for r in rows if r["design"] == "one collective"), key=_kfac_ms)


def _fraction(value: float) -> str:
    """1, 1/8, 1/1024: the grad-worker fractions priced are all 1/k."""
    return "1" if value == 1 else f"1/{round(1 / value)}"


def _options(row: dict[str, Any]) -> str:
    factors = ", factor sums bf16" if row.get("factor_payload") == "bf16" else ""
    return f"fraction {_fraction(row['fraction'])}, {row['payload']}{factors}"


def _resnet1024() -> str:
    """ResNet-50 on HDR100 at 1,024 ranks, decompositions every step: the former design on NCCL, the best now."""
    rows = _predicted(1024, (1, 1))
    old = next(r for r in rows if r["design"] == "broadcasts" and r["backend"] == "nccl" and r["fraction"] == 1.0)
    best = _best(rows)
    grads = 1000 * best["seconds"]["gradients"]
    return (f"{_kfac_ms(old):.0f} ms a step before (fraction 1, NCCL), {_kfac_ms(best):.0f} ms now "
            f"({_options(best)}: {times(_kfac_ms(best) / grads, 3)} the gradients' {grads:.1f} ms)")


def _resnet1024_rare() -> str:
    """The same at kfac-pytorch's ImageNet frequencies (factors every 10 steps, decompositions every 100)."""
    best = _best(_predicted(1024, (10, 100)))
    grads = 1000 * best["seconds"]["gradients"]
    return f"{_kfac_ms(best):.1f} ms a step ({_options(best)}), {times(_kfac_ms(best) / grads)} the gradients'"


def _sharing(row: dict[str, Any]) -> str:
    if row["design"] == "broadcasts":
        return f"one broadcast per member ({'NCCL rings' if row['backend'] == 'nccl' else 'MPI trees'})"
    factors = ", factor sums bf16" if row.get("factor_payload") == "bf16" else ""
    return f"one collective per group, {row['payload']}{factors}"


def _resnet50() -> str:
    rows = []
    for row in results("kfac_traffic_predict")["rows"]:
        if row["network"].startswith("HDR") and row["ranks"] in (64, 1024):
            sec = row["seconds"]
            rows.append((row["ranks"], f"{row['factor_every']}, {row['inverse_every']}", _fraction(row["fraction"]),
                         _sharing(row), f"{1000 * sec['gradients']:.1f}", f"{1000 * sec['factors']:.1f}",
                         f"{1000 * sec['decompositions']:.1f}", f"{1000 * sec['directions']:.1f}",
                         times(_kfac_ms(row) / 1000 / sec["gradients"], 2)))
    return table(["ranks", "factors, decompositions every", "fraction", "sharing", "gradients ms", "factors ms",
                  "decompositions ms", "preconditioned gradients ms", "K-FAC / gradients"], rows)


FIGURES = {"traffic.bytes": _bytes, "traffic.model_check": _model_check, "traffic.heldout": _held_out,
           "traffic.fit": _fit, "traffic.ratio1": _ratio1, "traffic.resnet1024": _resnet1024,
           "traffic.resnet1024.rare": _resnet1024_rare, "traffic.resnet50": _resnet50}


if __name__ == "__main__":
    run_main(main, program="kfac_traffic")
