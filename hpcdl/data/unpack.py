"""Small datasets (CIFAR-10, MNIST) read back from PNG shards (``python -m hpcdl.pack``) into memory as
uint8 tensors."""

from __future__ import annotations

import torch

from hpcdl.data.images import ByteSource, decode_cpu
from hpcdl.data.in_memory import ImageTensors, validate_images
from hpcdl.runtime.errors import UsageError


def decode_all(dataset: str, source: ByteSource, shape: tuple[int, int, int], num_classes: int) -> ImageTensors:
    """Every image of ``source``, each checked to be ``shape`` (C, H, W)."""
    images = []
    for index in range(len(source)):
        try:
            image = decode_cpu(source.read(index), source.name(index), channels=shape[0])
        except OSError as exc:
            raise UsageError(str(exc)) from exc
        if tuple(image.shape) != shape:
            raise UsageError(f"image {source.name(index)} is {tuple(image.shape)}, expected {shape} for {dataset}")
        images.append(image)
    tensors = torch.stack(images)
    labels = torch.from_numpy(source.labels.copy())
    validate_images(f"{dataset} shards in {getattr(source, 'paths', ['?'])[0]}..", tensors, labels, num_classes,
                    shape)
    return ImageTensors(tensors, labels)
