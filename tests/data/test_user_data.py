"""A user's map-style dataset through hpcdl's order: exact shards, each example once per epoch, exact resume
mid-epoch and on another world size, workers giving what the main process gives, an IterableDataset refused."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from hpcdl.data import DatasetPipeline, DataSpec
from hpcdl.runtime.errors import UsageError

CPU = torch.device("cpu")
SAMPLES = 103  # not a multiple of anything: the cut and the shards are uneven


class Indexed(Dataset):
    """Item i is (i as a 2-vector, i): what a batch holds says which examples it took."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([index, index], dtype=torch.float32), index


def pipeline(rank: int, size: int, batch: int, workers: int = 0, test: Dataset | None = None) -> DatasetPipeline:
    spec = DataSpec(dataset="task", data_dir=None, batch_size=batch, test_batch_size=10, workers=workers, seed=7)
    return DatasetPipeline(spec, rank, size, CPU, train=Indexed(), test=test or Indexed())


def epoch_targets(rank: int, size: int, batch: int, epoch: int, start: int = 0, workers: int = 0) -> list[list[int]]:
    pipe = pipeline(rank, size, batch, workers)
    try:
        return [targets.tolist() for _, targets in pipe.train_epoch(epoch, start)]
    finally:
        pipe.close()


def test_each_example_is_seen_once_per_epoch_across_ranks_and_epochs_differ() -> None:
    size, batch = 3, 8
    steps = SAMPLES // size // batch
    seen = [i for rank in range(size) for b in epoch_targets(rank, size, batch, 0) for i in b]
    assert len(seen) == len(set(seen)) == steps * batch * size  # the cut: whole steps on every rank
    assert all(len(epoch_targets(rank, size, batch, 0)) == steps for rank in range(size))
    assert epoch_targets(0, size, batch, 1) != epoch_targets(0, size, batch, 0)


def test_inputs_and_targets_stay_paired() -> None:
    pipe = pipeline(0, 2, 8)
    for inputs, targets in pipe.train_epoch(0):
        assert torch.equal(inputs[:, 0].long(), targets) and inputs.shape == (8, 2)


def test_a_resume_mid_epoch_yields_the_rest_of_the_uninterrupted_epoch() -> None:
    whole = epoch_targets(1, 2, 8, epoch=2)
    assert epoch_targets(1, 2, 8, epoch=2, start=3) == whole[3:]


def test_one_rank_with_twice_the_batch_holds_two_ranks_batches_as_micro_batches() -> None:
    """What makes a resume on another world size exact: micro-batch j of one rank's batch is rank j's batch."""
    one = epoch_targets(0, 1, 16, epoch=1)
    two = [epoch_targets(rank, 2, 8, epoch=1) for rank in range(2)]
    for step, batch in enumerate(one):
        for j in range(2):
            assert batch[j::2] == two[j][step]


@pytest.mark.processes  # DataLoader workers are processes
def test_workers_give_what_the_main_process_gives() -> None:
    assert epoch_targets(0, 2, 8, epoch=0, workers=2) == epoch_targets(0, 2, 8, epoch=0)


def test_evaluation_shards_cover_the_evaluation_set_once() -> None:
    seen = [i for rank in range(3) for _, targets in pipeline(rank, 3, 8).test_batches() for i in targets.tolist()]
    assert sorted(seen) == list(range(SAMPLES))


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield torch.zeros(2), 0


def test_an_iterable_dataset_is_refused_in_one_line() -> None:
    spec = DataSpec(dataset="task", data_dir=None, batch_size=8, test_batch_size=8, workers=0, seed=0)
    with pytest.raises(UsageError, match="the evaluation dataset is an IterableDataset: hpcdl shards") as raised:
        DatasetPipeline(spec, 0, 1, CPU, train=Indexed(), test=Stream())
    assert "\n" not in str(raised.value)


def test_too_few_examples_for_the_ranks_is_one_line() -> None:
    spec = DataSpec(dataset="task", data_dir=None, batch_size=8, test_batch_size=8, workers=0, seed=0)
    tiny = TensorDataset(torch.zeros(10, 2), torch.zeros(10))
    with pytest.raises(UsageError, match="10 training samples cannot give 2 ranks a batch of 8 each"):
        DatasetPipeline(spec, 0, 2, CPU, train=tiny, test=tiny)
