"""Virtual clusters for tests: N network-namespace nodes that vanish even when the test fails.

``make_vcluster(nodes, rate=None)`` (a fixture) returns a started :class:`VCluster`; every one
it made is torn down in ``finally`` (processes in its nodes killed, namespaces, veths and bridge
deleted), and clusters left by an earlier crashed run (their creator's pid is gone) are removed
before the first one is made. Skips with the reason without root or iproute2; under CI=true or
HPCDL_REQUIRE_VCLUSTER=1 a missing requirement fails instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from hpcdl.tools import vcluster
from hpcdl.tools.vcluster import VCluster

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
MPIRUN_SH = REPO / "launch" / "mpirun.sh"


def required() -> bool:
    return os.environ.get("CI") == "true" or os.environ.get("HPCDL_REQUIRE_VCLUSTER") == "1"


def skip_or_fail_without_cluster() -> None:
    reason = vcluster.missing_requirements()
    if reason:
        if required():
            pytest.fail(f"virtual-cluster tests must run here (CI=true) but {reason}")
        pytest.skip(reason)


@pytest.fixture
def make_vcluster() -> Iterator[Callable[..., VCluster]]:
    skip_or_fail_without_cluster()
    vcluster.remove_stale()
    made: list[VCluster] = []
    # An outer `timeout` sends SIGTERM, which would end pytest without running this `finally`:
    # turn it into KeyboardInterrupt, which pytest unwinds through the fixtures.
    previous = signal.signal(signal.SIGTERM, _interrupt)

    def make(nodes: int = 2, rate: str | None = None) -> VCluster:
        cluster = vcluster.up(nodes, rate=rate)
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        signal.signal(signal.SIGTERM, previous)
        for cluster in made:
            cluster.down()
        leftovers = [c.name for c in made if Path(f"/run/netns/{c.nodes[0].namespace}").exists()] if made else []
        assert not leftovers, f"namespaces of {leftovers} survived down()"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def launch_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "SLURM_", "HPCDL_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", **extra)
    return env


class Launch:
    """launch/mpirun.sh running in the background, its output in a file, never past its timeout."""

    def __init__(self, args: Sequence[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.started = time.monotonic()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(["timeout", "-s", "KILL", str(int(timeout)), "bash", str(MPIRUN_SH), *args],
                                         stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env or launch_env(),
                                         start_new_session=True)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text.splitlines()[-lines:])

    def wait_for_checkpoint(self, run_dir: Path, seconds: float = 240) -> None:
        """Block until the job has written its first checkpoint; fail if it ends or takes longer."""
        deadline = time.monotonic() + seconds
        while not list((run_dir / "checkpoints").glob("ckpt-*.pt")):
            assert self.proc.poll() is None, f"the job ended before its first checkpoint\n{self.tail()}"
            assert time.monotonic() < deadline, f"no checkpoint after {seconds:.0f} s\n{self.tail()}"
            time.sleep(0.5)


def run_launch(args: Sequence[str], log: Path, timeout: float = 240) -> tuple[int, str]:
    job = Launch(args, log, timeout)
    rc = job.wait(timeout + 15)
    return rc, job.text
