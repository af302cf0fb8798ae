"""MNIST from the standard IDX files, read through torchvision's own MNIST reader functions.

Accepted layouts, in this order: the files directly in ``--data-dir``; torchvision's ``MNIST/raw``
below it; ``raw`` below it. Each file may be named with a hyphen (``train-images-idx3-ubyte``,
the canonical name) or a dot (``train-images.idx3-ubyte``, as some mirrors ship it), optionally
gzipped. Every file's header is checked before torchvision parses it, so a wrong or truncated
file is one line naming it, never an assertion from deep inside the reader.
"""

from __future__ import annotations

import gzip
import os
import struct
import tempfile
from pathlib import Path

import torch

from hpcdl.data.in_memory import ImageTensors, TensorSplits, validate_images
from hpcdl.runtime.errors import UsageError

IMAGE_MAGIC, LABEL_MAGIC = 2051, 2049  # 0x00000803: uint8 3-d; 0x00000801: uint8 1-d
IMAGE_SIDE = 28
NUM_CLASSES = 10
SPLITS = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def name_variants(name: str) -> list[str]:
    """``train-images-idx3-ubyte`` -> itself, ``train-images.idx3-ubyte``, and both with ``.gz``."""
    stem, _, kind = name.rpartition("-idx")
    dotted = f"{stem}.idx{kind}"
    return [name, dotted, name + ".gz", dotted + ".gz"]


def find_file(data_dir: Path, name: str) -> Path:
    folders = [data_dir, data_dir / "MNIST" / "raw", data_dir / "raw"]
    for folder in folders:
        for variant in name_variants(name):
            if (folder / variant).is_file():
                return folder / variant
    raise UsageError(f"--data-dir {data_dir}: MNIST file {name} not found (nor its .idx/.gz variants, "
                     "nor under MNIST/raw/); run `python -m hpcdl.fetch_mnist --output DIR` to get the files")


def read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as handle:
                return handle.read()
        return path.read_bytes()
    except (OSError, EOFError) as exc:
        raise UsageError(f"MNIST file {path} is unreadable ({exc})") from exc


def check_header(path: Path, data: bytes, magic: int) -> int:
    """The IDX header matches ``magic`` and the file holds exactly the items it announces; returns their count."""
    dims = 3 if magic == IMAGE_MAGIC else 1
    header = 4 + 4 * dims
    kind = "image" if dims == 3 else "label"
    if len(data) >= 4 and struct.unpack(">I", data[:4])[0] != magic:
        found = struct.unpack(">I", data[:4])[0]
        raise UsageError(f"MNIST file {path}: IDX magic number {found:#010x}, expected {magic:#010x} ({kind} file)")
    if len(data) < header:
        raise UsageError(f"MNIST file {path}: {len(data)} bytes, too short for an IDX {kind} header")
    _, *shape = struct.unpack(f">{1 + dims}I", data[:header])
    if dims == 3 and shape[1:] != [IMAGE_SIDE, IMAGE_SIDE]:
        raise UsageError(f"MNIST file {path}: images are {shape[1]}x{shape[2]}, expected {IMAGE_SIDE}x{IMAGE_SIDE}")
    per_item = IMAGE_SIDE * IMAGE_SIDE if dims == 3 else 1
    expected = header + shape[0] * per_item
    if len(data) != expected:
        raise UsageError(f"MNIST file {path}: {len(data)} bytes, but its header announces {shape[0]} {kind}s "
                         f"({expected} bytes)")
    return shape[0]


def parse_with_torchvision(path: Path, data: bytes, images: bool) -> torch.Tensor:
    """torchvision's reader takes a path of an uncompressed file; a gzipped one is inflated to a temp file."""
    from torchvision.datasets.mnist import read_image_file, read_label_file

    reader = read_image_file if images else read_label_file
    try:
        if path.suffix != ".gz":
            return reader(str(path))
        with tempfile.TemporaryDirectory(prefix="hpcdl-mnist-") as folder:
            plain = os.path.join(folder, path.stem)
            with open(plain, "wb") as handle:
                handle.write(data)
            return reader(plain)
    except Exception as exc:  # noqa: BLE001 - the header passed, so anything here is a malformed body
        raise UsageError(f"MNIST file {path} is malformed ({type(exc).__name__}: {exc})") from exc


def load_split(data_dir: Path, split: str) -> ImageTensors:
    image_name, label_name = SPLITS[split]
    image_path, label_path = find_file(data_dir, image_name), find_file(data_dir, label_name)
    image_data, label_data = read_bytes(image_path), read_bytes(label_path)
    n_images = check_header(image_path, image_data, IMAGE_MAGIC)
    n_labels = check_header(label_path, label_data, LABEL_MAGIC)
    if n_images != n_labels:
        raise UsageError(f"MNIST files {image_path} and {label_path}: {n_images} images but {n_labels} labels")
    images = parse_with_torchvision(image_path, image_data, images=True).unsqueeze(1)  # (N, 1, 28, 28)
    labels = parse_with_torchvision(label_path, label_data, images=False)
    if n_labels and int(labels.max()) >= NUM_CLASSES:
        raise UsageError(f"MNIST file {label_path}: label {int(labels.max())} out of range 0..{NUM_CLASSES - 1}")
    validate_images(f"MNIST file {image_path}", images, labels, NUM_CLASSES, (1, IMAGE_SIDE, IMAGE_SIDE))
    return ImageTensors(images, labels)


def load_mnist(data_dir: Path) -> TensorSplits:
    """The 60,000 training and 10,000 test images (or whatever subset the files hold), as uint8 tensors."""
    return TensorSplits(load_split(data_dir, "train"), load_split(data_dir, "test"), NUM_CLASSES)
