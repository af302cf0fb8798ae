"""``build_pipeline``: from a :class:`DataSpec` to the right pipeline, with every data check on the way."""

from __future__ import annotations

import torch

from hpcdl.data.in_memory import TensorSplits
from hpcdl.data.order import check_enough
from hpcdl.data.pipeline import FilePipeline, InputPipeline, ResidentPipeline
from hpcdl.data.registry import DatasetEntry, FileSplits, entry, read_dataset, synthetic_tensors
from hpcdl.data.spec import DECODERS, DataSpec
from hpcdl.runtime.errors import UsageError


def build_pipeline(spec: DataSpec, rank: int, size: int, device: torch.device) -> InputPipeline:
    """This rank's pipeline. Raises UsageError (one line naming the file or flag) for bad data; the
    checks read files, so callers run it inside :func:`hpcdl.runtime.errors.agree`."""
    info = entry(spec.dataset)
    if spec.decode not in DECODERS:
        raise UsageError(f"--decode {spec.decode}: choose one of {', '.join(DECODERS)}")
    if spec.batch_size < 1 or spec.test_batch_size < 1:
        raise UsageError("--batch-size and --test-batch-size must be at least 1")
    if spec.decode == "gpu" and info.kind == "tensors":
        raise UsageError(f"--decode gpu applies to JPEG datasets (imagenet), not {spec.dataset}")
    if info.kind == "generated":
        return synthetic_pipeline(spec, info, rank, size, device)
    data = read_dataset(spec.dataset, spec.data_dir)
    if isinstance(data, FileSplits):
        return FilePipeline(spec, rank, size, device, train=data.train, test=data.test, norm=info.norm,
                            num_classes=len(data.classes), decode_on_gpu=decode_on_gpu(spec, device))
    return resident(spec, info, rank, size, device, data)


def decode_on_gpu(spec: DataSpec, device: torch.device) -> bool:
    if spec.decode == "gpu" and device.type != "cuda":
        raise UsageError(f"--decode gpu needs a CUDA device (this rank has {device}); use --decode cpu")
    return spec.decode == "gpu" or (spec.decode == "auto" and device.type == "cuda")


def resident(spec: DataSpec, info: DatasetEntry, rank: int, size: int, device: torch.device,
             data: TensorSplits) -> ResidentPipeline:
    check_enough(len(data.train), size, spec.batch_size)
    return ResidentPipeline(spec, rank, size, device, train=(data.train.images, data.train.labels),
                            test=(data.test.images, data.test.labels), norm=info.norm, num_classes=data.num_classes,
                            crop_padding=info.crop_padding)


def synthetic_pipeline(spec: DataSpec, info: DatasetEntry, rank: int, size: int,
                       device: torch.device) -> ResidentPipeline:
    channels, height, width = spec.synthetic_shape  # checked by hpcdl.training.config with every other flag
    check_enough(spec.synthetic_size, size, spec.batch_size)
    shape = (channels, height, width)
    train = synthetic_tensors(shape, spec.synthetic_size, spec.synthetic_classes, spec.seed, device)
    test = synthetic_tensors(shape, max(1, spec.synthetic_size // 8), spec.synthetic_classes, spec.seed + 1, device)
    return ResidentPipeline(spec, rank, size, device, train=train, test=test, norm=info.norm,
                            num_classes=spec.synthetic_classes)
