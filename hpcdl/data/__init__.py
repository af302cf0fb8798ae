"""Datasets and the input pipeline that feeds them to the training loop.

``build_pipeline(DataSpec(...), rank, size, device)`` is the entry point: it validates the data
(one line naming the file for anything wrong) and returns an :class:`InputPipeline` whose batches
are already on the device. Module map: ``registry`` (the datasets by name: reader, normalisation,
augmentation), ``spec`` (DataSpec), ``digits`` / ``mnist`` / ``cifar`` / ``imagenet`` (readers of
the standard layouts), ``shards`` (the packed format), ``unpack`` (small datasets read back
from shards into memory, the inverse of ``python -m hpcdl.pack``), ``in_memory`` (in-memory splits),
``images`` (byte sources, CPU and GPU decoding), ``user`` (a user's map-style datasets),
``augment`` (crops, flips, normalisation), ``order`` (who sees which sample when), ``pipeline``
(the pipelines), ``prefetch`` (the device-decode thread), ``build`` (spec -> pipeline).
"""

from hpcdl.data.from_spec import build_pipeline
from hpcdl.data.in_memory import TensorSplits
from hpcdl.data.pipeline import InputPipeline
from hpcdl.data.registry import DATASETS, REGISTRY, FileSplits, read_dataset
from hpcdl.data.spec import DataSpec
from hpcdl.data.user import DatasetPipeline

__all__ = ["DATASETS", "REGISTRY", "DataSpec", "DatasetPipeline", "FileSplits", "InputPipeline", "TensorSplits",
           "build_pipeline", "read_dataset"]
