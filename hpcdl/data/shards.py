"""Packed shards: a dataset as a few large WebDataset tar files plus an index, for parallel file systems.

Layout of a shard folder (format version 2, written by ``python -m hpcdl.pack``)::

    index.json               {"format": "hpcdl-shards", "version": 2, "dataset": "imagenet",
                              "classes": [...], "splits": {"train": {"samples": N, "table": "train.npy",
                              "shards": [{"file": "train-000000.tar", "samples": n, "bytes": b}, ...]}, "val": ...}}
    train-000000.tar ...     WebDataset layout: members <key>.jpg (or .png) and <key>.cls (the label
                             as decimal text), consecutive; the key is the sample's index in
                             the original folder (9 digits), the tars hold them shuffled
    train.npy                int64 (N, 4): shard number, byte offset of the image member's data,
                             its length, label -- row i is sample i of the original folder

Why random access by offset rather than streaming the tars: every epoch uses one global
permutation of the samples (:mod:`hpcdl.data.order`), exactly as the folder reader does, and the
table is in the folder's sample order, so a run on the shards sees the same batches as a run on the
folder, and repacking (with any ``--seed``) changes no run's data order.
Exactly-once across any number of ranks and exact mid-epoch resume need no extra state (no
shard assignment, no shuffle-buffer contents). The file-system cost Lustre cares about -- one metadata
request per file opened -- drops from one per image to one per shard per worker; the reads
themselves are ``pread`` calls of one image each. The tars remain ordinary WebDataset shards that
streaming tools (the ``webdataset`` library, ``tar tf``) read front to back.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hpcdl.data.images import read_into_tensor
from hpcdl.runtime.errors import UsageError

FORMAT, VERSION = "hpcdl-shards", 2
INDEX = "index.json"
SPLITS = ("train", "val")
TABLE_COLUMNS = 4  # shard, offset, length, label


def is_shard_folder(path: Path) -> bool:
    return (path / INDEX).is_file()


@dataclass
class ShardSplit:
    folder: Path
    files: list[str]
    table: np.ndarray  # int64 (N, 4)

    @property
    def labels(self) -> np.ndarray:
        return self.table[:, 3]


@dataclass
class ShardIndex:
    folder: Path
    dataset: str
    classes: list[str]
    splits: dict[str, ShardSplit]


def read_index(folder: Path) -> ShardIndex:
    """The index, checked against the shard files it names; any mismatch is one line naming the file."""
    path = folder / INDEX
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"shard index {path} is unreadable ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UsageError(f"shard index {path}: not an {FORMAT} index")
    if meta.get("version") != VERSION:
        raise UsageError(f"shard index {path}: format version {meta.get('version')}, this hpcdl reads {VERSION} "
                         "(repack with this version's python -m hpcdl.pack)")
    try:
        classes = [str(c) for c in meta["classes"]]
        splits = {name: read_split(folder, name, meta["splits"][name], len(classes)) for name in SPLITS}
        return ShardIndex(folder, str(meta["dataset"]), classes, splits)
    except (KeyError, TypeError) as exc:
        raise UsageError(f"shard index {path}: missing or malformed entry {exc}") from exc


def read_split(folder: Path, name: str, meta: dict, num_classes: int) -> ShardSplit:
    table_path = folder / meta["table"]
    try:
        table = np.load(table_path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise UsageError(f"shard table {table_path} is unreadable ({exc})") from exc
    if table.dtype != np.int64 or table.ndim != 2 or table.shape[1] != TABLE_COLUMNS:
        raise UsageError(f"shard table {table_path}: {table.dtype} {table.shape}, expected int64 (N, {TABLE_COLUMNS})")
    if len(table) != meta["samples"] or len(table) == 0:
        raise UsageError(f"shard table {table_path}: {len(table)} rows, index.json says {meta['samples']} samples")
    labels = table[:, 3]
    if labels.min() < 0 or labels.max() >= num_classes:
        raise UsageError(f"shard table {table_path}: labels range over {labels.min()}..{labels.max()}, "
                         f"expected 0..{num_classes - 1}")
    files = [entry["file"] for entry in meta["shards"]]
    if table[:, 0].min() < 0 or table[:, 0].max() >= len(files):
        raise UsageError(f"shard table {table_path}: shard numbers outside the {len(files)} shards of index.json")
    ends = np.zeros(len(files), dtype=np.int64)
    np.maximum.at(ends, table[:, 0], table[:, 1] + table[:, 2])
    counts = np.bincount(table[:, 0], minlength=len(files))
    for number, entry in enumerate(meta["shards"]):
        shard = folder / entry["file"]
        if not shard.is_file():
            raise UsageError(f"shard {shard} is missing")
        if shard.stat().st_size < ends[number]:
            raise UsageError(f"shard {shard} is truncated ({shard.stat().st_size} bytes, "
                             f"samples reach byte {ends[number]})")
        if counts[number] != entry["samples"]:
            raise UsageError(f"shard {shard}: index.json says {entry['samples']} samples, the table {counts[number]}")
    return ShardSplit(folder, files, table)


class ShardSource:
    """Random access to one split's images by ``pread`` at the offsets of the table."""

    def __init__(self, split: ShardSplit) -> None:
        self.split = split
        self.labels = split.labels
        self.paths = [str(split.folder / name) for name in split.files]
        self.handles: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict:  # file descriptors are per process: a worker opens its own
        return {**self.__dict__, "handles": {}}

    def read(self, index: int) -> torch.Tensor:
        shard, offset, length, _ = self.split.table[index].tolist()
        handle = self.handles.get(shard)
        if handle is None:
            handle = self.handles[shard] = os.open(self.paths[shard], os.O_RDONLY)
        return read_into_tensor(handle, length, offset, f"shard {self.paths[shard]} (sample {index})")

    def name(self, index: int) -> str:
        shard, offset = int(self.split.table[index, 0]), int(self.split.table[index, 1])
        return f"{self.paths[shard]} (sample {index} at byte {offset})"

    def close(self) -> None:
        for handle in self.handles.values():
            os.close(handle)
        self.handles.clear()


class ShardWriter:
    """Writes samples into numbered tar shards of about ``shard_bytes`` each, recording the table.

    Samples may arrive in any order (pack shuffles them for streaming readers); each carries its
    index in the original folder, and the table is written in that order.
    """

    def __init__(self, folder: Path, split: str, shard_bytes: int) -> None:
        self.folder, self.split, self.shard_bytes = folder, split, shard_bytes
        self.rows: dict[int, tuple[int, int, int, int]] = {}
        self.shards: list[dict] = []
        self.tar: tarfile.TarFile | None = None

    def _member(self, name: str, data: bytes) -> int:
        """Append one member; returns the offset of its data in the shard."""
        assert self.tar is not None
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o444, 0  # fixed metadata: packing is reproducible
        start = self.tar.offset + len(info.tobuf(self.tar.format, self.tar.encoding, self.tar.errors))
        self.tar.addfile(info, io.BytesIO(data))
        return start

    def add(self, index: int, extension: str, data: bytes, label: int) -> None:
        """Sample ``index`` of the original folder (0-based), written at the end of the current shard."""
        if index in self.rows:
            raise ValueError(f"sample {index} of {self.split} added twice")
        if self.tar is None or self.tar.offset >= self.shard_bytes:
            self._next_shard()
        offset = self._member(f"{index:09d}.{extension}", data)
        self._member(f"{index:09d}.cls", str(label).encode())
        self.rows[index] = (len(self.shards) - 1, offset, len(data), label)
        self.shards[-1]["samples"] += 1

    def _next_shard(self) -> None:
        self._close_shard()
        name = f"{self.split}-{len(self.shards):06d}.tar"
        self.tar = tarfile.open(self.folder / name, "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115 - spans many adds
        self.shards.append({"file": name, "samples": 0, "bytes": 0})

    def _close_shard(self) -> None:
        if self.tar is not None:
            self.tar.close()
            self.shards[-1]["bytes"] = (self.folder / self.shards[-1]["file"]).stat().st_size
            self.tar = None

    def finish(self) -> dict:
        """Close the last shard, write the table; returns this split's entry of index.json."""
        self._close_shard()
        if sorted(self.rows) != list(range(len(self.rows))):
            raise ValueError(f"{self.split}: sample indices are not 0..{len(self.rows) - 1}")
        table = f"{self.split}.npy"
        rows = [self.rows[i] for i in range(len(self.rows))]
        np.save(self.folder / table, np.asarray(rows, dtype=np.int64).reshape(-1, TABLE_COLUMNS))
        return {"samples": len(self.rows), "table": table, "shards": self.shards}


def write_index(folder: Path, dataset: str, classes: Iterable[str], splits: dict[str, dict]) -> None:
    meta = {"format": FORMAT, "version": VERSION, "dataset": dataset, "classes": list(classes), "splits": splits}
    (folder / INDEX).write_text(json.dumps(meta, indent=1) + "\n")
