"""Ranks really running in the CPU image (make image) under the project's launchers, as on a cluster.

One image for the session (tests/support/container.py: built once, cached), the embedded digits
data, few and short runs:
  - 4 ranks under launch/mpirun.sh on this host: the doctor inside says which image, which MPI inside
    and outside, that they talk, and that the host's venv, PYTHONPATH and PIP_* did not leak in;
  - 2 ranks in the image, under Horovod and under torch.distributed, end with weights bit-identical to the
    same run on the host;
  - 2 virtual nodes x 2 ranks: a 64 MiB allreduce between the nodes' containers, and a node lost
    mid-training ends the containerised job naming the node, as a bare job ends;
  - launch/slurm.sbatch --image on the project's Slurm (srun --mpi=pmix), under either backend: SIGUSR1 near
    the time limit checkpoints inside the image, requeues the job, and it resumes to the end.
"""

# ruff: noqa: F811 - pytest fixtures imported by name and taken as arguments
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.support.backends import BACKENDS
from tests.support.container import REPO, clean_env, hpcdl_image, leaky_env  # noqa: F401 (a fixture)
from tests.support.slurm_cluster import SlurmCluster, slurm  # noqa: F401 (a fixture)
from tests.support.vcluster import Launch, make_vcluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.processes

TRAIN = ["--dataset", "digits", "--no-progress", "--seed", "7"]


def launch(args: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    job = Launch(args, log, timeout, env=env or clean_env())
    rc = job.wait(timeout + 15)
    return rc, job.text


def model_tensors(checkpoint: Path) -> dict[str, object]:
    import torch

    return torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]


@pytest.mark.timeout(300)
def test_doctor_in_the_image_under_mpirun_on_four_ranks(hpcdl_image: Path, tmp_path: Path) -> None:
    rc, out = launch(["-np", "4", "--image", str(hpcdl_image), "--entry", "hpcdl.doctor"], tmp_path / "doctor.log",
                     timeout=240, env=leaky_env())
    assert rc == 0, out[-4000:]
    assert "ch-run --join --set-env" in out
    assert re.search(r"image\s+hpcdl-cpu environment=\w+ source=\w+", out), out[-3000:]
    assert re.search(r"MPI inside\s+openmpi: Open MPI v4\.1\.4", out), out[-3000:]
    assert re.search(r"launcher outside\s+Open MPI mpirun \(mpirun \(Open MPI\) 4\.1\.4", out), out[-3000:]
    assert re.search(r"inside and outside talk\s+yes: MPI sees the 4 rank", out), out[-3000:]
    # The image's own stack, not the host venv's that PATH, VIRTUAL_ENV and PYTHONPATH pointed at.
    assert re.search(r"torch\s+2\.13\.0\S* \(/opt/hpcdl/venv/lib/python3\.11/site-packages/torch\)", out), out[-3000:]
    assert "world size           4" in out or re.search(r"world size\s+4\b", out), out[-3000:]


@pytest.mark.timeout(600)
def test_two_ranks_in_the_image_end_bit_identical_to_the_host(hpcdl_image: Path, tmp_path: Path) -> None:
    """The image under both backends (it carries Horovod and torch.distributed): on 2 ranks both add the same two
    numbers, so the host's Horovod run, the image's Horovod run and the image's torch run end bit-identical."""
    import torch

    runs = {}
    for where, extra in (("host", ["--backend", "horovod"]), ("image", ["--backend", "horovod"]),
                         ("image-torch", ["--backend", "torch"])):
        image = ["--image", str(hpcdl_image)] if where.startswith("image") else []
        out_dir = tmp_path / where
        rc, text = launch(["-np", "2", *image, "--", *TRAIN, *extra, "--epochs", "2", "--output-dir", str(out_dir)],
                          tmp_path / f"{where}.log", timeout=300)
        assert rc == 0, f"{where}:\n{text[-3000:]}"
        checkpoints = sorted((out_dir / "checkpoints").glob("ckpt-*.pt"))
        assert checkpoints, f"{where} wrote no checkpoint\n{text[-2000:]}"
        runs[where] = (checkpoints[-1], text)
    assert "ch-run" in runs["image"][1] and "ch-run" not in runs["host"][1]
    assert "| torch (gloo) |" in runs["image-torch"][1], runs["image-torch"][1][-2000:]
    host = model_tensors(runs["host"][0])
    for where in ("image", "image-torch"):
        assert runs["host"][0].name == runs[where][0].name  # the same number of steps
        image = model_tensors(runs[where][0])
        assert list(host) == list(image)
        differing = [name for name in host if not torch.equal(host[name], image[name])]
        assert not differing, f"tensors that differ between the host and {where}: {differing}"
    # A check that can fail: one more step changes the weights.
    assert any(torch.is_floating_point(t) and t.abs().sum() > 0 for t in image.values())


@pytest.mark.timeout(400)
def test_64_mib_allreduce_between_containers_on_two_virtual_nodes(make_vcluster, hpcdl_image: Path,
                                                                 tmp_path: Path) -> None:
    cluster = make_vcluster(2)
    started = time.monotonic()
    rc, out = launch(["--vcluster", cluster.name, "-np", "4", "--image", str(hpcdl_image), "--entry",
                      "hpcdl.bench.allreduce", "--", "--min-size", "64M", "--max-size", "64M", "--algorithms",
                      "--no-horovod", "--no-gloo", "--rounds", "1", "--seconds", "0.5", "--output-dir",
                      str(tmp_path / "bench")], tmp_path / "allreduce.log", timeout=300)
    print(f"64 MiB allreduce job on 2 nodes x 2 ranks in containers: {time.monotonic() - started:.1f} s in all")
    assert rc == 0, out[-4000:]
    assert out.count("ch-run --join") >= 1
    results = [p.read_text() for p in (tmp_path / "bench").glob("*.json")]
    assert results and all(json.loads(text) for text in results), f"no results written\n{out[-3000:]}"
    assert any(str(64 << 20) in text for text in results), results  # the 64 MiB row was measured
    print("\n".join(line for line in out.splitlines() if "64 MiB" in line and "%" not in line))


@pytest.mark.timeout(600)
def test_a_lost_node_ends_the_containerised_job_naming_it(make_vcluster, hpcdl_image: Path, tmp_path: Path) -> None:
    stall = 20
    cluster = make_vcluster(2)
    out = tmp_path / "run"
    job = Launch(["--vcluster", cluster.name, "-np", "4", "--image", str(hpcdl_image), "--", *TRAIN,
                  "--epochs", "30", "--stall-timeout", str(stall), "--output-dir", str(out)],
                 tmp_path / "job.log", timeout=400, env=clean_env())
    try:
        job.wait_for_checkpoint(out)
        node2 = cluster.node("node2")
        assert cluster.crash(node2), "node2 had no processes to kill"
        lost_at = time.monotonic()
        rc = job.wait(timeout=stall + 90)
        ended_after = time.monotonic() - lost_at
    finally:
        job.kill()
    text = job.text
    print(f"node2 crashed: the containerised job ended {ended_after:.0f} s later, exit {rc}")
    assert rc != 0, text[-3000:]
    assert ended_after <= stall + 60, text[-3000:]
    named = [line for line in text.splitlines()
             if re.search(rf"node ({node2.hostname}|{re.escape(node2.address)}) lost.*\b2, 3\b", line)]
    assert named, f"no line names the lost node and its ranks 2, 3\n{text[-3000:]}"
    assert sorted((out / "checkpoints").glob("ckpt-*.pt")), "the checkpoint is gone"


@pytest.mark.timeout(500)
@pytest.mark.parametrize("backend", BACKENDS)
def test_slurm_job_in_the_image_checkpoints_on_sigusr1_requeues_and_resumes(
        slurm: SlurmCluster, hpcdl_image: Path, tmp_path: Path, backend: str) -> None:
    epochs = 30  # long after the first epoch, where the signal is sent: a fast machine ran 4 in 0.5 s
    env = {key: "" for key in os.environ if key.startswith("HPCDL_")}  # no launch settings of the caller's
    env.update(OMP_NUM_THREADS="1")
    job = slurm.sbatch(REPO / "launch" / "slurm.sbatch",
                       script_args=["--image", str(hpcdl_image), "--", *TRAIN, "--epochs", str(epochs),
                                    "--backend", backend],
                       sbatch_args=["--ntasks-per-node=2", "--cpus-per-task=1", "--time=10"], env=env, cwd=tmp_path)
    metrics = tmp_path / "runs" / f"hpcdl-{job}" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, "the first epoch never finished"
        assert slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), (
            slurm.job_state(job), (tmp_path / f"hpcdl-{job}.out").read_text()[-3000:])
        time.sleep(0.1)
    slurm.run(["scancel", "--batch", "--signal=USR1", str(job)])
    state = slurm.wait_for_job(job, timeout=360)
    log = (tmp_path / f"hpcdl-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    assert "srun --mpi=pmix" in log and "ch-run --join --join-tag" in log, log[-3000:]
    assert "SIGUSR1 received" in log and "requeueing job" in log and "resuming from" in log, log[-4000:]
    assert f"| {backend}" in log, log[-3000:]
    logged = [json.loads(line)["epoch"] for line in metrics.read_text().splitlines() if line.strip()]
    assert logged == list(range(1, epochs + 1)), logged
