"""On PYTHONPATH, every rank (RANK set) runs on one CPU and its Gloo worker threads only when nothing else there
wants to run (SCHED_IDLE): a worker is then held up between finishing a collective and letting go of its tensors,
as one is, now and then, on a loaded node. tests/runtime/test_shutdown.py uses it to make that race certain."""

import os
import threading
import time


def _demote_gloo_threads() -> None:
    demoted: set[str] = set()
    while True:
        for tid in os.listdir("/proc/self/task"):
            if tid in demoted:
                continue
            try:
                with open(f"/proc/self/task/{tid}/comm") as comm:
                    name = comm.read().strip()
                if name.startswith("pt_gloo"):
                    os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                    demoted.add(tid)
            except OSError:  # the thread ended meanwhile
                continue
        time.sleep(0.05)


if os.environ.get("RANK"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    threading.Thread(target=_demote_gloo_threads, name="slow-gloo", daemon=True).start()
