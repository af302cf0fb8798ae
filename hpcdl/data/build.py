"""``build_pipeline``: from a :class:`DataSpec` to the right pipeline, with every data check on the way."""

from __future__ import annotations

from pathlib import Path

import torch

from hpcdl.data.order import check_enough
from hpcdl.data.pipeline import FilePipeline, InputPipeline, ResidentPipeline
from hpcdl.data.spec import DATASETS, DECODERS, IDENTITY_NORM, IMAGENET_NORM, DataSpec
from hpcdl.data.tensors import ImageTensors
from hpcdl.runtime.errors import UsageError

CIFAR_CROP_PADDING = 4


def build_pipeline(spec: DataSpec, rank: int, size: int, device: torch.device) -> InputPipeline:
    """This rank's pipeline. Raises UsageError (one line naming the file or flag) for bad data; the
    checks read files, so callers run it inside :func:`hpcdl.errors.agree`."""
    if spec.dataset not in DATASETS:
        raise UsageError(f"unknown dataset {spec.dataset!r}; choose one of {', '.join(DATASETS)}")
    if spec.decode not in DECODERS:
        raise UsageError(f"--decode {spec.decode}: choose one of {', '.join(DECODERS)}")
    if spec.batch_size < 1 or spec.test_batch_size < 1:
        raise UsageError("--batch-size and --test-batch-size must be at least 1")
    if spec.dataset == "synthetic":
        return synthetic_pipeline(spec, rank, size, device)
    if spec.dataset == "digits":
        from hpcdl.data.digits import load_digits

        data = load_digits(seed=0)  # a fixed split: every run is evaluated on the same images
        return resident(spec, rank, size, device, data.train, data.test, data.num_classes)  # type: ignore[arg-type]

    from hpcdl.data.legacy import check_data_dir
    from hpcdl.data.shards import is_shard_folder

    path = check_data_dir(spec.dataset, spec.data_dir)
    if is_shard_folder(path):
        return shard_pipeline(spec, rank, size, device, path)
    if spec.decode == "gpu" and spec.dataset != "imagenet":
        raise UsageError(f"--decode gpu applies to JPEG datasets (imagenet), not {spec.dataset}")
    if spec.dataset == "mnist":
        from hpcdl.data.mnist import load_mnist

        data = load_mnist(path)
        return resident(spec, rank, size, device, data.train, data.test, data.num_classes)  # type: ignore[arg-type]
    if spec.dataset == "cifar10":
        from hpcdl.data.cifar import load_cifar10

        data = load_cifar10(path)
        return resident(spec, rank, size, device, data.train, data.test, data.num_classes,  # type: ignore[arg-type]
                        CIFAR_CROP_PADDING)
    from hpcdl.data.imagenet import list_imagenet

    classes, train, test = list_imagenet(path)
    return FilePipeline(spec, rank, size, device, train=train, test=test, norm=IMAGENET_NORM,
                        num_classes=len(classes), decode_on_gpu=decode_on_gpu(spec, device))


def decode_on_gpu(spec: DataSpec, device: torch.device) -> bool:
    if spec.decode == "gpu" and device.type != "cuda":
        raise UsageError(f"--decode gpu needs a CUDA device (this rank has {device}); use --decode cpu")
    return spec.decode == "gpu" or (spec.decode == "auto" and device.type == "cuda")


def resident(spec: DataSpec, rank: int, size: int, device: torch.device, train: ImageTensors, test: ImageTensors,
             num_classes: int, crop_padding: int = 0) -> ResidentPipeline:
    check_enough(len(train), size, spec.batch_size)
    return ResidentPipeline(spec, rank, size, device, train=(train.images, train.labels),
                            test=(test.images, test.labels), norm=train.norm, num_classes=num_classes,
                            crop_padding=crop_padding)


def synthetic_pipeline(spec: DataSpec, rank: int, size: int, device: torch.device) -> ResidentPipeline:
    """Random N(0, 1) images generated on the device: a pool of 256 that samples cycle through."""
    channels, height, width = spec.synthetic_shape
    if height != width:
        raise UsageError("--synthetic-shape must be square: C H H")
    if spec.synthetic_size < 1 or spec.synthetic_classes < 1:
        raise UsageError("--synthetic-size and --synthetic-classes must be at least 1")

    def draw(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator(device=device).manual_seed(seed)
        images = torch.randn(min(256, length), channels, height, width, generator=generator, device=device)
        labels = torch.randint(0, spec.synthetic_classes, (length,), generator=generator, device=device)
        return images, labels

    check_enough(spec.synthetic_size, size, spec.batch_size)
    return ResidentPipeline(spec, rank, size, device, train=draw(spec.synthetic_size, spec.seed),
                            test=draw(max(1, spec.synthetic_size // 8), spec.seed + 1), norm=IDENTITY_NORM,
                            num_classes=spec.synthetic_classes)


def shard_pipeline(spec: DataSpec, rank: int, size: int, device: torch.device, path: Path) -> InputPipeline:
    from hpcdl.data.shards import ShardSource, read_index

    index = read_index(path)
    if index.dataset != spec.dataset:
        raise UsageError(f"--data-dir {path} holds {index.dataset} shards, not {spec.dataset}")
    train, test = ShardSource(index.splits["train"]), ShardSource(index.splits["val"])
    if spec.dataset == "imagenet":
        return FilePipeline(spec, rank, size, device, train=train, test=test, norm=IMAGENET_NORM,
                            num_classes=len(index.classes), decode_on_gpu=decode_on_gpu(spec, device))
    if spec.decode == "gpu":
        raise UsageError(f"--decode gpu applies to JPEG datasets (imagenet), not {spec.dataset}")
    from hpcdl.data.packed_tensors import decode_all

    train_set, test_set = decode_all(spec.dataset, train), decode_all(spec.dataset, test)
    padding = CIFAR_CROP_PADDING if spec.dataset == "cifar10" else 0
    return resident(spec, rank, size, device, train_set, test_set, len(index.classes), padding)
