"""One set of versions: scripts/versions.env, pyproject.toml, environment.yml and Singularity.def agree.

scripts/versions.env is what scripts/setup.sh installs (on a bare machine, in a conda environment
and in the container alike), pyproject.toml is what pip checks, environment.yml is what a cluster
user creates. A pin that drifts in one of them means two users run two different stacks.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

REPO = Path(__file__).resolve().parents[2]
# Built by scripts/setup.sh, not installable from environment.yml's pip list (it needs a C++17 patch).
BUILT_BY_SETUP = {"horovod"}
# Files that may mention versions in prose or code; every mention must be the pinned one.
DOCUMENTS = ("environment.yml", "Singularity.def", "docs/cluster.md", "README.md")


def versions_env() -> dict[str, str]:
    """Package -> version from scripts/versions.env (TORCH_VERSION=... -> torch)."""
    pins = {}
    for line in (REPO / "scripts" / "versions.env").read_text().splitlines():
        match = re.match(r"^([A-Z0-9_]+)_VERSION=(\S+)\s*$", line)
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def exact_pins(requirements: list[str]) -> dict[str, str]:
    """Package -> version for every 'name==version' requirement."""
    pins = {}
    for text in requirements:
        req = Requirement(text)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{text!r} is not pinned exactly (name==version)"
        pins[req.name.lower()] = specs[0].version
    return pins


def environment() -> tuple[list[str], list[str]]:
    """environment.yml's conda dependencies and its pip list (option lines excluded)."""
    data = yaml.safe_load((REPO / "environment.yml").read_text())
    conda = [d for d in data["dependencies"] if isinstance(d, str)]
    pip_lists = [d["pip"] for d in data["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pip_lists) == 1, "environment.yml should have one pip: list"
    return conda, [p for p in pip_lists[0] if not p.startswith("-")]


def test_versions_env_matches_pyproject() -> None:
    """Horovod is pinned in its optional extra (an install without it trains with --backend torch)."""
    project = pyproject()["project"]
    assert not any(Requirement(r).name == "horovod" for r in project["dependencies"])
    pinned = exact_pins(project["dependencies"] + project["optional-dependencies"]["horovod"])
    env = versions_env()
    assert {"torch", "torchvision", "horovod", "mpi4py"} <= set(env)
    for name, version in env.items():
        assert pinned.get(name) == version, f"scripts/versions.env has {name} {version}, pyproject.toml {pinned.get(name)}"


def test_environment_yml_pins_are_pyproject_pins() -> None:
    pinned = exact_pins(pyproject()["project"]["dependencies"])
    _, pip = environment()
    env_pins = {Requirement(p).name.lower(): p for p in pip if "==" in p}
    for name, text in env_pins.items():
        version = text.split("==", 1)[1]
        assert pinned.get(name) == version, f"environment.yml has {text}, pyproject.toml {name}=={pinned.get(name)}"
    missing = set(pinned) - set(env_pins) - BUILT_BY_SETUP
    assert not missing, f"pyproject dependencies missing from environment.yml: {sorted(missing)}"


def test_environment_yml_leaves_horovod_and_mpi_to_the_build() -> None:
    conda, pip = environment()
    names = {Requirement(p).name.lower() for p in pip}
    assert not names & BUILT_BY_SETUP, "Horovod must be built by scripts/setup.sh (C++17 patch), not by pip"
    assert "--no-binary=mpi4py" in yaml.safe_load((REPO / "environment.yml").read_text())["dependencies"][-1]["pip"]
    mpi = [d for d in conda if re.match(r"^(openmpi|mpich|impi_rt)\b", d)]
    assert mpi and all("external_" in d for d in mpi), f"MPI must be the host's (an external_* placeholder): {mpi}"
    conda_names = {re.split(r"[=<> ]", d, maxsplit=1)[0] for d in conda}
    assert not conda_names & {"pytorch", "torch", "torchvision", "mpi4py", "horovod"}, "these come from pip/setup.sh"


def test_environment_python_satisfies_requires_python() -> None:
    conda, _ = environment()
    python = next(d for d in conda if d.startswith("python="))
    version = python.split("=", 1)[1]
    requires = SpecifierSet(pyproject()["project"]["requires-python"])
    assert f"{version}.0" in requires, f"environment.yml {python} but pyproject requires-python {requires}"


def test_every_mention_of_a_pinned_version_is_the_pin() -> None:
    pins = versions_env()
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, pins)) + r")\s*(?:==|=|\s)\s*v?(\d+\.\d+(?:\.\d+)?)\b", re.I)
    wrong = []
    for name in DOCUMENTS:
        path = REPO / name
        if not path.exists():
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for package, version in pattern.findall(line):
                if version != pins[package.lower()]:
                    wrong.append(f"{name}:{lineno}: {package} {version} (pinned: {pins[package.lower()]})")
    assert not wrong, "\n".join(wrong)


def test_container_builds_with_the_pinned_procedure() -> None:
    """The image installs through scripts/setup.sh, which reads versions.env: no second list of pins."""
    text = (REPO / "Singularity.def").read_text()
    assert re.search(r"^\s*scripts\s+/opt/hpcdl/src/scripts\s*$", text, re.M), "%files must copy scripts/ (versions.env)"
    assert re.search(r"^\s*pyproject\.toml\s+\S+", text, re.M), "%files must copy pyproject.toml"
    # %post runs the install step every image shares, and that step runs setup.sh.
    assert "bash /opt/hpcdl/src/containers/install.sh" in text
    assert 'bash "$SRC/scripts/setup.sh"' in (REPO / "containers" / "install.sh").read_text()
    own_installs = re.findall(r"pip[3]? install[^\n]*\b(torch|torchvision|horovod|mpi4py)\b", text)
    assert not own_installs, f"Singularity.def installs {own_installs} itself instead of through setup.sh"


@pytest.mark.processes
def test_container_cuda_matches_the_pinned_torch() -> None:
    """Horovod's NCCL build in the image uses the base image's nvcc: it must be torch's CUDA release."""
    torch = pytest.importorskip("torch")
    if torch.__version__.split("+")[0] != versions_env()["torch"]:
        pytest.skip(f"installed torch {torch.__version__} is not the pinned one; rerun scripts/setup.sh")
    if not torch.version.cuda:
        pytest.skip("installed torch is a CPU build: its CUDA release is unknown here")
    base = re.search(r"(?m)^From:\s*nvidia/cuda:(\d+\.\d+)", (REPO / "Singularity.def").read_text())
    assert base, "Singularity.def should start from an nvidia/cuda:<version>-devel image"
    assert base.group(1) == torch.version.cuda, f"image CUDA {base.group(1)}, torch built for {torch.version.cuda}"
