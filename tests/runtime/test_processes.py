"""hpcdl.runtime.processes.pid_alive: the one "is this process alive" check (locks, staged folders, clusters)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpcdl.runtime.processes import pid_alive


def test_this_process_and_init_are_alive() -> None:
    assert pid_alive(os.getpid()) and pid_alive(1)  # pid 1 is alive whether or not we may signal it


@pytest.mark.processes
def test_a_process_that_ended_and_was_reaped_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)
