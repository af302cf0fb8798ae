"""The words that start ONE rank, on the host or inside a container image; every launch script puts
its launcher (mpirun, srun, ibrun) in front of them:

    [apptainer|singularity exec [--nv] [--bind LIST] IMAGE] PYTHON -m ENTRY
    [ch-run --join ... -b ... --cd DIR IMAGE --] PYTHON -m ENTRY

A .sif image runs under Apptainer or Singularity; a directory or .sqfs file (what ``make image``
writes) under Charliecloud's ch-run. Everything that can be checked before the ranks start is:
the image, the runtime's program, the binds' sources, the working folder ch-run must bind, and the
image's MPI family against the launcher's. Standard library only (launch/common.sh runs it with
any python3).

What ch-run needs that Apptainer does not (Apptainer binds $HOME, /tmp and $PWD by itself, applies
the image's %environment, needs --nv for GPUs and no --join):
  --join          one container (user namespace) per node for all its ranks: ranks in different
                  namespaces cannot use the kernel's single-copy (CMA) between them, and Open MPI's
                  shared-memory messages of about 4 MiB and more hang (docs/cluster.md);
  --set-env       the image's environment (/ch/environment: its venv first on PATH);
  --unset-env     what must not leak in from the host: a venv's VIRTUAL_ENV, PYTHONPATH, PIP_*, ...;
  -b              binds: ch-run binds only /tmp (and /dev, /proc, /sys) by itself, and a bind's
                  destination must already exist in a read-only image: the working directory's top
                  folder is bound (make image makes /work, /scratch1, /home1, ...);
  --cd            the working directory; --home the host's $HOME at /home/$USER; $USER must be set.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# Container runtimes by name -> the program that runs an image. AUTO is tried in order when none is named.
RUNTIMES = {"apptainer": "apptainer", "singularity": "singularity", "charliecloud": "ch-run"}
AUTO_RUNTIMES = ("apptainer", "singularity")
# Host folders no bind may cover in an image: they are the image's own system.
IMAGE_SYSTEM_DIRS = {"bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "opt", "proc", "run", "sbin",
                     "sys", "usr", "var", "ch"}
CHRUN_UNSET = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PIP_*", "CONDA_*",
               "LD_LIBRARY_PATH", "LD_PRELOAD")


class LaunchError(ValueError):
    """A bad launcher argument or setting; the message is one line."""


def one_of(names: object) -> str:
    """'a, b or c'."""
    items = list(names)  # type: ignore[call-overload]
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else items[0]


@dataclass
class RankSettings:
    """What one rank runs and where (the options every launch script takes)."""

    python: str  # "" = the repository's .venv/bin/python (host) or python (image)
    entry: str
    image: str
    runtime: str  # "" = by the image's kind
    bind: str
    nv: str  # "1", "0" or "" (= when nvidia-smi exists)


@dataclass
class RankCommand:
    words: list[str]
    exports: dict[str, str] = field(default_factory=dict)  # what the launch must export (ch-run wants USER)


def image_kind(image: str) -> str:
    """'sif' (Apptainer/Singularity) or 'charliecloud' (an image directory or SquashFS file)."""
    if image.endswith(".sif"):
        return "sif"
    if image.endswith((".sqfs", ".squashfs")) or os.path.isdir(image):
        return "charliecloud"
    raise LaunchError(f"not a container image: {image} (expected a .sif file, a .sqfs file or an image directory; "
                      "build one with: make image)")


def container_runtime(settings: RankSettings, which: Callable[[str], str | None]) -> str:
    """The runtime's program on PATH: the one named, else by the image's kind."""
    name, image = settings.runtime, settings.image
    if name and name not in RUNTIMES and name != "ch-run":
        raise LaunchError(f"--runtime must be {one_of(RUNTIMES)}, got '{name}'")
    if not os.path.exists(image):
        raise LaunchError(f"container image not found: {image} (build it with: apptainer build hpcdl.sif "
                          "Singularity.def, or make image)")
    kind = image_kind(image)
    if name in ("charliecloud", "ch-run") and kind != "charliecloud":
        raise LaunchError(f"Charliecloud cannot run a SIF ({image}): give it the image directory or .sqfs that "
                          "make image writes, or use --runtime apptainer")
    if name == "ch-run":
        name = "charliecloud"
    programs = [RUNTIMES[name]] if name else (["ch-run"] if kind == "charliecloud" else list(AUTO_RUNTIMES))
    for program in programs:
        if which(program):
            return program
    if programs == ["ch-run"]:
        named = "charliecloud: ch-run" if name else "ch-run, Charliecloud's,"
        raise LaunchError(f"no container runtime found ({named} is not on PATH): install charliecloud-runtime "
                          "(make image-prereqs) or module load charliecloud")
    named = f"{name}: {RUNTIMES[name]} is not on PATH" if name else one_of(AUTO_RUNTIMES)
    raise LaunchError(f"no container runtime found ({named}); on TACC systems: module load tacc-apptainer")


def bind_items(bind: str) -> list[tuple[str, str]]:
    """(source, destination) of each comma-separated SRC[:DST[:OPTIONS]]; every source must exist on the host."""
    items = []
    for item in bind.split(","):
        if not item:
            continue
        source, _, rest = item.partition(":")
        if source and not os.path.exists(source):
            raise LaunchError(f"bind source not found: {source} (in --bind {bind})")
        items.append((source, rest.split(":")[0] if rest else source))  # an Apptainer ":ro" is not ch-run's
    return items


def chrun_words(settings: RankSettings, env: Mapping[str, str], cwd: str, inner_launcher: bool,
                join_count: str) -> list[str]:
    """ch-run's words for one rank, up to and with the ``--`` before the rank's program."""
    image = settings.image
    words = ["ch-run"]
    # One ch-run per rank: they join one container per node. With a launcher inside the image
    # (frontera-rtx.sbatch --launcher image-mpirun) there is one ch-run: nothing to join.
    if not inner_launcher:
        words.append("--join")
        # ch-run counts its peers from Open MPI's or Slurm's variables; other launchers say it here.
        join_count = join_count or env.get("HPCDL_JOIN_CT", "")
        if join_count:
            words += ["--join-ct", join_count]
        # Under srun every task sees the same SLURM_STEP_ID, whichever job: name the group by the job.
        if env.get("SLURM_JOB_ID"):
            words += ["--join-tag", f"hpcdl-{env['SLURM_JOB_ID']}-{os.getpid()}"]
    words += ["--set-env", "--home"] + [f"--unset-env={name}" for name in CHRUN_UNSET]
    if cwd == "/":
        raise LaunchError("run from a working directory, not / (ch-run binds the working directory's top folder)")
    if not (cwd == "/tmp" or cwd.startswith("/tmp/")):  # ch-run shares the host's /tmp by itself
        top = "/" + cwd.lstrip("/").split("/")[0]
        if top[1:] in IMAGE_SYSTEM_DIRS:
            raise LaunchError(f"cannot run in {cwd} with Charliecloud: {top} is the image's own; run from a folder "
                              "under /tmp or a file system such as /work or /scratch")
        if os.path.isdir(image) and not os.path.isdir(image + top):
            raise LaunchError(f"the image {image} has no {top} to bind the working directory {cwd} onto "
                              "(Charliecloud binds only onto existing folders); run from under /tmp or a folder the "
                              f"image has, or rebuild it with HPCDL_MOUNT_POINTS={top} make image")
        words += ["-b", f"{top}:{top}"]
    for source, destination in bind_items(settings.bind):
        if os.path.isdir(image) and not os.path.exists(image + destination):
            raise LaunchError(f"bind destination {destination} does not exist in the image {image} (ch-run cannot "
                              f"create it in a read-only image): bind to a folder the image has, e.g. {source}:/mnt/0")
        words += ["-b", f"{source}:{destination}"]
    return words + ["--cd", cwd, image, "--"]


def rank_command(settings: RankSettings, root: str, env: Mapping[str, str], which: Callable[[str], str | None],
                 inner_launcher: list[str] | None = None, join_count: str = "") -> RankCommand:
    """The words that start one rank. ``inner_launcher``: a launcher that runs inside the image (its words go
    between the container and python); ``join_count``: ranks per host for ch-run where the launcher sets no
    variable it reads (MPICH's Hydra)."""
    inner = inner_launcher or []
    module = ["-m", settings.entry]
    if not settings.image:
        python = settings.python or (f"{root}/.venv/bin/python" if os.access(f"{root}/.venv/bin/python", os.X_OK)
                                     else "python3")
        if not which(python):
            raise LaunchError(f"python not found: {python} (run: bash scripts/setup.sh, or pass --python)")
        return RankCommand(inner + [python] + module)
    program = container_runtime(settings, which)
    # Inside the image, its own environment puts the right python first on PATH.
    python = settings.python or "python"
    if program == "ch-run":
        words = chrun_words(settings, env, os.getcwd(), bool(inner), join_count)
        exports = {} if env.get("USER") else {"USER": _user_name()}
        return RankCommand(words + inner + [python] + module, exports)
    bind_items(settings.bind)
    words = [program, "exec"]
    if settings.nv == "1" or (settings.nv == "" and which("nvidia-smi")):
        words.append("--nv")
    if settings.bind:
        words += ["--bind", settings.bind]
    return RankCommand(words + [settings.image] + inner + [python] + module)


def _user_name() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def image_mpi_family(image: str) -> str:
    """The MPI family inside an hpcdl image (openmpi, mpich), from the labels the image's install step writes;
    "" when unknown (a SIF, or an image not built by hpcdl)."""
    labels = ""
    if os.path.isdir(image):
        try:
            with open(os.path.join(image, "opt", "hpcdl", "labels")) as handle:
                labels = handle.read()
        except OSError:
            pass
    elif image.endswith((".sqfs", ".squashfs")):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            labels = subprocess.run(["unsquashfs", "-cat", image, "opt/hpcdl/labels"], capture_output=True,
                                    text=True, timeout=60).stdout
    for line in labels.splitlines():
        if line.startswith("hpcdl.mpi.family "):
            return line.split(" ", 1)[1].strip()
    return ""


def check_image_mpi(image: str, family: str, launcher: str) -> None:
    """A host launcher of the other MPI family starts N processes that each see a world of 1 and train alone:
    refused here, in one line, before anything starts."""
    inside = image_mpi_family(image) if image else ""
    if inside and inside != family:
        raise LaunchError(f"the image's MPI is {inside} but the launcher is {launcher} ({family} family): every rank "
                          f"would start alone as rank 0 of 1; use an {inside} launcher (docs/cluster.md, the "
                          f"MPI-compatibility rule) or the image built for {family}")
