"""Under real MPI (``mpiexec -n N python -m pytest --with-mpi -m mpi``): each rank builds its own
pipeline over the same shard folder and folder dataset, and MPI's allgather of what every rank saw
shows each sample exactly once per epoch, with equal step counts, in either format."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.support.mpi_harness import assert_all_ranks

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def datasets():  # type: ignore[no-untyped-def]
    """Rank 0 writes the data and packs it; every rank gets the path (or rank 0's error) by broadcast."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    root, error = None, None
    if comm.Get_rank() == 0:
        try:
            from hpcdl.tools.pack import pack
            from tests.support.data_files import write_imagenet

            root = Path(tempfile.mkdtemp(prefix="hpcdl-shards-mpi-"))
            write_imagenet(root / "folder", classes=3, per_class=9, size=32)
            pack("imagenet", root / "folder", root / "shards", shard_bytes=4000, seed=0, force=False)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = repr(exc)
    root, error = comm.bcast((root, error), root=0)
    assert_all_ranks(error is None, f"preparing data: {error}")
    yield root
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


def test_every_sample_once_per_epoch_over_mpi_ranks(datasets: Path) -> None:
    from mpi4py import MPI

    from hpcdl.data import DataSpec, build_pipeline

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    ok, message = True, ""
    for kind in ("folder", "shards"):
        spec = DataSpec("imagenet", str(datasets / kind), batch_size=2, test_batch_size=4, workers=0, seed=3,
                        image_size=16)
        pipeline = build_pipeline(spec, rank, size, torch.device("cpu"))
        for epoch in (0, 1):
            keys = pipeline.train_keys_for(epoch, 0)  # type: ignore[attr-defined]
            source = pipeline.train_source  # type: ignore[attr-defined]
            mine = [hashlib.sha256(bytes(source.read(i))).hexdigest() for i, _ in keys]
            steps = len(list(pipeline.train_epoch(epoch)))
            everyone = comm.allgather((mine, steps))
            seen = [digest for samples, _ in everyone for digest in samples]
            expected = (27 // size) // 2 * 2 * size
            if len({s for _, s in everyone}) != 1 or len(seen) != len(set(seen)) or len(seen) != expected:
                ok, message = False, f"{kind} epoch {epoch}: {len(seen)} seen, {len(set(seen))} distinct"
        views = [hashlib.sha256(x.numpy().tobytes()).hexdigest() for batch, _ in pipeline.test_batches()
                 for x in batch]
        all_views = [v for part in comm.allgather(views) for v in part]
        if kind == "folder":
            folder_views = Counter(all_views)
        elif Counter(all_views) != folder_views or len(all_views) != 27:
            ok, message = False, "evaluation views of the shards differ from the folder's"
        pipeline.close()
    assert_all_ranks(ok, message)
