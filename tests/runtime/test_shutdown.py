"""How an entry point ends (hpcdl/runtime/shutdown.py): past a torch.distributed process group, every exit handler
runs and the interpreter does not finalize, so no Gloo thread can be unwound by a finalizing Python (SIGABRT)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.runtime.rendezvous import free_port
from tests.support.mpi_harness import PYTHON, REPO, no_launcher_env, run_bounded

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier

# A program through run_main: an exit handler and a module-level object whose __del__ runs only when the
# interpreter finalizes each leave a mark; GROUP starts a one-rank Gloo group first, WHOLE is run_main's argument.
PROBE = """
import atexit, sys
from pathlib import Path
import torch.distributed as dist
from hpcdl.runtime.errors import run_main

marks = Path(sys.argv[1])

class Finalized:
    def __del__(self):
        (marks / "finalized").touch()

kept = Finalized()

def main():
    if GROUP:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT", rank=0, world_size=1)
    atexit.register((marks / "exit-handler").touch)
    print("main done", flush=True)
    return 3

run_main(main, "probe", whole_program=WHOLE)
"""


def run_probe(tmp_path: Path, group: bool, whole: bool) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    marks = tmp_path / f"group{int(group)}-whole{int(whole)}"
    marks.mkdir()
    script = PROBE.replace("GROUP", str(group)).replace("WHOLE", str(whole)).replace("PORT", str(free_port()))
    result = subprocess.run([PYTHON, "-c", script, str(marks)], capture_output=True, text=True, timeout=120,
                            cwd=REPO)
    return result, {path.name for path in marks.iterdir()}


@pytest.mark.timeout(300)
def test_an_entry_point_past_a_process_group_runs_its_exit_handlers_and_skips_finalization(tmp_path: Path) -> None:
    result, marks = run_probe(tmp_path, group=True, whole=True)
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stdout == "main done\n"
    assert marks == {"exit-handler"}, "the interpreter finalized (or an exit handler was skipped)"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("group", "whole"), [(False, True), (True, False)])
def test_without_a_group_or_as_a_callers_function_python_exits_as_usual(tmp_path: Path, group: bool,
                                                                        whole: bool) -> None:
    """The probe sees a finalization where there is one: no process group, or run_main not the program's end."""
    result, marks = run_probe(tmp_path, group, whole)
    assert result.returncode == 3, result.stderr[-2000:]
    assert marks == {"exit-handler", "finalized"}


@pytest.mark.timeout(300)
def test_a_finished_torchrun_job_ends_with_every_rank_at_status_0_however_late_gloo_lets_go(tmp_path: Path) -> None:
    """torchrun, 2 ranks, Gloo's worker threads held back (tests/support/slow_gloo). Before end_process a rank
    aborted at exit ("terminate called without an active exception", torchrun: FAILED) in 9 of 10 runs of this
    test and 6 of 6 of the same job run by hand; with it, in none of 11."""
    env = no_launcher_env({"PYTHONPATH": f"{REPO / 'tests' / 'support' / 'slow_gloo'}:{REPO}"})
    result = run_bounded([PYTHON, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                          "-m", "hpcdl.train", "--backend", "torch", "--no-progress", "--max-steps", "4", "--epochs",
                          "1", "--workers", "0", "--output-dir", str(tmp_path / "run")], 240, env, REPO, "torchrun")
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "terminate called" not in output, output[-3000:]
    assert (tmp_path / "run" / "summary.json").exists()


def test_end_process_is_exit_where_no_group_is_up() -> None:
    """In a process without torch.distributed's group (this test process), end_process is sys.exit: catchable."""
    from hpcdl.runtime.shutdown import end_process

    assert "torch.distributed" not in sys.modules or not __import__("torch.distributed").distributed.is_initialized()
    with pytest.raises(SystemExit) as exit_info:
        end_process(4)
    assert exit_info.value.code == 4
