"""Training throughput: hpcdl.train's overhead over a bare PyTorch loop, and 1 vs 2 rank scaling.

    .venv/bin/python benchmarks/train_throughput.py [--steps 12] [--rounds 8] [--batch-size 64]

Part 1 runs, in this one process and in pairs of alternating order (AB BA AB ...), the same
ResNet-32 on the same synthetic CIFAR-shaped batches through (A) ``hpcdl.train.train`` with one
rank and (B) a bare loop: forward, backward, SGD step, nothing else. The median over pairs of
A's step time divided by B's is the framework's overhead (Horovod's DistributedOptimizer, lr schedule, finite check, signal check,
watchdog, metrics). Part 2 launches ``mpirun -np 1`` and ``-np 2`` with one thread per rank and
reports images/s and the scaling efficiency (ips_2 / (2 * ips_1)). Results go to
benchmarks/results/train_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def hpcdl_step_seconds(steps: int, batch_size: int, output_dir: str) -> float:
    """Median training-loop time per step of hpcdl.train (evaluation excluded), from its metrics."""
    from hpcdl.config import parse_config
    from hpcdl.train import train

    # Two epochs of `steps` steps; the first is warm-up, the second is measured.
    config = parse_config([
        "--dataset", "synthetic", "--model", "resnet32", "--batch-size", str(batch_size),
        "--synthetic-size", str(steps * batch_size), "--epochs", "2", "--output-dir", output_dir,
        "--no-progress", "--keep-checkpoints", "1",
    ])
    train(config)
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["epoch_seconds"] / steps


def bare_step_seconds(steps: int, batch_size: int) -> float:
    """The same model, data and optimizer in a loop with nothing else in it."""
    import torch
    from torch import nn

    from hpcdl.data import SyntheticImages
    from hpcdl.models import build_model

    torch.manual_seed(0)
    model = build_model("resnet32", 10, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    loader = torch.utils.data.DataLoader(SyntheticImages(steps * batch_size, (3, 32, 32), 10, seed=0),
                                         batch_size=batch_size, shuffle=True, drop_last=True)
    criterion = nn.CrossEntropyLoss()
    timings = []
    for _epoch in range(2):
        model.train()
        start = time.perf_counter()
        for images, labels in loader:
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        timings.append((time.perf_counter() - start) / steps)
    return timings[-1]


def scaling(steps: int, batch_size: int) -> dict[str, float]:
    """images/s of hpcdl.train on 1 and 2 ranks, one thread each (same per-rank batch)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    result = {}
    for ranks in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            cmd = ["mpirun", "-np", str(ranks), "--bind-to", "none", sys.executable, "-m", "hpcdl.train",
                   "--dataset", "synthetic", "--model", "resnet32", "--batch-size", str(batch_size),
                   "--synthetic-size", str(steps * batch_size * ranks), "--epochs", "2", "--output-dir", out,
                   "--no-progress", "--keep-checkpoints", "1"]
            subprocess.run(cmd, check=True, env=env, cwd=REPO, timeout=1800, capture_output=True)
            rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
            result[f"images_per_second_{ranks}_rank"] = rows[-1]["images_per_second"]
    result["scaling_efficiency_2_ranks"] = result["images_per_second_2_rank"] / (2 * result["images_per_second_1_rank"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="measured steps per round")
    parser.add_argument("--rounds", type=int, default=8, help="pairs of hpcdl/bare measurements, in alternating order")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--skip-scaling", action="store_true")
    args = parser.parse_args()

    from tqdm import tqdm

    from hpcdl import world

    me = world.init()
    hpcdl_times, bare_times = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in tqdm(range(args.rounds), desc="overhead rounds"):
            # Pairs in alternating order (AB BA AB ...), so that neither side always runs second.
            pair = [lambda: hpcdl_times.append(hpcdl_step_seconds(args.steps, args.batch_size, f"{scratch}/r{round_}")),
                    lambda: bare_times.append(bare_step_seconds(args.steps, args.batch_size))]
            for measure in pair if round_ % 2 == 0 else reversed(pair):
                measure()
    # The machine's speed drifts between rounds by more than the overhead: the ratio within each
    # pair cancels the drift, and the median of those ratios is the figure.
    ratios = [h / b for h, b in zip(hpcdl_times, bare_times)]
    hpcdl_median, bare_median = statistics.median(hpcdl_times), statistics.median(bare_times)
    report = {
        "model": "resnet32", "batch_size": args.batch_size, "threads": me.threads, "steps": args.steps,
        "rounds": args.rounds, "hpcdl_step_seconds": hpcdl_times, "bare_step_seconds": bare_times,
        "malloc_tuning": os.environ.get("HPCDL_MALLOC_TUNING", "1") != "0",  # hpcdl/allocator.py, both loops
        "paired_ratios": ratios, "overhead_ratio": statistics.median(ratios),
        "ratio_of_medians": hpcdl_median / bare_median,
    }
    print(f"step time: hpcdl.train {hpcdl_median * 1e3:.1f} ms, bare loop {bare_median * 1e3:.1f} ms (medians); "
          f"paired ratios {min(ratios):.3f}-{max(ratios):.3f}, median {report['overhead_ratio']:.3f} "
          f"-> overhead {100 * (report['overhead_ratio'] - 1):+.1f}% ({me.threads} threads, batch {args.batch_size})")
    if not args.skip_scaling:
        report.update(scaling(args.steps, args.batch_size))
        print(f"1 rank {report['images_per_second_1_rank']:.0f} img/s, 2 ranks {report['images_per_second_2_rank']:.0f} "
              f"img/s -> scaling efficiency {100 * report['scaling_efficiency_2_ranks']:.0f}% (1 thread per rank)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "train_throughput.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
