"""hpcdl.train started the way torch.distributed's users start jobs: torchrun, a site's MASTER_ADDR/MASTER_PORT,
one process; against mpirun's runs, with the start-up mistakes named before any wait (hpcdl.runtime.launch_env).

Every job is tiny (digits, a few steps) and sits under a timeout that kills its whole process tree.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from hpcdl.runtime.rendezvous import free_port
from tests.support.backends import needs_horovod
from tests.support.mpi_harness import REPO, error_lines, kill_tree, mpi_env, run_bounded, run_train
from tests.support.reliability_runs import (
    BASE_FLAGS,
    baseline_run,
    checkpoint_steps,
    load_checkpoint,
    same_weights,
    signal_once_training,
)

pytestmark = pytest.mark.processes

TINY = ("--max-steps", "6", "--epochs", "1", "--seed", "3", "--warmup-epochs", "0", "--workers", "0")


def torch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This machine's environment without any launcher's variables (a test may run inside one)."""
    env = {k: v for k, v in mpi_env().items()
           if not k.startswith(("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC",
                                "SLURM_", "GROUP_RANK", "ROLE_"))}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra or {})
    return env


def run(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``cmd`` under ``timeout``, its whole tree killed at the end of it (returncode 124)."""
    return run_bounded(cmd, timeout, torch_env(env), REPO, "torchrun test")


def torchrun(nprocs: int, output_dir: Path, *flags: str, timeout: float = 240,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node N -m hpcdl.train --output-dir DIR --no-progress FLAGS``."""
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs),
                "-m", "hpcdl.train", "--output-dir", str(output_dir), "--no-progress", *flags], timeout, env)


def alone(output_dir: Path, *flags: str, timeout: float = 120,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m hpcdl.train`` started by no launcher (a site's recipe sets the variables in ``env``)."""
    return run([sys.executable, "-m", "hpcdl.train", "--output-dir", str(output_dir), "--no-progress", *flags],
               timeout, env)


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1], map_location="cpu",
                       weights_only=False)
    state = {f"model.{k}": v for k, v in saved["model"].items()}
    for index, slot in saved["optimizer"]["state"].items():
        state |= {f"optimizer.{index}.{k}": v for k, v in slot.items() if isinstance(v, torch.Tensor)}
    return state


def metrics(run_dir: Path) -> list[dict]:
    keep = ("epoch", "global_step", "train_loss", "train_accuracy", "test_loss", "test_accuracy", "lr")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: row[k] for k in keep} for row in rows]


# ------------------------------------------------------------------ the same run, however it was started

def test_torchrun_trains_bit_identically_to_mpirun_and_one_rank_takes_the_same_steps(tmp_path: Path) -> None:
    """2 ranks under torchrun (no MPI) end with mpirun's weights, momentum and metrics to the bit (the stall watchdog
    on: its heartbeats must not disturb training); one process with the global batch takes the same steps."""
    flags = (*TINY, "--backend", "torch", "--batch-size", "32", "--base-lr", "0.02", "--stall-timeout", "30")
    by_torchrun = torchrun(2, tmp_path / "torchrun", *flags)
    assert by_torchrun.returncode == 0, by_torchrun.stderr[-3000:]
    assert "2 rank(s) x batch 32" in by_torchrun.stdout and "torch (gloo)" in by_torchrun.stdout
    by_mpirun = run_train(2, tmp_path / "mpirun", *flags)
    assert by_mpirun.returncode == 0, by_mpirun.stderr[-3000:]
    a, b = final_state(tmp_path / "torchrun"), final_state(tmp_path / "mpirun")
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert metrics(tmp_path / "torchrun") == metrics(tmp_path / "mpirun")
    assert json.loads((tmp_path / "torchrun" / "summary.json").read_text())["replicas_identical"] is True

    one = alone(tmp_path / "one", *TINY, "--backend", "torch", "--batch-size", "64", "--base-lr", "0.04")
    assert one.returncode == 0, one.stderr[-3000:]
    w1 = {k: v for k, v in final_state(tmp_path / "one").items() if k.startswith("model.")}
    w2 = {k: v for k, v in a.items() if k.startswith("model.")}
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-5, atol=1e-6)


def test_a_sites_master_addr_and_port_start_the_ranks_without_any_launcher(tmp_path: Path) -> None:
    """A site's recipe: each rank started by hand with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = torch_env({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                         "HPCDL_RENDEZVOUS_TIMEOUT": "60"})
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hpcdl.train", "--output-dir", str(tmp_path / "run"), "--no-progress", *TINY,
             "--backend", "torch", "--max-steps", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, cwd=REPO, start_new_session=True))
    results = []
    try:
        for proc in procs:
            results.append((proc.wait(timeout=180), proc.stdout.read(), proc.stderr.read()))  # type: ignore[union-attr]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    assert "2 rank(s) x batch 32" in results[0][1]
    assert checkpoint_steps(tmp_path / "run") == [3]


# ------------------------------------------------------------------ launchers whose world a backend cannot see

@needs_horovod
def test_the_default_backend_refuses_torchruns_ranks_in_one_line(tmp_path: Path) -> None:
    """Horovod sees MPI's ranks only: under torchrun each process would train alone, on all the data."""
    job = torchrun(2, tmp_path / "run", *TINY, timeout=120)
    assert job.returncode != 0
    assert error_lines(job.stderr) == [
        "hpcdl.train: error: WORLD_SIZE=2 (torchrun's) but no MPI launcher started this process, and Horovod "
        "(--backend horovod, the default) sees MPI's ranks only: add --backend torch, or start with mpirun -np 2"], \
        job.stderr[-3000:]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


# ------------------------------------------------------------------ start-up mistakes, named before any wait

def test_an_unresolvable_master_addr_is_one_line_at_once(tmp_path: Path) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": str(free_port())}
    start = time.monotonic()
    job = alone(tmp_path / "run", *TINY, "--backend", "torch", "--stall-timeout", "5", env=env)
    assert job.returncode == 2 and time.monotonic() - start < 60, job.stderr[-3000:]
    assert error_lines(job.stderr) == ["hpcdl.train: error: MASTER_ADDR=no-such-host.invalid does not resolve "
                                       f"({socket_error('no-such-host.invalid')}): set MASTER_ADDR to rank 0's host "
                                       "name or address"], job.stderr[-3000:]
    assert len(job.stderr.strip().splitlines()) == 1, job.stderr


def socket_error(host: str) -> str:
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return str(exc.strerror)
    raise AssertionError(f"{host} resolves here")


def test_an_unresolvable_master_addr_under_mpirun_is_one_line_on_every_rank(tmp_path: Path) -> None:
    start = time.monotonic()
    job = run_train(2, tmp_path / "run", *TINY, "--backend", "torch", "--stall-timeout", "5", timeout=120,
                    env={"MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": str(free_port())})
    assert job.returncode == 2 and time.monotonic() - start < 60, job.stderr[-3000:]
    lines = error_lines(job.stderr)
    assert len(lines) == 1 and "MASTER_ADDR=no-such-host.invalid does not resolve" in lines[0], job.stderr[-3000:]


def test_a_master_port_in_use_is_one_line_at_once(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start = time.monotonic()
        job = alone(tmp_path / "run", *TINY, "--backend", "torch",
                    env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert job.returncode == 2 and time.monotonic() - start < 60, job.stderr[-3000:]
    assert len(error_lines(job.stderr)) == 1, job.stderr[-3000:]
    assert re.fullmatch(rf"hpcdl\.train: error: MASTER_PORT={port} is in use on \S+ \(rank 0's rendezvous listens "
                        r"there\): set MASTER_PORT to a free port", error_lines(job.stderr)[0])


SHARED_GPU = r"hpcdl\.train: error: ranks 0 and 1 on \S+ share one GPU \(cuda:0, GPU-fake-0\); NCCL allows one rank per GPU"


def test_two_ranks_on_one_gpu_under_torchrun_stop_before_the_process_group(tmp_path: Path) -> None:
    """Both ranks see one (pretend) GPU: one line naming the device and the ranks, before NCCL would start."""
    job = torchrun(2, tmp_path / "run", *TINY, "--backend", "torch", timeout=120,
                   env={"HPCDL_FAKE_GPU_UUIDS": "GPU-fake-0"})
    assert job.returncode != 0
    lines = error_lines(job.stderr)
    assert len(lines) == 1 and re.match(SHARED_GPU, lines[0]), job.stderr[-3000:]
    assert "another rank" not in job.stderr


@pytest.mark.parametrize("backend", [pytest.param("horovod", marks=needs_horovod), "torch"])
def test_two_ranks_on_one_gpu_under_mpirun_are_named_before_the_rendezvous(backend: str, tmp_path: Path) -> None:
    """Under mpirun too, and ahead of torch's rendezvous: a MASTER_PORT in use would be the next mistake."""
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        job = run_train(2, tmp_path / "run", *TINY, "--backend", backend, timeout=120,
                        env={"HPCDL_FAKE_GPU_UUIDS": "GPU-fake-0", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(holder.getsockname()[1])})
    assert job.returncode == 2, job.stderr[-3000:]
    lines = error_lines(job.stderr)
    assert len(lines) == 1 and re.match(SHARED_GPU, lines[0]), job.stderr[-3000:]


# ------------------------------------------------------------------ a frozen rank, a stop signal

def test_a_killed_rank_under_torchrun_ends_the_job(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed at step 5 (the OOM killer): torchrun sees its worker die and ends the other."""
    start = time.monotonic()
    job = torchrun(2, tmp_path / "run", "--epochs", "1", "--stall-timeout", "20", "--backend", "torch", timeout=150,
                   env={"HPCDL_FAULT": "1:5:kill"})
    assert job.returncode not in (0, 124), job.stderr[-3000:]
    assert time.monotonic() - start < 120
    assert "injecting fault 'kill' on rank 1 at step 5" in job.stdout, job.stdout[-2000:]
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_frozen_rank_under_torchrun_is_named_and_the_job_ends(tmp_path: Path) -> None:
    """Rank 1 SIGSTOPped at step 5: the watchdog's heartbeats (UDP, no MPI) go silent and rank 0 names it; torchrun
    ends the stopped rank (its SIGTERM waits, then SIGKILL)."""
    start = time.monotonic()
    job = torchrun(2, tmp_path / "run", "--epochs", "1", "--stall-timeout", "4", "--backend", "torch", timeout=150,
                   env={"HPCDL_FAULT": "1:5:stop"})
    assert job.returncode != 0 and job.returncode != 124, job.stderr[-3000:]
    assert time.monotonic() - start < 120
    assert re.search(r"hpcdl: stall: no training step completed for \d+ s \(step 4\); rank 1 went silent \(no "
                     r"heartbeat for \d+ s", job.stderr), job.stderr[-3000:]


@needs_horovod
def test_sigterm_to_a_rank_under_torchrun_checkpoints_and_mpirun_resumes_to_the_uninterrupted_weights(
        tmp_path_factory, tmp_path: Path) -> None:
    """SIGTERM to rank 1 alone at step 30 under torchrun: every rank stops at that step, rank 0 checkpoints, all exit
    0; a resume under mpirun with Horovod ends with the weights of the run that was never stopped."""
    reference = baseline_run(tmp_path_factory)
    run_dir = tmp_path / "run"
    stopped = torchrun(2, run_dir, *BASE_FLAGS, "--keep-checkpoints", "2", "--log-every", "1", "--backend", "torch",
                       env={"HPCDL_FAULT": "1:30:term"})
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "hpcdl: SIGTERM received by rank 1: checkpoint written at step 30" in stopped.stdout
    assert checkpoint_steps(run_dir) == [22, 30]
    resumed = run_train(2, run_dir, "--resume", *BASE_FLAGS, "--keep-checkpoints", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert same_weights(load_checkpoint(run_dir, 44)["model"], load_checkpoint(reference, 44)["model"])


@pytest.mark.parametrize("sig, forwarded", [(signal.SIGTERM, ()),
                                            (signal.SIGUSR1, ("--signals-to-handle",
                                                              "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"))],
                         ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_to_torchrun_reaches_every_rank_and_checkpoints(sig: signal.Signals, forwarded: tuple[str, ...],
                                                                  tmp_path: Path) -> None:
    """What Slurm's --signal and scancel do to a step whose task is torchrun: torchrun hands the signal to its ranks
    (SIGUSR1 only when told to with --signals-to-handle), which checkpoint and stop."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *forwarded,
           "-m", "hpcdl.train", "--output-dir", str(run_dir), "--no-progress", "--epochs", "15", "--backend", "torch",
           "--workers", "0"]
    rc, out, err = signal_once_training(cmd, torch_env(), sig)
    assert re.search(rf"hpcdl: {sig.name} received by all 2 ranks: (checkpoint written at step \d+|stopped after "
                     r"epoch \d+)", out), out[-2000:] + err[-3000:]
    assert "epoch  15/15" not in out and not (run_dir / "summary.json").exists()
    assert checkpoint_steps(run_dir) and checkpoint_steps(run_dir)[-1] >= 22
    # torchrun itself exits 1 after a signal, whatever its ranks did (docs/cluster.md says so)
    assert rc == 1 and f"got signal: {int(sig)}" in err, err[-2000:]
