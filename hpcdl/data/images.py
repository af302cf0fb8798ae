"""Encoded images: where their bytes come from (a folder of files, or packed shards) and how they are
decoded (libjpeg-turbo on the CPU through torchvision.io, or nvJPEG in batches on a CUDA device).

A corrupt file is an OSError naming it (the message is the whole story: hpcdl.runtime.errors prints it as
one line). On the device, a batch that nvJPEG rejects is decoded image by image, and an image it
cannot handle (a PNG, a CMYK JPEG) falls back to the CPU decoder before anything is called corrupt.

torchvision.io is imported where an image is decoded: importing torchvision costs a second (it loads
torch's compiler stack), which a run on in-memory data should not pay at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

JPEG_MAGIC = b"\xff\xd8\xff"
JPEG_END = b"\xff\xd9"


class ByteSource(Protocol):
    """Random access to the encoded samples of one split."""

    labels: np.ndarray  # int64 (N,)

    def __len__(self) -> int: ...

    def read(self, index: int) -> torch.Tensor:
        """The encoded bytes of sample ``index`` as a uint8 tensor."""
        ...

    def name(self, index: int) -> str:
        """Where the sample lives, for error messages."""
        ...


class FolderSource:
    """One file per sample (ImageNet's class folders)."""

    def __init__(self, paths: Sequence[str], labels: Sequence[int]) -> None:
        self.paths = list(paths)
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.paths)

    def read(self, index: int) -> torch.Tensor:
        handle = os.open(self.paths[index], os.O_RDONLY)
        try:
            return read_into_tensor(handle, os.fstat(handle).st_size, 0, self.paths[index])
        finally:
            os.close(handle)

    def name(self, index: int) -> str:
        return self.paths[index]


def read_into_tensor(handle: int, length: int, offset: int, name: str) -> torch.Tensor:
    """``length`` bytes at ``offset`` of an open file, read straight into a new uint8 tensor (no
    intermediate bytes object: one copy less per image than ``read()`` + ``frombuffer``)."""
    out = torch.empty(length, dtype=torch.uint8)
    view = memoryview(out.numpy().data)
    done = 0
    while done < length:
        count = os.preadv(handle, [view[done:]], offset + done)
        if count == 0:
            raise OSError(f"{name} ended early: {done} of {length} bytes at byte {offset}")
        done += count
    return out


def is_jpeg(data: torch.Tensor) -> bool:
    return bytes(data[:3].tolist()) == JPEG_MAGIC


def is_whole_jpeg(data: torch.Tensor) -> bool:
    """A JPEG that ends with its end-of-image marker. Anything else (a truncated file, trailing bytes) is
    decoded by libjpeg-turbo, which refuses a truncated file by name: nvJPEG is not relied on to."""
    return is_jpeg(data) and bytes(data[-2:].tolist()) == JPEG_END


def decode_cpu(data: torch.Tensor, name: str, channels: int = 3) -> torch.Tensor:
    """Any format torchvision.io reads (JPEG through libjpeg-turbo, PNG, ...) -> uint8 (C, H, W), C = 1 or 3."""
    from torchvision.io import ImageReadMode, decode_image

    try:
        return decode_image(data, mode=ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB)
    except (RuntimeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise OSError(f"cannot decode image {name}: {reason}") from exc


def decode_on_device(datas: list[torch.Tensor], names: list[str], device: torch.device) -> list[torch.Tensor]:
    """A batch of JPEG byte tensors -> uint8 (3, H, W) tensors on ``device`` (one batched nvJPEG call on CUDA)."""
    if not datas:
        return []
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return list(decode_jpeg(datas, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        pass
    images = []
    for data, name in zip(datas, names, strict=True):  # find the culprit(s); decode the rest as usual
        try:
            images.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            images.append(decode_cpu(data, name).to(device, non_blocking=True))
    return images
