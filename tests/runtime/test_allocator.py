"""glibc malloc tuning (hpcdl/runtime/allocator.py): freed activation-sized blocks stay in the process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.mpi_harness import PYTHON, REPO

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier

# Allocate and touch a tensor of each size, free it, and report how much resident memory the free gave back:
# 8 MiB is under glibc's highest mmap threshold (32 MiB), 64 MiB above it (a batch-2048 activation is 75 MiB).
PROBE = """
import json, os
import torch
from hpcdl.runtime import allocator

tuned = allocator.keep_freed_memory()
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
released = {}
for mib in (8, 64):
    block = torch.ones(mib << 18)  # every page touched
    held = rss()
    del block
    released[mib] = held - rss()
print(json.dumps({"tuned": tuned, "released": released}))
"""


def probe(tuning: str) -> dict:
    env = {"HPCDL_MALLOC_TUNING": tuning, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([PYTHON, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_block_stays_in_the_process_only_when_tuned() -> None:
    default, tuned = probe("0"), probe("1")
    assert default["tuned"] is False and tuned["tuned"] is True
    for mib in ("8", "64"):
        # glibc's default: the block's own mapping goes back to the kernel at once
        assert default["released"][mib] >= (int(mib) - 1) << 20, (mib, default)
        # tuned: the pages stay for the next step's buffers, above the highest mmap threshold too
        assert tuned["released"][mib] < 1 << 20, (mib, tuned)
