"""Pack a dataset into WebDataset tar shards with an index (see docs/data.md for the format).

    python -m hpcdl.pack --dataset imagenet --data-dir DIR --output SHARDS [--shard-size-mb 256] [--force]
    python -m hpcdl.train --dataset imagenet --data-dir SHARDS ...   # reads them

Why: a parallel file system serves a few large files well and a million small ones badly (every
open is a metadata-server request). The shards are written to a temporary folder beside OUTPUT
and renamed into place at the end, so an interrupted run never leaves a half-written OUTPUT.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hpcdl.data.registry import PACKABLE
from hpcdl.runtime.console import RankZeroParser
from hpcdl.runtime.errors import UsageError, run_main
from hpcdl.runtime.numbers import integer, real
from hpcdl.tools.staging import refuse_own_input, staged_folder, sweep_stale, writable_parent


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = RankZeroParser(prog="python -m hpcdl.pack", description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True, choices=PACKABLE)
    parser.add_argument("--data-dir", required=True, help="the dataset in its usual layout")
    parser.add_argument("--output", required=True, help="folder to create with index.json and the shards")
    parser.add_argument("--shard-size-mb", type=real(0, low_open=True, high=2**20), default=256.0,
                        help="target size of one shard (default 256)")
    parser.add_argument("--seed", type=integer(0, 2**63 - 1), default=0, help="the order samples are packed in "
                        "(shuffled, so that streaming readers of the tars see mixed classes)")
    parser.add_argument("--threads", type=integer(1, 1024), default=8, help="threads reading input files (default 8)")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    return parser.parse_args(argv)


Sample = tuple[bytes, str, int]  # encoded image, file extension, label
Split = tuple[int, Callable[[int], Sample]]  # number of samples, reader of sample i


def dataset_samples(dataset: str, data_dir: Path) -> tuple[list[str], dict[str, Split]]:
    """The samples of each split as the registry reads them: encoded files keep their own bytes (no
    re-encoding); datasets held as tensors are encoded image by image as lossless PNGs."""
    from torchvision.io import encode_png

    from hpcdl.data.images import FolderSource
    from hpcdl.data.in_memory import ImageTensors
    from hpcdl.data.registry import FileSplits, read_layout

    data = read_layout(dataset, data_dir)
    if isinstance(data, FileSplits):
        def file_reader(source: FolderSource) -> Callable[[int], Sample]:
            def read(index: int) -> Sample:
                with open(source.paths[index], "rb") as handle:
                    data = handle.read()
                extension = ("jpg" if data[:3] == b"\xff\xd8\xff"
                             else Path(source.paths[index]).suffix.lstrip(".").lower())
                return data, extension, int(source.labels[index])
            return read

        assert isinstance(data.train, FolderSource) and isinstance(data.test, FolderSource)
        return data.classes, {"train": (len(data.train), file_reader(data.train)),
                              "val": (len(data.test), file_reader(data.test))}

    def tensor_reader(part: ImageTensors) -> Callable[[int], Sample]:
        def read(index: int) -> Sample:
            return bytes(encode_png(part.images[index]).numpy()), "png", int(part.labels[index])
        return read

    return [str(i) for i in range(data.num_classes)], {"train": (len(data.train), tensor_reader(data.train)),
                                                        "val": (len(data.test), tensor_reader(data.test))}


def in_order(read: Callable[[int], Sample], order: np.ndarray, threads: int, window: int = 512) -> Iterator[Sample]:
    """``read(i)`` for i in ``order``, overlapped on a few threads (file reads wait on I/O), in order,
    with at most ``window`` samples in memory."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for start in range(0, len(order), window):
            yield from pool.map(read, (int(i) for i in order[start:start + window]))


def pack(dataset: str, data_dir: Path, output: Path, shard_bytes: int, seed: int, force: bool,
         threads: int = 8) -> Path:
    from tqdm import tqdm

    from hpcdl.data.registry import check_data_dir
    from hpcdl.data.shards import ShardWriter, write_index

    refuse_own_input(output, {"--data-dir": data_dir})
    writable_parent(output)
    for line in sweep_stale(output):
        print(f"hpcdl.pack: {line}", file=sys.stderr)
    if output.exists() and not force:
        raise UsageError(f"--output {output} exists; pass --force to replace it")
    data_dir = check_data_dir(dataset, str(data_dir))
    refuse_own_input(output, {"--data-dir": data_dir})  # the folder the registry reads may lie below the one given
    classes, splits = dataset_samples(dataset, data_dir)
    with staged_folder(output, replace=True) as staging:
        entries = {}
        for number, (split, (count, read)) in enumerate(splits.items()):
            # packed in a seeded shuffled order, so that streaming readers of the tars see mixed classes;
            # the table keeps the folder's order (hpcdl/data/shards.py)
            order = np.random.default_rng([seed, number]).permutation(count)
            writer = ShardWriter(staging, split, shard_bytes)
            samples = in_order(read, order, threads)
            progress = tqdm(samples, total=count, desc=split, unit="img", disable=None)
            for index, (data, extension, label) in zip(order.tolist(), progress, strict=True):
                writer.add(index, extension, data, label)
            entries[split] = writer.finish()
        write_index(staging, dataset, classes, entries)
    return output


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    output = pack(args.dataset, Path(args.data_dir), Path(args.output), int(args.shard_size_mb * 2**20),
                  args.seed, args.force, args.threads)
    print(f"hpcdl.pack: wrote {output}", file=sys.stderr)
    return 0


def main_cli() -> None:
    """The command line: ``python -m hpcdl.pack``."""
    run_main(main, program="hpcdl.pack")
