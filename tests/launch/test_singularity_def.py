"""The Apptainer definitions cannot be built here (no Apptainer), so they are validated instead:
Singularity.def (the GPU image) and containers/hpcdl-cpu.def (the CPU image, `Bootstrap: debootstrap`).
Both install through one shared step, containers/install.sh, which runs scripts/setup.sh; `make image`
runs that same step (tests/cluster/test_container_runs.py runs ranks in what it builds).

spython parses a recipe but silently accepts a misspelt section and a missing ``From:``, so
:func:`definition_problems` adds the checks a build would make first: the header, the names of
the sections, the shell in them (``bash -n`` and shellcheck) and the things this image promises
(one build procedure through scripts/setup.sh, the run script, the self-test, the help text).
The tests then show that the repository's file passes and that broken copies do not.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


REPO = Path(__file__).resolve().parents[2]
DEFINITION = REPO / "Singularity.def"
CPU_DEFINITION = REPO / "containers" / "hpcdl-cpu.def"
INSTALL = REPO / "containers" / "install.sh"

KNOWN_SECTIONS = {"setup", "files", "environment", "post", "runscript", "startscript", "test", "labels", "help", "arguments"}
REQUIRED_SECTIONS = {"files", "environment", "post", "runscript", "test", "labels", "help"}
SHELL_SECTIONS = {"setup", "environment", "post", "runscript", "startscript", "test"}
BOOTSTRAP_AGENTS = {"docker", "library", "localimage", "shub", "oras", "debootstrap", "yum", "zypper", "scratch"}


def shellcheck_binary() -> str | None:
    """The shellcheck that the test extra installs next to python, else one on PATH."""
    beside = Path(sys.executable).with_name("shellcheck")
    return str(beside) if beside.exists() else shutil.which("shellcheck")


def split_definition(text: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The header (keyword -> value) and the sections in order, as (name, body) pairs."""
    header: dict[str, str] = {}
    sections: list[tuple[str, str]] = []
    current: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        match = re.match(r"^%(\S+)", line)
        if match:
            if current is not None:
                sections.append((current, "\n".join(body)))
            current, body = match.group(1), []
        elif current is None:
            keyword = re.match(r"^\s*([A-Za-z]+)\s*:\s*(.*?)\s*$", line)
            if keyword and not line.lstrip().startswith("#"):
                header[keyword.group(1)] = keyword.group(2)
        else:
            body.append(line)
    if current is not None:
        sections.append((current, "\n".join(body)))
    return header, sections


def shell_problems(name: str, body: str, workdir: Path) -> list[str]:
    """bash -n and shellcheck on one section, run as Apptainer runs it (by /bin/sh)."""
    script = workdir / f"section-{name}.sh"
    script.write_text("#!/bin/sh\n" + body + "\n")
    problems = []
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    if syntax.returncode != 0:
        problems.append(f"%{name}: bash -n: {syntax.stderr.strip()}")
    checker = shellcheck_binary()
    if checker is None:
        problems.append("shellcheck not found (it comes with the test extra: pip install -e .[test])")
    else:
        # From the repository root, so that '# shellcheck source=scripts/...' directives resolve.
        lint = subprocess.run([checker, "-x", "-s", "sh", str(script)], capture_output=True, text=True, cwd=REPO)
        if lint.returncode != 0:
            problems.append(f"%{name}: shellcheck:\n{lint.stdout.strip()}")
    return problems


def definition_problems(path: Path, workdir: Path, build_dir: Path | None = None, gpu: bool = True) -> list[str]:
    """Everything wrong with a definition file that a reader or a build would trip over.

    build_dir is where `apptainer build` would run (the %files sources are relative to it, the
    repository root for both definitions); gpu: the GPU image's promises (CUDA base, NCCL) apply.
    """
    build_dir = build_dir or REPO
    text = path.read_text()
    header, sections = split_definition(text)
    problems = []

    agent = header.get("Bootstrap", "")
    if agent.lower() not in BOOTSTRAP_AGENTS:
        problems.append(f"header: 'Bootstrap:' missing or unknown ({agent!r})")
    if agent.lower() in {"docker", "library", "shub", "oras", "localimage"} and not header.get("From"):
        problems.append("header: 'From:' missing (which base image?)")
    if agent.lower() == "debootstrap":
        for keyword in ("OSVersion", "MirrorURL"):
            if not header.get(keyword):
                problems.append(f"header: debootstrap needs '{keyword}:'")

    names = [name for name, _ in sections]
    for name in names:
        if name not in KNOWN_SECTIONS and not name.startswith("app"):
            problems.append(f"unknown section %{name}")
    for name in sorted(REQUIRED_SECTIONS - set(names)):
        problems.append(f"section %{name} is missing")
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"section %{name} appears more than once")

    body = {name: text for name, text in sections}
    for name in sorted(SHELL_SECTIONS & set(body)):
        problems.extend(shell_problems(name, body[name], workdir))

    for line in body.get("files", "").splitlines():
        words = line.split()
        if words and not words[0].startswith("#") and not (build_dir / words[0]).exists():
            problems.append(f"%files: {words[0]} does not exist in {build_dir}")

    post = body.get("post", "")
    install = re.search(r"\bbash\s+/opt/hpcdl/src/containers/install\.sh\b([^\n]*)", post)
    if not install:
        problems.append("%post must build with the one procedure: bash /opt/hpcdl/src/containers/install.sh")
    elif gpu != ("--gpu" in install.group(1).split()):
        problems.append(f"%post: containers/install.sh {'needs' if gpu else 'must not have'} --gpu in this image")
    if re.search(r"\b(apt-get|pip[3]?)\s+install\b", post):
        problems.append("%post installs by itself: the steps belong in containers/install.sh, shared by every image")
    if not re.search(r'python -m hpcdl\.train "\$@"', body.get("runscript", "")):
        problems.append('%runscript must run: python -m hpcdl.train "$@"')
    test = body.get("test", "")
    if "import" not in test or "hpcdl.doctor" not in test:
        problems.append("%test must import the stack and run python -m hpcdl.doctor")
    if gpu and "nccl_built()" not in test:
        problems.append("%test must check that Horovod was built with NCCL (hvd.nccl_built())")
    if gpu and not re.search(r"(?m)^From:\s*nvidia/cuda:\S*devel", text):
        problems.append("header: the GPU image must start from an nvidia/cuda:<version>-devel image (nvcc for Horovod)")
    help_text = body.get("help", "")
    for needed in ("apptainer exec" + (" --nv" if gpu else ""), "mpirun", "srun --mpi=pmix", "ibrun", "MPI-compatibility"):
        if needed not in help_text:
            problems.append(f"%help does not mention {needed!r}")
    if not re.search(r"\S", body.get("labels", "")):
        problems.append("%labels is empty")
    if "PATH" not in body.get("environment", ""):
        problems.append("%environment does not put the image's python on PATH")
    return problems


# ------------------------------------------------------------------------- the repository's file


def test_definition_passes_every_check(tmp_path: Path) -> None:
    assert definition_problems(DEFINITION, tmp_path) == []


def test_cpu_definition_passes_every_check(tmp_path: Path) -> None:
    assert definition_problems(CPU_DEFINITION, tmp_path, gpu=False) == []
    header, _ = split_definition(CPU_DEFINITION.read_text())
    assert header["Bootstrap"] == "debootstrap" and header["OSVersion"] == "bookworm"


def test_both_definitions_share_their_steps_instead_of_copying_them() -> None:
    """The same files and environment, and a %post that is the shared install step and nothing else."""
    gpu, cpu = (dict(split_definition(path.read_text())[1]) for path in (DEFINITION, CPU_DEFINITION))
    assert gpu["files"].split() == cpu["files"].split()
    assert "containers /opt/hpcdl/src/containers" in " ".join(gpu["files"].split())
    same_env = [line for line in gpu["environment"].splitlines() if "IMAGE_KIND" not in line]
    assert same_env == [line for line in cpu["environment"].splitlines() if "IMAGE_KIND" not in line]
    for body in (gpu["post"], cpu["post"]):
        commands = [line.strip() for line in body.splitlines() if line.strip() and not line.strip().startswith("#")]
        assert [c for c in commands if not c.startswith(("set -eu", "export DEBIAN_FRONTEND"))] == [
            next(c for c in commands if "containers/install.sh" in c)], commands


def test_the_shared_install_step_runs_setup_and_checks_the_mpi_family(tmp_path: Path) -> None:
    text = INSTALL.read_text()
    assert re.search(r'bash "\$SRC/scripts/setup\.sh"', text), "containers/install.sh must run scripts/setup.sh"
    assert not re.search(r"pip[3]? install[^\n]*\b(torch|horovod|mpi4py)\b", text), "installs belong to setup.sh"
    packages = subprocess.run(["bash", str(INSTALL), "--packages"], capture_output=True, text=True, check=True)
    assert "openmpi-bin libopenmpi-dev" in packages.stdout and "python3-venv" in packages.stdout
    mpich = subprocess.run(["bash", str(INSTALL), "--mpi", "mpich", "--packages"], capture_output=True, text=True)
    assert "mpich libmpich-dev" in mpich.stdout and "openmpi" not in mpich.stdout
    bad = subprocess.run(["bash", str(INSTALL), "--mpi", "lam"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "[install] --mpi must be openmpi or mpich (got 'lam')"
    checker = shellcheck_binary()
    if checker is None:
        pytest.fail("shellcheck not found (it comes with the test extra: pip install -e .[test])")
    lint = subprocess.run([checker, "-x", str(INSTALL)], capture_output=True, text=True, cwd=REPO)
    assert lint.returncode == 0, lint.stdout


def test_spython_parses_the_definition() -> None:
    from spython.main.parse.parsers import SingularityParser
    from spython.main.parse.writers import DockerWriter

    stages = SingularityParser(str(DEFINITION)).recipe
    assert list(stages) == ["spython-base"], "expected a single-stage recipe"
    recipe = stages["spython-base"]
    header, sections = split_definition(DEFINITION.read_text())
    assert recipe.fromHeader == header["From"]
    assert any("containers/install.sh" in line for line in recipe.install), "spython did not see the build in %post"
    assert recipe.cmd == 'exec python -m hpcdl.train "$@"'
    files = [line.split() for line in dict(sections)["files"].splitlines() if line.strip()]
    assert [line.split() for line in recipe.files] == files
    assert any(item.startswith("PATH=") for item in recipe.environ)
    # A second reader of the same parse: spython's Dockerfile writer.
    assert f"FROM {header['From']}" in DockerWriter(stages).convert()


# ------------------------------------------------------------------------- broken copies fail

BREAKAGES = {
    "misspelt section": (lambda t: t.replace("\n%post\n", "\n%psot\n"), "unknown section %psot"),
    "missing From": (lambda t: re.sub(r"(?m)^From:.*\n", "", t), "'From:' missing"),
    "missing Bootstrap": (lambda t: re.sub(r"(?m)^Bootstrap:.*\n", "", t), "'Bootstrap:' missing"),
    "missing runscript": (lambda t: t.replace("%runscript", "%runscritp"), "section %runscript is missing"),
    "duplicated section": (lambda t: t + "\n%labels\n    extra yes\n", "%labels appears more than once"),
    "shell syntax error": (lambda t: t.replace("    set -eu\n", "    set -eu\n    if [ -d / ]; then\n", 1), "bash -n"),
    "shellcheck finding": (lambda t: t.replace("    set -eu\n", "    set -eu\n    cd $HOME\n", 1), "shellcheck"),
    "install step not used": (lambda t: t.replace("bash /opt/hpcdl/src/containers/install.sh", "true"), "one procedure"),
    "GPU image built without --gpu": (lambda t: t.replace("install.sh --gpu", "install.sh"), "needs --gpu"),
    "a step copied into %post": (lambda t: t.replace("    export DEBIAN_FRONTEND=noninteractive\n",
                                                     "    export DEBIAN_FRONTEND=noninteractive\n    apt-get install -y git\n"),
                                 "installs by itself"),
    "runscript not hpcdl.train": (lambda t: t.replace('hpcdl.train "$@"', "hpcdl.train"), "%runscript must run"),
    "help without the launch": (lambda t: t.replace("ibrun", "launcher"), "'ibrun'"),
    "missing file": (lambda t: t.replace("kfac /opt/hpcdl/src/kfac", "kfacc /opt/hpcdl/src/kfac"), "kfacc does not exist"),
    "no NCCL check": (lambda t: t.replace("assert hvd.nccl_built(),", "assert True,"), "built with NCCL"),
    "CPU base image": (lambda t: re.sub(r"(?m)^From:.*$", "From: ubuntu:24.04", t), "nvidia/cuda"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_copy_fails(breakage: str, tmp_path: Path) -> None:
    edit, expected = BREAKAGES[breakage]
    original = DEFINITION.read_text()
    broken_text = edit(original)
    assert broken_text != original, f"the edit for {breakage!r} no longer applies to Singularity.def"
    broken = tmp_path / "Singularity.def"
    broken.write_text(broken_text)
    problems = definition_problems(broken, tmp_path, build_dir=REPO)
    assert any(expected in problem for problem in problems), problems
