"""hpcdl.runtime.world in one process: what it asks of MPI before MPI starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hpcdl.runtime import world
from tests.support.mpi_harness import REPO

# Records the variable at the moment mpi4py.MPI is imported, which is when MPI starts and reads it.
PROBE = textwrap.dedent("""
    import importlib.abc, os, sys
    seen = []
    class Watch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "mpi4py.MPI":
                seen.append(os.environ.get("OMPI_MCA_mpi_yield_when_idle", "unset"))
            return None
    sys.meta_path.insert(0, Watch())
    from hpcdl.runtime import world
    world.init(use_horovod=False)
    print("at MPI's start:", seen[0] if seen else "mpi4py.MPI was already imported")
""")


def test_yield_when_idle_asks_open_mpi_to_yield_and_keeps_a_users_choice() -> None:
    env: dict[str, str] = {}
    world.yield_when_idle(env)
    assert env == {"OMPI_MCA_mpi_yield_when_idle": "1"}
    mine = {"OMPI_MCA_mpi_yield_when_idle": "0"}
    world.yield_when_idle(mine)
    assert mine == {"OMPI_MCA_mpi_yield_when_idle": "0"}


@pytest.mark.processes
@pytest.mark.parametrize(("given", "expected"), [(None, "1"), ("0", "0")])
def test_mpi_starts_with_the_yield_setting_in_its_environment(given: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMPI_MCA_mpi_yield_when_idle"}
    if given is not None:
        env["OMPI_MCA_mpi_yield_when_idle"] = given
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"at MPI's start: {expected}" in done.stdout
