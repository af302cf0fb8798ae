"""ImageNet-style class folders: DATA_DIR/train/<class>/*.JPEG and DATA_DIR/val/<class>/*.JPEG.

Two readers: :func:`load_imagenet` keeps the original per-sample PIL path (the baseline that
benchmarks/loader_throughput.py compares against), :func:`list_imagenet` lists the files for the
input pipeline, which reads bytes and decodes with torchvision.io.
"""

from __future__ import annotations

from pathlib import Path

from hpcdl.data.images import FolderSource
from hpcdl.data.spec import IMAGENET_MEAN, IMAGENET_STD
from hpcdl.data.tensors import DataBundle
from hpcdl.runtime.errors import UsageError


def open_image(path: str):  # -> PIL.Image.Image
    """Open an image as RGB; a corrupt file names itself (PIL's own message does not)."""
    from PIL import Image

    try:
        with open(path, "rb") as handle:
            return Image.open(handle).convert("RGB")
    except OSError as exc:
        raise OSError(f"cannot decode image {path}: {exc}") from exc


def check_folders(data_dir: Path) -> None:
    for split in ("train", "val"):
        if not (data_dir / split).is_dir():
            raise UsageError(f"--data-dir {data_dir}: no {split}/ folder of class subfolders")


def list_split(folder: Path) -> tuple[list[str], list[str], list[int]]:
    """(class names, file paths, labels) of one split, in torchvision ImageFolder's order and conventions."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    try:
        classes, class_to_idx = find_classes(str(folder))
        samples = make_dataset(str(folder), class_to_idx, extensions=IMG_EXTENSIONS)
    except (FileNotFoundError, RuntimeError) as exc:
        raise UsageError(f"--data-dir {folder.parent}: {str(exc).splitlines()[0]}") from exc
    return classes, [path for path, _ in samples], [label for _, label in samples]


def list_imagenet(data_dir: Path) -> tuple[list[str], FolderSource, FolderSource]:
    """Class names and the training and validation files, checked for a matching class list."""
    check_folders(data_dir)
    classes, train_paths, train_labels = list_split(data_dir / "train")
    val_classes, val_paths, val_labels = list_split(data_dir / "val")
    if classes != val_classes:
        raise UsageError(f"--data-dir {data_dir}: train/ and val/ have different class folders")
    return classes, FolderSource(train_paths, train_labels), FolderSource(val_paths, val_labels)


def load_imagenet(data_dir: Path, image_size: int = 224) -> DataBundle:
    """The per-sample PIL path (torchvision ImageFolder + transforms on PIL images, float32 out)."""
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    check_folders(data_dir)
    normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train_tf = transforms.Compose(
        [transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]
    )
    resize = int(round(image_size / 0.875))
    test_tf = transforms.Compose(
        [transforms.Resize(resize), transforms.CenterCrop(image_size), transforms.ToTensor(), normalize]
    )
    try:
        train = ImageFolder(str(data_dir / "train"), transform=train_tf, loader=open_image)
        test = ImageFolder(str(data_dir / "val"), transform=test_tf, loader=open_image)
    except (FileNotFoundError, RuntimeError) as exc:
        raise UsageError(f"--data-dir {data_dir}: {exc}") from exc
    if train.classes != test.classes:
        raise UsageError(f"--data-dir {data_dir}: train/ and val/ have different class folders")
    return DataBundle(train, test, len(train.classes), 3, image_size)
