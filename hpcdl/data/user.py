"""A user's map-style datasets through hpcdl's one order: :class:`DatasetPipeline`.

The training order is :func:`hpcdl.data.order.rank_order`'s, as for the built-in datasets: one permutation
per epoch from ``(seed, epoch)``, cut to whole steps and dealt round-robin, so each example is seen once per
epoch across ranks and batch ``k`` of an epoch is rebuilt without the batches before it (an exact resume,
also on another world size with the same global batch). DataLoader workers read the items (``--workers``),
pinned and copied to the device one batch ahead on CUDA. Items are ``(input, target)`` pairs batched by
torch's ``default_collate``, or anything the task's ``collate`` turns into an ``(inputs, targets)``
pair. An item must not depend on global random state: workers and ranks would draw
differently; draw from a generator seeded with the item's index instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from hpcdl.data.order import rank_order, test_order
from hpcdl.data.pipeline import Batch, KeySampler, LoaderPipeline, copied_ahead
from hpcdl.data.spec import DataSpec
from hpcdl.runtime.errors import UsageError


class DatasetPipeline(LoaderPipeline):
    """A user's training and evaluation datasets, sharded over ranks exactly as hpcdl's own."""

    def __init__(self, spec: DataSpec, rank: int, size: int, device: torch.device, *,
                 train: Dataset, test: Dataset, collate: Callable[[list[Any]], Any] | None = None) -> None:
        check_map_style(train, "the training dataset")
        check_map_style(test, "the evaluation dataset")
        self.shard(spec, rank, size, device, len(train), len(test))  # type: ignore[arg-type]
        self.num_classes = 0  # a task's outputs are its own business
        self.collate = collate
        first = train[0]  # an input's shape where the items are (tensor, target) pairs; else unknown
        pair = isinstance(first, (tuple, list)) and len(first) == 2 and isinstance(first[0], torch.Tensor)
        self.input_shape = tuple(first[0].shape) if pair else ()
        self.open_loaders(train, test)

    def loader(self, data: Dataset, keys: KeySampler, batch_size: int) -> DataLoader:
        options = self.loader_options(keys, batch_size, pin=self.device.type == "cuda")
        if self.collate is not None:
            options["collate_fn"] = self.collate
        return DataLoader(data, **options)

    def train_epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        batch = self.spec.batch_size
        order = rank_order(self.train_samples, self.spec.seed, epoch, self.rank, self.size, batch)
        self.train_keys.keys = order[start_step * batch:].tolist()
        return copied_ahead(iter(self.train_loader), self.device)

    def test_batches(self) -> Iterator[Batch]:
        self.test_keys.keys = list(test_order(self.test_samples, self.rank, self.size))
        return copied_ahead(iter(self.test_loader), self.device)


def check_map_style(data: Any, what: str) -> None:
    """A map-style dataset with at least one item; an IterableDataset cannot be sharded exactly, so it is refused."""
    if isinstance(data, IterableDataset):
        raise UsageError(f"{what} is an IterableDataset: hpcdl shards map-style datasets (__len__ and __getitem__) "
                         "so that each example is seen once per epoch and a resume is exact")
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise UsageError(f"{what} is a {type(data).__name__}: it needs __len__ and __getitem__ (a map-style "
                         "torch.utils.data.Dataset)")
    if len(data) < 1:
        raise UsageError(f"{what} is empty")
