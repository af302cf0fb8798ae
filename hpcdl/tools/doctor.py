"""Environment doctor: the check to run before burning an allocation.

    python -m hpcdl.doctor                      # one process: versions, builds, MPI, devices
    mpirun -np 4 python -m hpcdl.doctor         # plus one row per rank (host, ranks, device)
    srun -n 8 --mpi=pmix python -m hpcdl.doctor --expect-gpu

Exits 0 when the environment can run hpcdl, otherwise non-zero with a one-line reason and the fix.
Each check is a small function returning facts or raising Problem, so tests can call them alone.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdl.runtime import launcher, placement
from hpcdl.tools import nodes

SETUP_HINT = "bash scripts/setup.sh"
THREAD_LEVELS = {0: "SINGLE", 1: "FUNNELED", 2: "SERIALIZED", 3: "MULTIPLE"}


class Problem(Exception):
    """A broken environment: a one-line reason and the fix."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason} -- fix: {fix}")
        self.reason = reason
        self.fix = fix


@dataclass
class Row:
    name: str
    value: str


def version_of(module: str) -> str:
    """The module's __version__, or 'missing'."""
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:
        return "missing"


def horovod_installed() -> bool:
    """Whether Horovod is installed at all (a setup with HPCDL_HOROVOD=0 has only the torch backend)."""
    return importlib.util.find_spec("horovod") is not None


def horovod_build() -> dict[str, list[str]] | None:
    """What Horovod was built with, as `horovodrun --check-build` reports it; None where it is not installed.

    Raises Problem in the silent failure case: `import horovod.torch` works but its compiled
    extension is absent (it only prints "MPI libs are missing"), so hvd.init does not exist.
    """
    if not horovod_installed():
        return None
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise Problem(f"Horovod does not import ({exc})", SETUP_HINT) from exc
    if not hasattr(hvd, "init"):
        raise Problem(
            "Horovod's compiled extension is missing (import prints 'MPI libs are missing')",
            f"rebuild Horovod against this torch and MPI: {SETUP_HINT}",
        )
    controllers = [name for name, built in (("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built())) if built]
    operations = [
        name
        for name, built in (
            ("NCCL", hvd.nccl_built()),
            ("MPI", hvd.mpi_built()),
            ("Gloo", hvd.gloo_built()),
            ("CCL", hvd.ccl_built()),
        )
        if built
    ]
    return {"controllers": controllers, "operations": operations}


def import_mpi4py():
    """mpi4py's MPI module (initialises MPI), or Problem when mpi4py is missing or broken."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise Problem(
            f"mpi4py is missing or does not load ({exc})",
            f"{SETUP_HINT} (it builds mpi4py against the MPI on PATH)",
        ) from exc
    return MPI


def _linked_mpi(shared_object: str) -> str | None:
    """The libmpi a shared object resolves to, through ldd (None if it links none)."""
    try:
        out = subprocess.run(["ldd", shared_object], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        match = re.match(r"\s*(libmpi\.so[.\d]*)\s*=>\s*(\S+)", line)
        if match:
            return os.path.realpath(match.group(2))
    return None


def mpi_libraries() -> dict[str, str | None]:
    """The libmpi that Horovod's extension (where installed) and mpi4py each link against."""
    import mpi4py.MPI

    hvd_ext: list[Path] = []
    if horovod_installed():
        import horovod.torch

        hvd_ext = sorted(Path(horovod.torch.__file__).parent.glob("mpi_lib_v2*.so"))
    return {
        "horovod": _linked_mpi(str(hvd_ext[0])) if hvd_ext else None,
        "mpi4py": _linked_mpi(mpi4py.MPI.__file__),
    }


def check_same_mpi(libs: dict[str, str | None]) -> None:
    """Raise Problem when Horovod and mpi4py use different MPI libraries (a silent-hang recipe)."""
    if libs["horovod"] and libs["mpi4py"] and libs["horovod"] != libs["mpi4py"]:
        raise Problem(
            f"Horovod uses {libs['horovod']} but mpi4py uses {libs['mpi4py']}",
            f"load one MPI module, then rebuild both with {SETUP_HINT}",
        )


# What a launcher says the job's size is. If MPI sees one process while the launcher started
# several, each rank started alone: the MPI library in use is not the launcher's.
LAUNCHER_SIZE_VARS = launcher.SIZE_VARS


def check_launcher_agrees(world_size: int, env: dict[str, str] | None = None) -> None:
    """Raise Problem for the classic 'every rank is rank 0 of 1' mismatch."""
    env = dict(os.environ) if env is None else env
    alone = launcher.started_alone(world_size, env)
    if alone is not None:
        inside = image_labels().get("hpcdl.mpi.family") if env.get("HPCDL_IN_CONTAINER") == "1" else None
        where = (f"; the image's MPI is {inside}, the launcher is {launcher_outside(env)}" if inside else "")
        raise Problem(f"{alone}{where}", launcher.SAME_MPI_FIX)


# ---------------------------------------------------------------- inside an image

IMAGE_FILE = Path("/opt/hpcdl/image")  # written by the image build (make image): kind, environment and source keys
IMAGE_SOURCE = Path("/opt/hpcdl/src")  # the source the image was built from (its own hpcdl)
LABELS_FILE = Path("/opt/hpcdl/labels")  # written by the image's install step: MPI family and versions


def image_labels(path: Path = LABELS_FILE) -> dict[str, str]:
    """The image's labels ('hpcdl.mpi.family' -> 'openmpi', ...), empty outside an hpcdl image."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(" ", 1) for line in lines if " " in line)


def launcher_outside(env: dict[str, str]) -> str:
    """Which launcher started this process, from the variables each one sets (its family is what
    must match the image's MPI)."""
    if env.get("OMPI_COMM_WORLD_SIZE"):
        return f"Open MPI mpirun ({env.get('HPCDL_HOST_MPI') or 'version not passed on'})"
    if env.get("PMIX_RANK") and env.get("SLURM_STEP_ID"):
        return "Slurm srun --mpi=pmix"
    if env.get("PMI_RANK") or env.get("PMI_SIZE"):
        return "MPICH-family (PMI: mpiexec.hydra, Intel MPI, MVAPICH2, ibrun)"
    if env.get("SLURM_STEP_ID"):
        return "Slurm srun without an MPI plugin (--mpi=pmix missing?)"
    return "none (one process)"


def container_rows(env: dict[str, str], mpi_library: str, world_size: int,
                   image_file: Path = IMAGE_FILE, labels_file: Path = LABELS_FILE) -> list[Row]:
    """Which image, which MPI inside and which launcher outside, and whether they talk; [] on the host."""
    if env.get("HPCDL_IN_CONTAINER") != "1":
        return []
    try:
        image = image_file.read_text().strip()
    except OSError:
        image = env.get("HPCDL_IMAGE_KIND", "an hpcdl image without /opt/hpcdl/image")
    labels = image_labels(labels_file)
    inside = labels.get("hpcdl.mpi.family", "?")
    launched = launcher.first_number(LAUNCHER_SIZE_VARS, env)
    talk = (f"yes: MPI sees the {world_size} rank(s) the launcher started" if launched in (None, world_size)
            else f"NO: the launcher started {launched}, MPI sees {world_size}")
    return [
        Row("image", image),
        *code_rows(env, Path(__file__).resolve().parents[2]),
        Row("MPI inside", f"{inside}: {mpi_library}"),
        Row("launcher outside", launcher_outside(env)),
        Row("inside and outside talk", talk),
    ]


def image_folders(image_source: Path = IMAGE_SOURCE) -> list[str]:
    """The files and folders the image's source was copied from (the build's list, read off the copy itself)."""
    return sorted(p.name for p in image_source.iterdir())


def source_key(root: Path, folders: Sequence[str]) -> str:
    """The key the image build gives the source under ``root`` before it mixes in the mount points: the first 8
    hex digits of the sha256 of ``sha256sum``'s lines for every file of ``folders`` (caches left out), in byte
    order of their paths."""
    paths = []
    for name in folders:
        top = root / name
        found = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()] if top.is_dir() else []
        paths += [p.relative_to(root).as_posix() for p in found
                  if "__pycache__" not in p.relative_to(root).parts and p.suffix != ".pyc"]
    lines = "".join(f"{hashlib.sha256((root / path).read_bytes()).hexdigest()}  {path}\n"
                    for path in sorted(paths, key=lambda text: text.encode()))
    return hashlib.sha256(lines.encode()).hexdigest()[:8]


def code_rows(env: dict[str, str], running: Path, image_source: Path = IMAGE_SOURCE) -> list[Row]:
    """Which hpcdl runs inside the image and from where (the image's entry decides: its own unless
    HPCDL_CODE asks for a checkout), and whether its source is the one the image was built from."""
    chosen = env.get("HPCDL_CODE_CHOSEN", "")
    own = running.resolve() == image_source.resolve()
    why = ("the image's own (default)" if own else f"a checkout, asked for by HPCDL_CODE={env.get('HPCDL_CODE', '')}"
           if chosen and chosen != "image" else "a checkout NOT asked for (PYTHONPATH or the working folder "
           "shadows the image's; unset them, or say HPCDL_CODE=checkout)")
    rows = [Row("hpcdl runs from", f"{running} ({why})")]
    if own:
        return rows
    if not image_source.is_dir():
        return [*rows, Row("its source", f"no {image_source} in this image to compare it with")]
    try:
        folders = image_folders(image_source)
        mine, image = source_key(running, folders), source_key(image_source, folders)
    except OSError as exc:
        return [*rows, Row("its source", f"cannot compare with the image's ({exc.strerror or exc})")]
    rows.append(Row("its source", f"the image's (key {image})" if mine == image else
                    f"DIFFERS from the image's (key {mine}, the image was built from {image}): new code on the "
                    "image's older dependencies; rebuild the image (make image) or run the image's own"))
    return rows


def cuda_devices() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def nccl_code_version(code: int) -> str:
    """NCCL_VERSION_CODE as a version: 22907 -> 2.29.7 (codes below 2.9 were major*1000+minor*100+patch)."""
    if code <= 0:
        return "not built"
    if code >= 20900:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def torch_stack() -> dict[str, str]:
    """Which torch this run uses (a venv's, a site module's, a container's) and its CUDA and NCCL."""
    import torch

    facts = {
        "torch": f"{torch.__version__} ({Path(torch.__file__).parent})",
        "torch CUDA": torch.version.cuda or "none (CPU build)",
        "NCCL (torch)": "none",
    }
    if torch.version.cuda:
        try:
            facts["NCCL (torch)"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - a report, not a check
            facts["NCCL (torch)"] = f"unknown ({type(exc).__name__})"
    return facts


def torch_distributed_backends() -> str:
    """The collective backends this torch was built with (hpcdl.train --backend torch takes NCCL on GPUs, Gloo on
    CPUs)."""
    import torch.distributed as dist

    if not dist.is_available():
        return "none (torch built without distributed)"
    return ", ".join(name for name, built in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                               ("mpi", dist.is_mpi_available())) if built) or "none"


def nccl_network_plugin(env: dict[str, str] | None = None) -> str:
    """The NCCL network plugin NCCL would load (NCCL_NET_PLUGIN, else a libnccl-net.so on the library path):
    the fabric's own (aws-ofi-nccl on Slingshot/EFA, ...) or, without one, NCCL's built-in IB and sockets."""
    env = dict(os.environ) if env is None else env
    if env.get("NCCL_NET_PLUGIN"):
        return f"NCCL_NET_PLUGIN={env['NCCL_NET_PLUGIN']}"
    for folder in filter(None, env.get("LD_LIBRARY_PATH", "").split(os.pathsep)):
        found = sorted(Path(folder).glob("libnccl-net*.so*")) if Path(folder).is_dir() else []
        if found:
            return str(found[0])
    return "none (NCCL's built-in IB and sockets)"


def check_torch_distributed(world: Any, comm: Any) -> str:
    """Start torch.distributed from MPI's ranks as ``hpcdl.train --backend torch`` does and sum one number over
    every rank; the row's value, or Problem (on every rank: the verdicts are gathered over MPI)."""
    import torch
    import torch.distributed as dist

    from hpcdl.runtime import rendezvous

    error = None
    try:
        backend = rendezvous.init_process_group(comm, world.device, timeout_seconds=60)
        ones = torch.ones(1, device=world.device)
        dist.all_reduce(ones)
        if int(ones.item()) != world.size:
            error = f"an allreduce of ones over {world.size} ranks gave {ones.item():g}"
    except Exception as exc:  # noqa: BLE001 - any failure is the diagnosis
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    failures = [(rank, e) for rank, e in enumerate(comm.allgather(error)) if e]
    if failures:
        rank, what = failures[0]
        raise Problem(f"torch.distributed does not reach every rank (rank {rank}: {what})",
                      "check that every node reaches rank 0's on the job's interface (GLOO_SOCKET_IFNAME / "
                      "NCCL_SOCKET_IFNAME), or train with hpcdl.train --backend horovod")
    return f"{backend}: allreduce over {world.size} rank(s) ok"


def horovod_nccl() -> str:
    """The NCCL version Horovod was compiled against (hvd.nccl_built() returns NCCL_VERSION_CODE)."""
    if not horovod_installed():
        return "not installed"
    import horovod.torch as hvd

    return nccl_code_version(int(hvd.nccl_built()))


def print_table(title: str, rows: Sequence[Row]) -> None:
    width = max(len(r.name) for r in rows)
    print(f"\n{title}")
    for row in rows:  # printable only: Open MPI's library version ends in a NUL byte, which makes logs "binary"
        print(f"  {row.name:<{width}}  {''.join(c for c in row.value if c.isprintable()).strip()}")


def print_ranks(rows: Sequence[placement.RankRow], extras: Sequence[dict[str, Any]]) -> None:
    header = ("host", "rank", "local_rank", "local_size", "device", "threads", "cores", "CUDA_VISIBLE_DEVICES")
    table = [header] + [
        (r.host, str(r.rank), str(r.local_rank), str(r.local_size), r.device, str(x["threads"]),
         f"{r.affinity_cores}/{r.node_cores}", x["cuda_visible"])
        for r, x in zip(rows, extras, strict=True)
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    print("\nRanks")
    for line in table:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))


def check_nodes(comm) -> tuple[list[nodes.NodeFacts], bool]:
    """Node facts and the node-to-node reachability check, before MPI collectives or Horovod start
    (an unreachable node would hang them). Returns (facts on rank 0, whether a node is unreachable)."""
    if comm.Get_size() == 1:
        return [], False
    try:
        facts, failures = nodes.check(comm)
        verdict = nodes.from_root(comm, bool(failures) if comm.Get_rank() == 0 else None,
                                  time.monotonic() + nodes.EXCHANGE_TIMEOUT)
    except nodes.ExchangeTimeout as err:
        print(f"doctor: rank {comm.Get_rank()} on {platform.node()}: no answer when {err} within "
              f"{nodes.EXCHANGE_TIMEOUT:.0f} s -- fix: check that this node reaches rank 0's node on the job's "
              "interface (launch/mpirun.sh --iface)", file=sys.stderr, flush=True)
        comm.Abort(1)
        raise
    for line in failures:
        print(f"doctor: {line} -- fix: open TCP between the nodes on the job's interface, or choose another "
              "with launch/mpirun.sh --iface", file=sys.stderr, flush=True)
    return facts, bool(verdict)


def print_nodes(facts: Sequence[nodes.NodeFacts]) -> None:
    if not facts:
        return
    header = ("node", "interface", "address", "cores", "GPUs", "ranks")
    table = [header] + [(f.host, f.interface, f.address, str(f.cores), str(f.gpus), ",".join(map(str, f.ranks)))
                        for f in facts]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    print("\nNodes (every node reached every other over TCP)")
    for line in table:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))


def diagnose(expect_gpu: bool) -> int:
    """Run every check; rank 0 prints the tables. Returns the exit code."""
    MPI = import_mpi4py()
    build = horovod_build()
    libs = mpi_libraries()
    check_same_mpi(libs)
    node_rows, unreachable = check_nodes(MPI.COMM_WORLD)
    if unreachable:
        return 1

    from hpcdl.runtime import world as world_module

    world = world_module.init(use_horovod=build is not None)
    try:
        check_launcher_agrees(world.size)
    except Problem as problem:
        # Every rank is "rank 0 of 1" here: only the launcher's rank 0 says it, once.
        if not launcher.first_number(launcher.RANK_VARS):
            print(f"doctor: {problem}", file=sys.stderr)
        return 1
    comm = world_module.comm()
    rows = placement.gather_rows(world, comm)  # collective; a broken GPU becomes a row's `problem`
    try:
        reached = check_torch_distributed(world, comm)
    except Problem as problem:
        if world.rank == 0:
            print(f"doctor: {problem}", file=sys.stderr)
        return 1
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "-")
    extras = comm.gather({"threads": world.threads, "cuda_visible": visible}, root=0)
    if world.rank != 0:
        return int(comm.bcast(None, root=0))

    code = 0
    try:
        stack = torch_stack()
        print_table(
            "hpcdl environment",
            [
                Row("python", platform.python_version()),
                Row("torch", stack["torch"]),
                Row("torch CUDA", stack["torch CUDA"]),
                Row("NCCL (torch)", stack["NCCL (torch)"]),
                Row("NCCL (horovod)", horovod_nccl()),
                Row("NCCL network plugin", nccl_network_plugin()),
                Row("torch.distributed", torch_distributed_backends()),
                Row("torch.distributed reached", reached),
                Row("torchvision", version_of("torchvision")),
                Row("horovod", version_of("horovod") if build is not None else
                    "not installed (hpcdl.train --backend torch only; scripts/setup.sh builds it)"),
                Row("mpi4py", version_of("mpi4py")),
                *([Row("horovod controllers", ", ".join(build["controllers"]) or "none"),
                   Row("horovod tensor ops", ", ".join(build["operations"]) or "none")] if build else []),
                Row("MPI library", MPI.Get_library_version().splitlines()[0].strip()),
                Row("libmpi (horovod)", libs["horovod"] or "not linked"),
                Row("libmpi (mpi4py)", libs["mpi4py"] or "not linked"),
                Row("same MPI", "yes" if libs["horovod"] == libs["mpi4py"] else
                    "unknown" if build else "n/a (no Horovod)"),
                Row("MPI thread level", THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread()))),
                Row("CUDA devices", ", ".join(cuda_devices()) or "none (CPU)"),
                Row("world size", str(world.size)),
                *container_rows(dict(os.environ), MPI.Get_library_version().splitlines()[0].strip(), world.size),
            ],
        )
        print_nodes(node_rows)
        print_ranks(rows, extras)
        if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            raise Problem("MPI was initialised below THREAD_MULTIPLE", "use an MPI built with thread support")
        error = placement.placement_error(rows, gpu_requested=expect_gpu,
                                          without_gpu="check a CPU environment: leave out --expect-gpu and "
                                                      "HPCDL_EXPECT_GPU")
        if error:
            print(f"doctor: {error}", file=sys.stderr)
            return int(comm.bcast(1, root=0))
        for line in placement.placement_warnings(rows):
            print(f"doctor: warning: {line}", file=sys.stderr)
        print("\nok: this environment can run hpcdl")
    except Problem as problem:
        print(f"doctor: {problem}", file=sys.stderr)
        code = 1
    return int(comm.bcast(code, root=0))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcdl.doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--expect-gpu",
        action="store_true",
        default=os.environ.get("HPCDL_EXPECT_GPU") == "1",
        help="fail unless every rank sees a GPU and has one of its own (also HPCDL_EXPECT_GPU=1)",
    )
    args = parser.parse_args(argv)
    try:
        return diagnose(args.expect_gpu)
    except Problem as problem:
        # Found before any collective, identically on every rank: each rank exits by itself.
        print(f"doctor: {problem}", file=sys.stderr)
        return 1


def main_cli() -> None:
    """The command line: ``python -m hpcdl.doctor``."""
    sys.exit(main())
