"""docs/cluster.md's recipes for a ``--backend torch`` job without MPI run as printed: torchrun, plain ``srun``
(the project's one-node Slurm, no MPI plugin) and a site's recipe; Horovod under plain srun is refused in one line
before MPI starts; torchrun's c10d rendezvous trains across two virtual nodes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdl.runtime.rendezvous import free_port
from tests.support.backends import needs_horovod
from tests.support.mpi_harness import REPO, error_lines, kill_tree, no_launcher_env, run_train
from tests.support.slurm_cluster import (
    SlurmCluster,
    slurm,  # noqa: F401 - the shared fixture
)
from tests.support.vcluster import make_vcluster  # noqa: F401 - a fixture

pytestmark = pytest.mark.processes

MARKER = "<!-- recipes: tests/cluster/test_torch_launchers.py"


def recipes() -> list[str]:
    """The lines of the code block after the recipes' marker in docs/cluster.md."""
    text = (REPO / "docs" / "cluster.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(MARKER):], re.S)
    assert block, "docs/cluster.md lost its recipes block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def workdir(tmp_path: Path) -> Path:
    """A folder to run a recipe in as a reader would, at the top of a checkout (.venv beside it)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(REPO / ".venv")
    return work


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every process against one deadline; the ones still running then (1-based) are killed with their
    children and named."""
    deadline = time.monotonic() + timeout
    late = []
    for number, proc in enumerate(procs, 1):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            late.append(number)
    for proc in procs:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
    return late


def run_dir(work: Path) -> Path:
    runs = list((work / "runs").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def test_the_recipes_are_torchrun_plain_srun_and_a_sites_recipe() -> None:
    lines = recipes()
    assert len(lines) == 3
    assert lines[0].startswith(".venv/bin/torchrun --standalone --nproc-per-node 2 -m hpcdl.train --backend torch")
    assert lines[1].startswith("srun -n 2 --kill-on-bad-exit=1 .venv/bin/python -m hpcdl.train --backend torch")
    assert "--mpi" not in lines[1] and "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS MASTER_ADDR=" in lines[2]


def test_the_torchrun_recipe_runs_as_printed(tmp_path: Path) -> None:
    work = workdir(tmp_path)
    proc = subprocess.Popen(["bash", "-c", recipes()[0]], cwd=work, env=no_launcher_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert "2 rank(s) x batch 32" in out and "torch (gloo)" in out
    summary = json.loads((run_dir(work) / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["replicas_identical"] is True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", [1, 2], ids=["plain-srun", "site-recipe"])
def test_the_srun_recipes_run_as_printed(slurm: SlurmCluster, tmp_path: Path, which: int) -> None:  # noqa: F811
    """The one-node Slurm here has no MPI plugin by default (MpiDefault=none): the plain srun of a torch job."""
    work = workdir(tmp_path)
    result = slurm.run(["bash", "-c", recipes()[which]], check=False, timeout=240, env=no_launcher_env(), cwd=work)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "2 rank(s) x batch 32" in result.stdout and "torch (gloo)" in result.stdout
    summary = json.loads((run_dir(work) / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["replicas_identical"] is True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault, said", [("1:5:kill", "injecting fault 'kill' on rank 1 at step 5"),
                                         ("1:5:stop", "rank 1 went silent")], ids=["killed", "frozen"])
def test_a_lost_rank_under_plain_srun_ends_the_step(slurm: SlurmCluster, tmp_path: Path, fault: str,  # noqa: F811
                                                    said: str) -> None:
    """Plain srun, --kill-on-bad-exit=1 as the recipe has it: a killed rank ends the step; a frozen one is named by
    the watchdog (UDP heartbeats, no MPI), whose exit ends the step."""
    result = slurm.run(["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, "-m", "hpcdl.train", "--output-dir",
                        str(tmp_path / "run"), "--no-progress", "--epochs", "1", "--backend", "torch",
                        "--stall-timeout", "4"], check=False, timeout=240, env=no_launcher_env({"HPCDL_FAULT": fault}),
                       cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and said in output, output[-3000:]
    assert not (tmp_path / "run" / "summary.json").exists()


@needs_horovod
@pytest.mark.timeout(200)
def test_horovod_under_plain_srun_is_refused_before_mpi_starts(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    """Open MPI's MPI_Init fails under srun without a PMI plugin after pages of advice; hpcdl names the fix first."""
    result = slurm.run(["srun", "-n", "2", sys.executable, "-m", "hpcdl.train", "--output-dir", str(tmp_path / "run"),
                        "--no-progress", "--epochs", "1"], check=False, timeout=150, env=no_launcher_env(), cwd=REPO)
    assert result.returncode != 0
    assert [line for line in error_lines(result.stderr) if line.startswith("hpcdl")] == [
        "hpcdl.train: error: srun started 2 tasks without an MPI plugin (no PMIx variables), and Horovod "
        "(--backend horovod, the default) needs MPI: run srun --mpi=pmix, or add --backend torch (no MPI needed)"], \
        result.stderr[-3000:]
    assert "Open MPI" not in result.stderr and "PMI" not in result.stderr.replace("PMIx variables", "")


@pytest.mark.timeout(400)
def test_torchrun_c10d_trains_across_two_virtual_nodes_as_mpirun_does(make_vcluster, tmp_path: Path) -> None:
    """torchrun on each of 2 virtual nodes (1 rank each), c10d rendezvous at node1: the run ends with the weights of
    the same run under mpirun on one host, to the bit (2 ranks add the same two numbers wherever they are)."""
    cluster = make_vcluster(2)
    node1 = cluster.nodes[0]
    port = free_port()
    flags = ["-m", "hpcdl.train", "--backend", "torch", "--no-progress", "--max-steps", "4", "--epochs", "1",
             "--seed", "3", "--workers", "0"]
    logs = [tmp_path / f"node{rank + 1}.log" for rank in range(2)]
    procs = []
    for rank, node in enumerate(cluster.nodes):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{node1.address}:{port}", "--rdzv-id", "i45",
                # a virtual node's name resolves nowhere: say which node holds the store, and each node's address
                "--rdzv-conf", f"is_host={int(rank == 0)}", "--local-addr", node.address,
                *flags, "--output-dir", str(tmp_path / "nodes")]
        with logs[rank].open("w") as log:  # a file, not a pipe: a node's words survive a timeout
            procs.append(cluster.popen(node, argv, env=no_launcher_env({"LOGLEVEL": "INFO"}), cwd=REPO, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True))
    late = wait_all(procs, timeout=240)
    outputs = [log.read_text(errors="replace") for log in logs]
    told = "\n".join(f"--- node{i + 1} (exit {p.returncode}):\n{o[-2500:]}" for i, (p, o) in
                     enumerate(zip(procs, outputs, strict=True)))
    assert not late, f"node(s) {late} still running after 240 s (killed):\n{told}"
    assert [p.returncode for p in procs] == [0, 0], told
    text = "".join(outputs)
    assert "2 rank(s) x batch 32" in text and "torch (gloo)" in text, text[-3000:]
    one_host = run_train(2, tmp_path / "host", *flags[2:], timeout=300)
    assert one_host.returncode == 0, one_host.stderr[-3000:]
    import torch

    def weights(run: Path) -> dict[str, torch.Tensor]:
        newest = sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1]
        return torch.load(newest, map_location="cpu", weights_only=True)["model"]

    a, b = weights(tmp_path / "nodes"), weights(tmp_path / "host")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
