"""Datasets and the input pipeline that feeds them to the training loop.

``build_pipeline(DataSpec(...), rank, size, device)`` is the entry point: it validates the data
(one line naming the file for anything wrong) and returns an :class:`InputPipeline` whose batches
are already on the device. Module map: ``spec`` (names, DataSpec, normalisation constants),
``digits`` / ``mnist`` / ``cifar`` / ``imagenet`` (readers), ``shards`` (the packed format),
``packed_tensors`` (small datasets read back from shards), ``images`` (byte sources, CPU and GPU
decoding), ``augment`` (crops, flips, normalisation), ``order`` (who sees which sample when),
``pipeline`` (the pipelines), ``prefetch`` (the device-decode thread), ``build`` (spec -> pipeline),
``legacy`` (the per-sample DataLoader path of older callers).
"""

from hpcdl.data.build import build_pipeline
from hpcdl.data.legacy import ResumableSampler, ShardSampler, SyntheticImages, load_dataset, make_loaders
from hpcdl.data.pipeline import InputPipeline
from hpcdl.data.spec import CIFAR_MEAN, CIFAR_STD, DATASETS, IMAGENET_MEAN, IMAGENET_STD, DataSpec
from hpcdl.data.tensors import DataBundle

__all__ = [
    "CIFAR_MEAN", "CIFAR_STD", "DATASETS", "IMAGENET_MEAN", "IMAGENET_STD", "DataBundle", "DataSpec",
    "InputPipeline", "ResumableSampler", "ShardSampler", "SyntheticImages", "build_pipeline", "load_dataset",
    "make_loaders",
]
