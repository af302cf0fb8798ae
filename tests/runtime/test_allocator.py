"""glibc malloc tuning (hpcdl/runtime/allocator.py): freed activation-sized blocks stay in the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.mpi_harness import PYTHON, REPO

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier

# Allocate and touch a tensor of each size, free it, and report how much resident memory the free gave back:
# 8 MiB is under glibc's highest mmap threshold (32 MiB), 64 MiB above it (a batch-2048 activation is 75 MiB).
# SETUP is how the process gets the setting: the allocator's call itself, or a rank's start (world.init).
PROBE = """
import json, os
import torch
SETUP
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


SETUPS = {
    "allocator": "from hpcdl.runtime import allocator\ntuned = allocator.keep_freed_memory()",
    "rank": "from hpcdl.runtime import world\nworld.init(use_horovod=False)\ntuned = None",
}


def probe(tuning: str, setup: str = "allocator") -> dict:
    env = {**os.environ, "HPCDL_MALLOC_TUNING": tuning, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([PYTHON, "-c", PROBE.replace("SETUP", SETUPS[setup])], capture_output=True, text=True,
                            timeout=120, cwd=REPO, env=env)
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_every_rank_keeps_freed_memory_from_its_start() -> None:
    """world.init, which every rank of hpcdl.train and of a --task runs, applies the setting (README's promise)."""
    default, tuned = probe("0", "rank"), probe("1", "rank")
    assert default["released"]["64"] >= 63 << 20, default
    assert tuned["released"]["64"] < 1 << 20, tuned
