"""The communicator a preconditioner takes when none is given: the job's own, whichever starts it.

Horovod's in an initialised Horovod job of several ranks; torch.distributed's wherever its default
process group is initialised with several ranks (torchrun, a user's DDP loop); one process otherwise.
A process that a launcher started as one of several (WORLD_SIZE > 1) with neither up is refused: its
factors would silently be its own, and the replicas would drift apart.
"""

from __future__ import annotations

import os
import sys

from kfac.comm import Communicator, HorovodCommunicator, SingleProcess


def default_communicator() -> Communicator:
    """The job's communicator (see the module's docstring). Horovod is only looked at if it has been imported
    already: a job that uses it has imported it."""
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hasattr(hvd, "is_initialized") and hvd.is_initialized() and hvd.size() > 1:
        return HorovodCommunicator(hvd)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from kfac.torch_comm import TorchCommunicator

        return TorchCommunicator()
    size = os.environ.get("WORLD_SIZE", "").strip()
    if size.isdigit() and int(size) > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"KFACPreconditioner: this process is one of WORLD_SIZE={size} ranks, but "
                           "torch.distributed is not initialised: call torch.distributed.init_process_group before "
                           "building the preconditioner (or pass communicator=SingleProcess() to precondition "
                           "each rank alone)")
    return SingleProcess()
