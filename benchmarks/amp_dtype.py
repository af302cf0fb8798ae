"""Which half precision ``--amp auto`` should take on a GPU: bf16 autocast against fp16 autocast with a GradScaler.

    .venv/bin/python benchmarks/amp_dtype.py --device cuda                 # ResNet-50 and a transformer, ~40 s
    .venv/bin/python benchmarks/amp_dtype.py --device cuda --models resnet50 --steps 30 --rounds 3
    .venv/bin/python benchmarks/amp_dtype.py --size small                  # CPU, tiny models: checks the script

``--amp auto`` takes bf16 wherever the device has it, since bf16 needs no loss scaling: no skipped steps,
no scale to tune, the same step as fp32 in every other way. On one H200 a bare loop (ResNet-50, channels_last)
ran fp16 with the scaler at 4,909 img/s against bf16's 4,292 (1.14x): fp16 may be worth a scaler. This measures
both, for ResNet-50 (batch 128, 224x224) and a transformer (the character GPT of examples/transformer_lm.py,
widened), in one process, rounds alternating in order (AB BA ...) so that neither dtype always runs second:

* speed: the median step time over ``--steps`` steps after a warm-up outside the timing (cuDNN's autotuning,
  the scaler's first steps), as items per second and fp16/bf16;
* loss: each dtype trains the same initial weights on the same fixed batches for ``--steps`` steps; the
  mean loss of the last quarter, beside fp32's, and the steps the scaler skipped (fp16 overflows).

The figures decide ``--amp auto``: fp16 is worth taking only where it is faster by a margin that its skipped
steps and loss do not take back (README's GPU rows quote them). Results: JSON under runs/bench/ (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from figures import save_json  # noqa: E402

from hpcdl.runtime.console import RankZeroParser  # noqa: E402
from hpcdl.runtime.errors import UsageError, run_main  # noqa: E402
from hpcdl.runtime.numbers import integer  # noqa: E402

SUFFIXES = (".json",)
DTYPES = ("bf16", "fp16", "fp32")  # fp32: the loss reference (timed too: the speed of no autocast)
# (batch, image size) or (batch, sequence length, width, layers) per model and size
SHAPES: dict[str, dict[str, dict[str, int]]] = {
    "resnet50": {"full": dict(batch=128, size=224), "small": dict(batch=4, size=32)},
    "transformer": {"full": dict(batch=32, length=512, width=768, heads=12, layers=6, vocabulary=256),
                    "small": dict(batch=4, length=32, width=32, heads=2, layers=1, vocabulary=64)},
}


def build(model: str, shape: dict[str, int], device: Any) -> tuple[Any, list[tuple[Any, Any]], Callable, int]:
    """(model, fixed batches, loss function, items per batch): the same weights and data for every dtype."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if model == "resnet50":
        import torchvision

        net = torchvision.models.resnet50(num_classes=10).to(device).to(memory_format=torch.channels_last)
        batches = [(torch.randn(shape["batch"], 3, shape["size"], shape["size"], device=device)
                    .to(memory_format=torch.channels_last), torch.randint(0, 10, (shape["batch"],), device=device))
                   for _ in range(4)]
        return net, batches, nn.CrossEntropyLoss(), shape["batch"]
    sys.path.insert(0, str(REPO / "examples"))
    from transformer_lm import TinyGPT, next_token_loss

    net = TinyGPT(shape["vocabulary"], shape["length"], shape["width"], shape["heads"], shape["layers"]).to(device)
    tokens = [torch.randint(0, shape["vocabulary"], (shape["batch"], shape["length"] + 1), device=device)
              for _ in range(4)]
    return net, [(t[:, :-1], t[:, 1:]) for t in tokens], next_token_loss, shape["batch"] * shape["length"]


def train(model: str, dtype: str, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """One dtype: warm-up, then ``args.steps`` timed steps from the same initial weights on the same batches."""
    import torch

    net, batches, loss_fn, items = build(model, SHAPES[model][args.size], device)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    autocast = (lambda: torch.autocast(device.type, dtype=half)) if half else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None
    start_state = {k: v.clone() for k, v in net.state_dict().items()}

    def step(inputs: Any, targets: Any) -> Any:
        with autocast():
            loss = loss_fn(net(inputs).float(), targets)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        return loss.detach()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for i in range(args.warmup):  # cuDNN's autotuning and the scaler's first steps, outside the timing
        step(*batches[i % len(batches)])
    sync()
    net.load_state_dict(start_state)  # the loss curve starts from the same weights for every dtype
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    # The scaler halves its scale at each step it skips and grows it only every 2,000 steps: the skips are
    # counted from the scale before and after, with no read (a GPU sync) inside the timed loop.
    scales = [scaler.get_scale() if scaler is not None else 1.0]
    losses = []
    sync()
    began = time.perf_counter()
    for i in range(args.steps):
        losses.append(step(*batches[i % len(batches)]))
    sync()
    seconds = (time.perf_counter() - began) / args.steps
    scales.append(scaler.get_scale() if scaler is not None else 1.0)
    skipped = round(math.log2(scales[0] / scales[1])) if args.steps < 2000 else None
    values = [float(v) for v in losses]
    tail = values[-max(1, len(values) // 4):]
    return {"step_seconds": seconds, "items_per_second": items / seconds, "losses": values,
            "final_loss": statistics.fmean(tail), "skipped_steps": skipped}


def measure(args: argparse.Namespace) -> None:
    import torch

    from hpcdl.persistence import outputs

    stem = outputs.results_stem(outputs.given_stem(args.out, SUFFIXES), f"amp_dtype_{args.device}", SUFFIXES,
                                refresh_results=args.refresh_results, force=args.force)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no GPU")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # fp32 as hpcdl.train runs it
    report: dict[str, Any] = {"device": args.device, "device_name": torch.cuda.get_device_name() if device.type ==
                              "cuda" else "CPU", "size": args.size, "steps": args.steps, "warmup": args.warmup,
                              "rounds": args.rounds, "lr": args.lr, "models": {}}
    for model in args.models:
        runs: dict[str, list[dict[str, Any]]] = {dtype: [] for dtype in DTYPES}
        report["models"][model] = {"shape": SHAPES[model][args.size], "runs": runs}
        for round_ in range(args.rounds):
            for dtype in DTYPES if round_ % 2 == 0 else tuple(reversed(DTYPES)):
                runs[dtype].append(train(model, dtype, args, device))
                save_json(stem, report)  # a run cut short keeps these
        ratios = [f["items_per_second"] / b["items_per_second"] for f, b in zip(runs["fp16"], runs["bf16"],
                                                                                 strict=True)]
        summary = {dtype: {"items_per_second": statistics.median(r["items_per_second"] for r in runs[dtype]),
                           "final_loss": statistics.median(r["final_loss"] for r in runs[dtype]),
                           "skipped_steps": max(r["skipped_steps"] or 0 for r in runs[dtype])} for dtype in DTYPES}
        report["models"][model].update(summary=summary, fp16_over_bf16=statistics.median(ratios))
        print(f"{model:12s} " + " | ".join(f"{d} {s['items_per_second']:9.1f}/s loss {s['final_loss']:.4f}"
                                           f"{' skipped ' + str(s['skipped_steps']) if d == 'fp16' else ''}"
                                           for d, s in summary.items())
              + f" | fp16/bf16 speed {statistics.median(ratios):.3f}", flush=True)
        save_json(stem, report)
    print(f"wrote {outputs.output_file(stem, '.json')}")


def main(argv: list[str] | None = None) -> None:
    parser = RankZeroParser(prog="benchmarks/amp_dtype.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    parser.add_argument("--size", choices=("full", "small"), default=None,
                        help="model and batch sizes (default: full on CUDA, small on CPU)")
    parser.add_argument("--steps", type=integer(2), default=20, help="timed (and loss) steps per run")
    parser.add_argument("--warmup", type=integer(1), default=5, help="untimed steps before them")
    parser.add_argument("--rounds", type=integer(1), default=2, help="runs per dtype, in alternating order")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--out", type=Path, help="results stem: writes STEM.json (default: a new folder under "
                        "runs/bench/; --refresh-results replaces the committed figures)")
    from hpcdl.persistence import outputs

    outputs.add_arguments(parser)
    args = parser.parse_args(argv)
    args.size = args.size or ("full" if args.device == "cuda" else "small")
    measure(args)


if __name__ == "__main__":
    run_main(main, program="amp_dtype.py")
