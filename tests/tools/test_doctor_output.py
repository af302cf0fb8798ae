"""What the doctor prints is text a log and grep can take, and every fix it suggests can be typed as given."""

from __future__ import annotations

import ast
import re
import subprocess

import pytest

from hpcdl.tools import doctor
from tests.support.mpi_harness import PYTHON, REPO, mpi_env

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier

# Flags of other programs that the doctor's fixes may name, each with the program that takes it.
OTHERS = {"--iface": "launch/mpirun.sh", "--mpi": "srun", "--bind-to": "mpirun", "--map-by": "mpirun",
          "--cpus-per-task": "srun", "--gres": "scheduler", "--gpus-per-task": "scheduler",
          "--ntasks-per-node": "scheduler", "--check-build": "horovodrun", "--backend": "hpcdl.train"}


def doctor_flags() -> set[str]:
    return set(re.findall(r"--[a-z][a-z-]*", (REPO / "hpcdl" / "tools" / "doctor.py").read_text().split(
        "def main(")[1].split("def main_cli")[0]))


def test_its_output_is_printable_text() -> None:
    """Open MPI's library version ends in a NUL byte: printed as is, grep calls the doctor's log binary."""
    result = subprocess.run([PYTHON, "-m", "hpcdl.doctor"], capture_output=True, text=True, env=mpi_env(), cwd=REPO,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    odd = {c for c in result.stdout + result.stderr if not (c.isprintable() or c == "\n")}
    assert not odd, f"unprintable characters {sorted(map(repr, odd))} in the doctor's output"
    assert re.search(r"MPI library +\S", result.stdout)


def test_a_gpu_asked_for_on_this_machine_suggests_the_doctors_own_flag() -> None:
    env = mpi_env({"HPCDL_EXPECT_GPU": "1"})
    result = subprocess.run([PYTHON, "-m", "hpcdl.doctor"], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=120)
    line = next(line for line in result.stderr.splitlines() if line.startswith("doctor:"))
    assert "--device" not in line and "leave out --expect-gpu" in line, line  # training's flag, not the doctor's
    for flag in re.findall(r"--[a-z][a-z-]*", line):
        assert flag in doctor_flags() or flag in OTHERS, f"{flag} in: {line}"


def test_every_flag_in_its_messages_is_its_own_or_names_the_program_that_takes_it() -> None:
    source = (REPO / "hpcdl" / "tools" / "doctor.py").read_text()
    own = doctor_flags()
    texts = [node.value for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    for text in texts:
        for match in re.finditer(r"--[a-z][a-z-]*", text):
            flag = match.group()
            if flag in own:
                continue
            assert flag in OTHERS, f"{flag} in {text!r}: the doctor does not take it; name the program that does"
            program = OTHERS[flag]
            if program != "scheduler":
                assert program in text[: match.start()], f"{flag} in {text!r} without {program} before it"
    assert doctor.main.__name__ == "main"


def test_the_nccl_network_plugin_is_named_from_the_environment(tmp_path) -> None:
    assert doctor.nccl_network_plugin({"NCCL_NET_PLUGIN": "ofi"}) == "NCCL_NET_PLUGIN=ofi"
    (tmp_path / "libnccl-net.so").write_bytes(b"")
    found = doctor.nccl_network_plugin({"LD_LIBRARY_PATH": f"/nonexistent:{tmp_path}"})
    assert found == str(tmp_path / "libnccl-net.so")
    assert doctor.nccl_network_plugin({}).startswith("none")
