"""ImageNet-style class folders: DATA_DIR/train/<class>/*.JPEG and DATA_DIR/val/<class>/*.JPEG.

:func:`list_imagenet` lists the files; the input pipeline reads their bytes and decodes them
(:mod:`hpcdl.data.images`).
"""

from __future__ import annotations

from pathlib import Path

from hpcdl.data.images import FolderSource
from hpcdl.runtime.errors import UsageError


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
