"""Input pipeline throughput: folder vs shards, PIL vs libjpeg-turbo vs nvJPEG decode, against workers.

    .venv/bin/python benchmarks/loader_throughput.py                  # CPU: a couple of minutes on 2 cores
    .venv/bin/python benchmarks/loader_throughput.py --device cuda    # GPU: adds nvJPEG decode, ResNet-50 AMP
    .venv/bin/python benchmarks/loader_throughput.py --images 2000 --workers 2 4 8 --device cuda

It writes its own ImageNet-like data first (JPEG files of 500x375 pixels at quality 90, about
110 KB each, in class folders; then the same set packed with hpcdl.pack), so anyone can rerun it.
Contenders, every one producing normalised 224x224 training batches on the device:

* ``pil-folder``: the baseline (torchvision ImageFolder, PIL decode, transforms on PIL images,
  float32 batches from the workers; defined here and nowhere else);
* ``folder-cpu`` / ``shards-cpu``: hpcdl.data with libjpeg-turbo decode in the workers, uint8 batches;
* ``folder-gpu`` / ``shards-gpu`` (CUDA only): bytes from the workers, nvJPEG batch decode and crops on the GPU.

Part 1 times each pipeline alone (images/s), for each worker count. Part 2 times training fed by
each (a small CNN on CPU; ResNet-50 with bf16 autocast and channels_last on CUDA), next to the same
training on device-resident synthetic data. Measurements alternate between contenders round by
round (the order rotates), and ratios are taken within a round, so a machine shared with other
work biases no contender. Results: JSON and a plot under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from figures import figure, results, save_json, table, times  # noqa: E402

from hpcdl.runtime.console import RankZeroParser  # noqa: E402
from hpcdl.runtime.errors import run_main  # noqa: E402
from hpcdl.runtime.numbers import integer  # noqa: E402

SUFFIXES = (".json", ".png")  # the files it writes, each <stem><suffix> (hpcdl.persistence.outputs.output_file)


def write_jpegs(root: Path, images: int, classes: int, seed: int = 0) -> Path:
    """ImageNet-like class folders (train and a small val): smooth colour fields plus luminance noise,
    which JPEG at quality 90 compresses to about 110 KB, like ImageNet's average file."""
    from PIL import Image
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    for split, count in (("train", images), ("val", max(classes, images // 8))):
        for i in tqdm(range(count), desc=f"writing {split} JPEGs", disable=None):
            folder = root / split / f"n{i % classes:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            coarse, medium = (Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
                              .resize((500, 375), Image.BICUBIC) for shape in ((12, 16, 3), (48, 64, 3)))
            pixels = (0.6 * np.asarray(coarse, np.float32) + 0.4 * np.asarray(medium, np.float32)
                      + rng.normal(0, 20, (375, 500, 1)))
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"img_{i:06d}.JPEG", quality=90)
    return root


Batches = Callable[[int], Iterator]  # epoch -> iterator of (images, labels) on the device


def pil_baseline(folder: Path, workers: int, batch: int, device):  # type: ignore[no-untyped-def]
    """The thing hpcdl.data is compared with: torchvision ImageFolder, PIL decode, the classic transforms
    on PIL images, float32 batches built per sample in the workers. It lives only here."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    from hpcdl.data.registry import REGISTRY

    norm = REGISTRY["imagenet"].norm
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), transforms.Normalize(norm.mean, norm.std)])
    dataset = ImageFolder(str(folder / "train"), transform=train_tf)
    sampler = RandomSampler(dataset, generator=torch.Generator())
    options: dict = dict(num_workers=workers, persistent_workers=workers > 0, pin_memory=device.type == "cuda")
    if workers > 0:
        options["prefetch_factor"] = 4
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True, **options)

    def epoch_batches(epoch: int) -> Iterator:
        sampler.generator.manual_seed(epoch)  # type: ignore[union-attr]
        for images, labels in loader:
            yield images.to(device, non_blocking=True), labels.to(device, non_blocking=True)

    return epoch_batches


def contenders(names: list[str], folder: Path, shards: Path, workers: int, batch: int, device) -> dict:  # type: ignore[no-untyped-def]
    """name -> (epoch -> batch iterator, closer)."""
    from hpcdl.data import DataSpec, build_pipeline

    built: dict = {}
    for name in names:
        if name == "pil-folder":
            built[name] = (pil_baseline(folder, workers, batch, device), lambda: None)
        else:
            source, decode = name.split("-")
            spec = DataSpec("imagenet", str(folder if source == "folder" else shards), batch, batch, workers, 0,
                            decode=decode, channels_last=device.type == "cuda")
            pipeline = build_pipeline(spec, 0, 1, device)
            built[name] = (pipeline.train_epoch, pipeline.close)
    return built


def sync(device) -> None:  # type: ignore[no-untyped-def]
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def time_batches(epoch_batches: Batches, epoch: int, count: int, device, step=None) -> float:  # type: ignore[no-untyped-def]
    """images/s over ``count`` batches after the first (which pays for workers starting and prefetching)."""
    iterator = epoch_batches(epoch)
    images, labels = next(iterator)
    if step is not None:
        step(images, labels)
    sync(device)
    start, seen = time.perf_counter(), 0
    for _ in range(count):
        images, labels = next(iterator)
        if step is not None:
            step(images, labels)
        seen += len(labels)
    sync(device)
    elapsed = time.perf_counter() - start
    with contextlib.suppress(Exception):
        iterator.close()  # type: ignore[attr-defined]
    return seen / elapsed


def training_step(device):  # type: ignore[no-untyped-def]
    """A forward/backward/SGD step: ResNet-50 (bf16 autocast, channels_last) on CUDA; a small CNN on CPU,
    light enough that the loader's own cost stays visible on 2 cores."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if device.type == "cuda":
        import torchvision

        model = torchvision.models.resnet50(num_classes=1000).to(device, memory_format=torch.channels_last)
        autocast: contextlib.AbstractContextManager = torch.autocast("cuda", dtype=torch.bfloat16)
        torch.backends.cudnn.benchmark = True
    else:
        model = nn.Sequential(nn.Conv2d(3, 16, 7, stride=4, padding=3), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2),
                              nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1000))
        autocast = contextlib.nullcontext()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()

    def step(images, labels) -> None:  # type: ignore[no-untyped-def]
        with autocast:
            loss = criterion(model(images).float(), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def measure(names: list[str], folder: Path, shards: Path, workers: int, args: argparse.Namespace, device,  # type: ignore[no-untyped-def]
            step=None, extra: dict | None = None) -> dict[str, list[float]]:
    built = {**contenders(names, folder, shards, workers, args.batch_size, device), **(extra or {})}
    order = list(built)
    rates: dict[str, list[float]] = {name: [] for name in order}
    try:
        for round_ in range(args.rounds):
            rotated = order[round_ % len(order):] + order[:round_ % len(order)]
            for name in rotated:
                rates[name].append(time_batches(built[name][0], round_, args.batches, device, step))
    finally:
        for _, close in built.values():
            close()
    return rates


def paired_ratio(rates: dict[str, list[float]], numerator: str, denominator: str) -> float | None:
    if numerator not in rates or denominator not in rates:
        return None
    return statistics.median(a / b for a, b in zip(rates[numerator], rates[denominator], strict=True))


def reader_rates(folder: Path, shards: Path, rounds: int, block: int = 16) -> dict[str, list[float]]:
    """images/s of reading the encoded bytes alone (no decode), the part of the pipeline the file system
    sees. Blocks of ``block`` samples alternate between folder and shards (the order flips every block),
    so both see the same machine; per round of one epoch's order, the median block's rate."""
    from hpcdl.data.order import epoch_permutation
    from hpcdl.data.registry import FileSplits, read_dataset

    sources = {}
    for name, path in (("folder", folder), ("shards", shards)):
        data = read_dataset("imagenet", str(path))
        assert isinstance(data, FileSplits)
        sources[name] = data.train
    rates: dict[str, list[float]] = {name: [] for name in sources}
    for round_ in range(rounds):
        block_rates: dict[str, list[float]] = {name: [] for name in sources}
        order = epoch_permutation(len(sources["shards"]), 0, round_).tolist()
        for number, first in enumerate(range(0, len(order) - block + 1, block)):
            names = list(sources) if number % 2 == 0 else list(sources)[::-1]
            for name in names:
                start = time.perf_counter()
                for sample in order[first:first + block]:
                    sources[name].read(sample)
                block_rates[name].append(block / (time.perf_counter() - start))
        for name in sources:  # the median block: a block that lost the CPU to another process does not count
            rates[name].append(statistics.median(block_rates[name]))
    return rates


def synthetic_contender(args: argparse.Namespace, device) -> dict:  # type: ignore[no-untyped-def]
    from hpcdl.data import DataSpec, build_pipeline

    spec = DataSpec("synthetic", None, args.batch_size, args.batch_size, 0, 0, channels_last=device.type == "cuda",
                    synthetic_shape=(3, 224, 224), synthetic_classes=1000,
                    synthetic_size=args.batch_size * (args.batches + 2))
    pipeline = build_pipeline(spec, 0, 1, device)
    return {"synthetic-device": (pipeline.train_epoch, pipeline.close)}


def plot(report: dict, stem: Path) -> None:
    with figure(stem, 1, 2, figsize=(12, 4.3), dpi=110) as (fig, (alone, fed)):
        workers = [int(w) for w in report["pipeline_alone"]]
        names = list(next(iter(report["pipeline_alone"].values())))
        for name in names:
            alone.plot(workers, [statistics.median(report["pipeline_alone"][str(w)][name]) for w in workers], "o-",
                       label=name)
        alone.set(xlabel="loader workers", ylabel="images/s", title="input pipeline alone (224x224 training batches)")
        alone.set_xticks(workers)
        alone.grid(alpha=0.3)
        alone.legend(fontsize=8)
        if report.get("training"):
            rates = report["training"]["images_per_second"]
            labels = list(rates)
            fed.bar(range(len(labels)), [statistics.median(rates[n]) for n in labels])
            fed.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
            fed.set(ylabel="images/s", title=f"training fed by it ({report['training']['model']}, "
                                             f"{report['training']['workers']} workers)")
            fed.grid(alpha=0.3, axis="y")
        shared = "; machine shared with other work" if report["device"] == "cpu" else ""
        fig.suptitle(f"{report['device_name']}; {report['images']} JPEGs of ~{report['mean_jpeg_kb']:.0f} KB"
                     f"{shared}", fontsize=9)


def main(argv: list[str] | None = None) -> None:
    parser = RankZeroParser(prog="benchmarks/loader_throughput.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--images", type=integer(1), default=288, help="training JPEGs to write (default 288)")
    parser.add_argument("--classes", type=integer(1), default=8)
    parser.add_argument("--workers", type=integer(0, 256), nargs="+",
                        help="worker counts (default 0 1 2 on CPU, 2 4 8 on CUDA)")
    parser.add_argument("--batch-size", type=integer(1), help="default 32 on CPU, 128 on CUDA")
    parser.add_argument("--batches", type=integer(1), default=6,
                        help="timed batches per measurement (after one warm-up)")
    parser.add_argument("--rounds", type=integer(1), default=3, help="alternating rounds per contender")
    parser.add_argument("--data", type=Path, help="reuse (or create) the generated data here instead of a temp dir")
    parser.add_argument("--contenders", nargs="+", help="a subset of pil-folder folder-cpu shards-cpu folder-gpu "
                        "shards-gpu (default: all that the device allows)")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--output", type=Path, help="results stem: writes STEM.json and STEM.png (default: a new "
                        "folder under runs/bench/; --refresh-results replaces the committed figures)")
    from hpcdl.persistence import outputs

    outputs.add_arguments(parser)
    args = parser.parse_args(argv)
    stem = outputs.results_stem(
        outputs.given_stem(args.output, SUFFIXES), f"loader_throughput_{args.device}", SUFFIXES,
        refresh_results=args.refresh_results, force=args.force)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("loader_throughput.py: error: --device cuda but torch sees no GPU")
    device = torch.device(args.device)
    args.workers = args.workers or ([0, 1, 2] if args.device == "cpu" else [2, 4, 8])
    args.batch_size = args.batch_size or (32 if args.device == "cpu" else 128)
    if args.images < args.batch_size * (args.batches + 1):
        sys.exit(f"loader_throughput.py: error: --images {args.images} is fewer than one epoch of "
                 f"{args.batches + 1} batches of {args.batch_size}")
    names = ["pil-folder", "folder-cpu", "shards-cpu"] + (["folder-gpu", "shards-gpu"] if args.device == "cuda" else [])
    if args.contenders:
        unknown = sorted(set(args.contenders) - set(names))
        if unknown:
            sys.exit(f"loader_throughput.py: error: --contenders {' '.join(unknown)}: not among {' '.join(names)}")
        names = args.contenders
    from hpcdl.data.pipeline import PREFETCH_FACTOR

    queue = max(args.workers) * PREFETCH_FACTOR  # batches the CPU decoders hold ready before the timing starts
    if args.device == "cuda" and any(n.endswith("-cpu") for n in names) and args.batches < 4 * queue:
        # a fast host fills the queue during the warm-up batch: fewer timed batches would time the queue
        sys.exit(f"loader_throughput.py: error: --batches {args.batches} must be at least 4 x the {queue} batches "
                 f"{max(args.workers)} workers read ahead ({4 * queue}), or the timing measures the queue")

    from hpcdl.tools.pack import pack

    with tempfile.TemporaryDirectory() as scratch:
        root = args.data or Path(scratch)
        folder, shards = root / "folder", root / "shards"
        if not (folder / "train").is_dir():
            write_jpegs(folder, args.images, args.classes)
        if not (shards / "index.json").is_file():
            pack("imagenet", folder, shards, shard_bytes=64 * 2**20, seed=0, force=False)
        sizes = [p.stat().st_size for p in (folder / "train").rglob("*.JPEG")]
        device_name = (torch.cuda.get_device_name() if args.device == "cuda"
                       else f"CPU, {torch.get_num_threads()} threads")
        report: dict = {"device": args.device, "device_name": device_name, "images": len(sizes),
                        "mean_jpeg_kb": sum(sizes) / len(sizes) / 1000, "batch_size": args.batch_size,
                        "timed_batches": args.batches, "prefetch_factor": PREFETCH_FACTOR, "rounds": args.rounds,
                        "pipeline_alone": {}, "ratios": {}}
        reads = reader_rates(folder, shards, max(args.rounds, 5))
        report["reader_alone"] = {"images_per_second": reads,
                                  "shards/folder": paired_ratio(reads, "shards", "folder")}
        print(f"bytes read alone: images/s folder {statistics.median(reads['folder']):8.0f} | shards "
              f"{statistics.median(reads['shards']):8.0f} | shards/folder "
              f"{report['reader_alone']['shards/folder']:.2f}", flush=True)
        for workers in args.workers:
            rates = measure(names, folder, shards, workers, args, device)
            report["pipeline_alone"][str(workers)] = rates
            report["ratios"][str(workers)] = {
                "folder-cpu/pil-folder": paired_ratio(rates, "folder-cpu", "pil-folder"),
                "shards-cpu/folder-cpu": paired_ratio(rates, "shards-cpu", "folder-cpu"),
                "folder-gpu/folder-cpu": paired_ratio(rates, "folder-gpu", "folder-cpu"),
                "shards-gpu/folder-gpu": paired_ratio(rates, "shards-gpu", "folder-gpu"),
            }
            summary = " | ".join(f"{n} {statistics.median(r):7.1f}" for n, r in rates.items())
            print(f"workers {workers}: images/s {summary}", flush=True)
            save_json(stem, report)  # a run cut short keeps these
        if not args.skip_training:
            workers = max(args.workers)
            step = training_step(device)
            rates = measure(names, folder, shards, workers, args, device, step=step,
                            extra=synthetic_contender(args, device))
            report["training"] = {"model": "resnet50 bf16 channels_last" if args.device == "cuda" else "small CNN",
                                  "workers": workers, "images_per_second": rates,
                                  "fraction_of_synthetic": {n: paired_ratio(rates, n, "synthetic-device")
                                                            for n in rates if n != "synthetic-device"}}
            summary = " | ".join(f"{n} {statistics.median(r):7.1f}" for n, r in rates.items())
            print(f"training, {workers} workers: images/s {summary}", flush=True)
    plot(report, stem)
    print(f"wrote {save_json(stem, report)} and {outputs.output_file(stem, '.png')}")


# ---- the figures the documents quote (benchmarks/figures.py) -------------------------------------------

PIPELINES = {"pil-folder": "old path: PIL decode + transforms, float32 batches",
             "folder-cpu": "libjpeg-turbo (torchvision.io) decode, uint8 batches, folder",
             "shards-cpu": "same, from shards"}


def _table() -> str:
    r = results("loader_throughput_cpu")
    workers = list(r["pipeline_alone"])
    rows = [(label, *(f"{statistics.median(r['pipeline_alone'][w][key]):.1f}" for w in workers))
            for key, label in PIPELINES.items()]
    rows.append(("**new CPU path / old path** (target ≥ 1)",
                 *(f"**{times(r['ratios'][w]['folder-cpu/pil-folder'])}**" for w in workers)))
    return table(["images/s, pipeline alone", *(f"{w} worker{'s' if w != '1' else ''}" for w in workers)], rows)


def _ratios(which: str) -> str:
    ratios = results("loader_throughput_cpu")["ratios"]
    return " / ".join(times(ratios[w][which]) for w in ratios)


FIGURES = {"loader.table": _table, "loader.ratios": lambda: _ratios("folder-cpu/pil-folder"),
           "loader.shards": lambda: _ratios("shards-cpu/folder-cpu")}


if __name__ == "__main__":
    run_main(main, program="loader_throughput.py")
