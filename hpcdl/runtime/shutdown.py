"""How a program that ran torch.distributed's collectives ends: every exit handler while Python is whole, then
no interpreter finalization.

Gloo's worker threads let go of a collective's tensors just after the caller has its result. When theirs is the
last hold on a tensor that has a Python object, letting go needs the GIL, and once the interpreter has begun
finalizing, Python 3.11 ends a thread that asks for the GIL by unwinding it; the unwind through Gloo's C++
destructors aborts the process ("terminate called without an active exception", SIGABRT; gdb on the core:
``ProcessGroupGloo::runLoop`` > ``~AsyncBroadcastWork`` > ``TensorImpl::decref_pyobject`` > ``take_gil`` >
``pthread_exit``). On a loaded node a rank of a finished torchrun job ended so now and then, and torchrun then
called the job failed, after its store's agent had waited 300 s for the lost rank.

So such a program ends as Python's exit would, less the finalization: it waits for its non-daemon threads, runs
every exit handler (hpcdl's: the process group destroyed, the watchdog stopped, the run's lock released; the
libraries': logging's flush, Horovod's shutdown), finalizes MPI where mpi4py started it (mpi4py would at
finalization), flushes its streams and leaves with ``os._exit``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def collectives_started() -> bool:
    """True while a torch.distributed process group is up in this process (its backend's threads are running)."""
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def end_process(code: int) -> NoReturn:
    """Exit with ``code``; past a torch.distributed process group, without interpreter finalization (see above).
    Only for a program's last call: nothing after it runs, and no caller can catch it."""
    if not collectives_started():
        sys.exit(code)
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    _finalize_mpi()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(code)


def _finalize_mpi() -> None:
    """MPI_Finalize where mpi4py started MPI and it is still up: mpi4py's own call, registered with Py_AtExit,
    would only run at finalization."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
