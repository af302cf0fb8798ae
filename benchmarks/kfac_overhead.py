"""Per-iteration time and peak memory of K-FAC against plain SGD, side by side in one run.

    .venv/bin/python benchmarks/kfac_overhead.py                        # CPU: resnet32, batch 64 (README)
    .venv/bin/python benchmarks/kfac_overhead.py --device cuda          # GPU: ResNet-50, batch 64, TF32 and AMP
    .venv/bin/python benchmarks/kfac_overhead.py --rounds 1 --quick     # a smoke run

CPU: CIFAR-shaped random batches (64 x 3 x 32 x 32), resnet32, 2 threads. CUDA: ImageNet-shaped
random batches (64 x 3 x 224 x 224) on the GPU, torchvision's ResNet-50, once in float32 with TF32
on (the script's matmuls; K-FAC keeps its own in IEEE float32) and once with AMP (float16
autocast and a GradScaler, K-FAC told about skipped steps through ``found_inf``).

For each (factor, inverse) update frequency the script alternates SGD steps and K-FAC steps one
by one (two copies of the model with the same initialisation) for rounds of one inverse-update
period each, so that every round holds K-FAC's share of factor updates and exactly one
decomposition, and noise from other processes hits both alike. On a GPU every step ends with
``torch.cuda.synchronize()``. It reports the median over rounds of K-FAC's mean step time over
SGD's (min and max in the JSON). ``--baseline DIR`` adds a contender, alternating with the
others: the ``kfac`` package found in DIR (e.g. an older checkout), to compare versions on a
shared machine; ``--kfac-pytorch PATH`` adds kfac-pytorch from a local copy (a checkout or an
install site; benchmarks/kfac_pytorch_adapter.py), at its own default damping and KL clip.

Where K-FAC's extra time goes: the preconditioner's phases (kfac.preconditioner.PHASES; statistics
includes the hooks' work inside forward and backward) per step, and "hooks and the rest", K-FAC's
extra time less its phases. On the CPU they come from the typical round itself. On a GPU a phase's
host seconds are only the time to queue it, so one more period is run with the preconditioner's
``device_timings`` (each phase's span on the device, between CUDA events recorded as it starts and
ends, nothing waited for inside the step: kfac.timing): its phases and its remainder are reported,
the step ratios still come from the rounds before it. (Waiting for the device around each phase
instead, ``synchronise_timings``, stalls the host's launches of forward's and backward's kernels
around every hook: the step it times is slower than a real one by time no phase holds.)

Peak memory: each variant (SGD, and K-FAC at each frequency) runs in a fresh process for one
inverse-update period (at most 12 steps, step 0 has every phase): ``torch.cuda.max_memory_allocated``
on a GPU, the growth of the peak resident set over the model and batch on the CPU.

Targets from the issues: CPU at most 3.5x SGD at (1, 10) and 1.33x at (10, 10) (kfac-pytorch
6.0x and 1.65x); H100 ResNet-50 batch 64 at most 3.0x at (1, 10) and 1.15x at (10, 100), peak
memory at most kfac-pytorch's 6.9 / 8.4 GiB (it measured 6.86x and 2.07x).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import kfac_pytorch_adapter  # noqa: E402
from figures import figure, results, save_json, table, times  # noqa: E402

from hpcdl.persistence import outputs  # noqa: E402
from hpcdl.runtime.console import RankZeroParser  # noqa: E402
from hpcdl.runtime.errors import run_main  # noqa: E402
from hpcdl.runtime.numbers import integer  # noqa: E402
from hpcdl.training.backend import Backend  # noqa: E402
from hpcdl.training.config import parse_config  # noqa: E402
from hpcdl.training.loop import apply_gradients  # noqa: E402
from hpcdl.training.optimizers import build_update_rule  # noqa: E402
from hpcdl.training.phases import StepPhases  # noqa: E402
from hpcdl.training.runstate import TrainState  # noqa: E402
from kfac.preconditioner import PHASES  # noqa: E402

TARGETS = {
    "cpu": {(1, 10): 3.5, (10, 10): 1.33},
    "cuda": {(1, 10): 2.0, (10, 100): 1.15},  # issue 44's targets on one H100 or H200
}
REFERENCE_KFAC_PYTORCH = {
    "cpu": {(1, 10): 6.0, (10, 10): 1.65},
    "cuda": {(1, 10): 6.86, (10, 100): 2.07},
}
REFERENCE_KFAC_PYTORCH_GIB = {"cuda": {(1, 10): 6.9, (10, 100): 8.4}}
DEFAULT_CONFIGS = {"cpu": "1,10 10,10 10,100", "cuda": "1,10 10,10 10,100"}
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def frequency_pairs(text: str) -> list[tuple[int, int]]:
    """``'1,10 10,100'`` as [(1, 10), (10, 100)]: (factor, inverse) update frequencies, for --configs and
    --memory-configs; a malformed pair is argparse's one-line error, not a ValueError hours in."""
    pairs = []
    for pair in text.split():
        values = pair.split(",")
        if len(values) != 2 or not all(v.isdigit() and int(v) >= 1 for v in values):
            raise argparse.ArgumentTypeError(f"{pair!r} is not a (factor,inverse) pair of whole numbers of at "
                                             "least 1, e.g. '1,10'")
        pairs.append((int(values[0]), int(values[1])))
    if not pairs:
        raise argparse.ArgumentTypeError("no (factor,inverse) pair, e.g. '1,10 10,100'")
    return pairs


# ------------------------------------------------------------------ one contender's step
class Stepper:
    """One model with hpcdl.train's SGD and optionally a K-FAC preconditioner; ``step()`` trains one batch: the
    forward pass, then the training loop's own gradient step (``hpcdl.training.loop.apply_gradients``: the
    loss scaler, the preconditioner told of a non-finite step, the fused update that skips it)."""

    def __init__(self, args: argparse.Namespace, batch, kfac_module: Any = None, freqs: tuple[int, int] | None = None):
        torch.manual_seed(0)
        self.model = build_model(args).to(args.device)
        if args.device == "cuda":
            self.model = self.model.to(memory_format=torch.channels_last)
        config = parse_config(["--momentum", "0.9", "--weight-decay", "5e-4"])
        self.batch = batch
        self.amp = args.precision == "amp"
        self.amp_dtype = AMP_DTYPES[getattr(args, "amp_dtype", "bf16")]
        # as hpcdl.train's --amp: float16 with the GradScaler, bfloat16 without one
        scaler = torch.amp.GradScaler("cuda") if self.amp and self.amp_dtype == torch.float16 else None
        self.pre = None
        told = None
        if kfac_module is not None and freqs is not None and kfac_module.__name__ == kfac_pytorch_adapter.RENAMED:
            self.pre = kfac_pytorch_adapter.build(kfac_module, self.model, factor_update_steps=freqs[0],
                                                  inv_update_steps=freqs[1], damping=0.001, factor_decay=0.95,
                                                  kl_clip=0.001, lr=0.1, grad_scaler=scaler)
        elif kfac_module is not None and freqs is not None:
            chosen = getattr(args, "kfac_method", "eigen")
            method = {} if chosen == "eigen" else {"method": chosen}  # an older --baseline has no method argument
            accepts = inspect.signature(kfac_module.KFACPreconditioner).parameters
            if getattr(args, "kfac_tf32", False) and "tf32" in accepts:
                method["tf32"] = True
            if getattr(args, "kfac_statistics_precision", "same") == "bf16" and "statistics_dtype" in accepts:
                method["statistics_dtype"] = torch.bfloat16
            if getattr(args, "kfac_factor_examples", None) is not None and "factor_examples" in accepts:
                method["factor_examples"] = args.kfac_factor_examples
            self.pre = kfac_module.KFACPreconditioner(
                self.model, factor_update_freq=freqs[0], inv_update_freq=freqs[1], lr=0.1, grad_scaler=scaler, **method
            )
            told = self.pre
            if "found_inf" not in inspect.signature(self.pre.step).parameters:  # an older --baseline
                told = SimpleNamespace(step=lambda found_inf=None: self.pre.step())
        state = TrainState(self.model, build_update_rule(config, self.model, 0.1), scaler, told)
        self.trainer = SimpleNamespace(state=state, settings=SimpleNamespace(use_adasum=False), phases=StepPhases(),
                                       backend=Backend(1))

    def step(self) -> None:
        x, y = self.batch
        with torch.autocast(x.device.type, dtype=self.amp_dtype, enabled=self.amp):
            loss = F.cross_entropy(self.model(x), y)
        scaler = self.trainer.state.scaler
        (loss if scaler is None else scaler.scale(loss)).backward()
        apply_gradients(self.trainer)


def build_model(args: argparse.Namespace) -> nn.Module:
    if args.device == "cuda":
        import torchvision

        return torchvision.models.resnet50()
    from hpcdl.training.models import build_model as hpcdl_model

    return hpcdl_model("resnet32", num_classes=10, in_channels=3)


def make_batch(args: argparse.Namespace):
    g = torch.Generator().manual_seed(0)
    if args.device == "cuda":
        x = torch.randn(args.batch_size, 3, 224, 224, generator=g).to("cuda", memory_format=torch.channels_last)
        return x, torch.randint(0, 1000, (args.batch_size,), generator=g).cuda()
    return torch.randn(args.batch_size, 3, 32, 32, generator=g), torch.randint(0, 10, (args.batch_size,), generator=g)


def import_kfac(directory: Path | None) -> Any:
    """The kfac package of this checkout, or the one in ``directory`` (imported under another name)."""
    if directory is None:
        return importlib.import_module("kfac")
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"kfac_baseline_{os.getpid()}"
    return kfac_pytorch_adapter.renamed_copy(directory / "kfac", "kfac_baseline", scratch)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ timing
def run(args: argparse.Namespace) -> list[dict]:
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    set_tf32(args)
    kfac = import_kfac(None)
    baseline = import_kfac(args.baseline) if args.baseline else None
    kfac_pytorch = kfac_pytorch_adapter.load_beside(args.kfac_pytorch) if args.kfac_pytorch else None
    batch = make_batch(args)
    sgd = Stepper(args, batch)
    for _ in range(3):
        sgd.step()
    results = []
    for factor_freq, inv_freq in args.configs:
        contenders = {"kfac": Stepper(args, batch, kfac, (factor_freq, inv_freq))}
        if baseline is not None:
            contenders["baseline"] = Stepper(args, batch, baseline, (factor_freq, inv_freq))
        if kfac_pytorch is not None:
            contenders["kfac-pytorch"] = Stepper(args, batch, kfac_pytorch, (factor_freq, inv_freq))
        for stepper in contenders.values():  # warm caches, cuDNN plans and worker threads
            for _ in range(2):
                stepper.step()
        period = math.lcm(factor_freq, inv_freq)
        rounds = []
        for r in range(args.rounds):
            entry = one_round(args, sgd, contenders, period)
            rounds.append(entry)
            extra = "".join(f"  {name} {entry[f'{name}_ms']:7.1f} ms ({entry[f'{name}_ratio']:.2f})"
                            for name in contenders if name != "kfac")
            print(
                f"{args.precision} ({factor_freq:>2}, {inv_freq:>3}) round {r + 1}/{args.rounds}: "
                f"SGD {entry['sgd_ms']:7.1f} ms  K-FAC {entry['kfac_ms']:7.1f} ms  ratio {entry['ratio']:.2f}{extra}",
                flush=True,
            )
        attribution = None
        if args.device == "cuda":  # the phases with the device's seconds in them (see the module doc)
            contenders["kfac"].pre.device_timings = True
            attribution = one_round(args, sgd, {"kfac": contenders["kfac"]}, period)
            contenders["kfac"].pre.device_timings = False
        results.append(summarise(args, factor_freq, inv_freq, rounds, contenders["kfac"].pre, attribution))
        if args.partial is not None:  # what is measured so far survives a timeout
            args.partial(results)
        if args.profile and (factor_freq, inv_freq) == (1, 10):
            profile(args, contenders["kfac"], period)
        for stepper in contenders.values():
            if hasattr(stepper.pre, "remove_hooks"):
                stepper.pre.remove_hooks()
        del contenders
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return results


def one_round(args: argparse.Namespace, sgd: Stepper, contenders: dict[str, Stepper], period: int) -> dict:
    """One inverse-update period of steps, the contenders alternating step by step (so that other processes
    on a shared machine slow all alike): mean ms per step of each, ratios to SGD, K-FAC's phases per step."""
    totals = {"sgd": 0.0, **{name: 0.0 for name in contenders}}
    pre = contenders["kfac"].pre
    before = {p: pre.timings.get(p, 0.0) for p in PHASES}
    for _ in range(period):
        for name, stepper in [("sgd", sgd), *contenders.items()]:
            _sync(args.device)
            start = time.perf_counter()
            stepper.step()
            _sync(args.device)
            totals[name] += time.perf_counter() - start
    ms = {name: total / period * 1e3 for name, total in totals.items()}
    if getattr(pre, "device_timings", False):
        pre.settle_timings()
    phases = {p: (pre.timings.get(p, 0.0) - before[p]) / period * 1e3 for p in PHASES}
    entry = {"sgd_ms": ms["sgd"], "kfac_ms": ms["kfac"], "ratio": ms["kfac"] / ms["sgd"], "phases": phases}
    for name in contenders:
        if name != "kfac":
            entry.update({f"{name}_ms": ms[name], f"{name}_ratio": ms[name] / ms["sgd"]})
    return entry


def attributed(entry: dict) -> dict[str, float]:
    """K-FAC's extra ms per step by phase, and "hooks and the rest": the extra time no phase holds."""
    phases = {k: round(v, 2) for k, v in entry["phases"].items()}
    phases["hooks and the rest"] = round(entry["kfac_ms"] - entry["sgd_ms"] - sum(entry["phases"].values()), 2)
    return phases


def summarise(args: argparse.Namespace, factor_freq: int, inv_freq: int, rounds: list[dict], pre: Any,
              attribution: dict | None = None) -> dict:
    # Interference only ever adds time: the median of the per-round ratios is reported, with the
    # phases of the round closest to it, or on a GPU those of the round timed by device events.
    ratio = statistics.median(r["ratio"] for r in rounds)
    typical = min(rounds, key=lambda r: abs(r["ratio"] - ratio))
    source = attribution or typical
    phases = attributed(source)
    key = (factor_freq, inv_freq)
    result = {
        "precision": args.precision,
        "factor_update_freq": factor_freq,
        "inv_update_freq": inv_freq,
        "sgd_ms": typical["sgd_ms"],
        "kfac_ms": typical["kfac_ms"],
        "ratio": ratio,
        "min_ratio": min(r["ratio"] for r in rounds),
        "max_ratio": max(r["ratio"] for r in rounds),
        "rounds": rounds,
        "target": TARGETS[args.device].get(key) if args.precision != "amp" else None,
        "kfac_pytorch_ratio": REFERENCE_KFAC_PYTORCH[args.device].get(key) if args.precision != "amp" else None,
        "phase_ms_per_step": phases,
        "extra_ms_per_step": source["kfac_ms"] - source["sgd_ms"],
        "unattributed_share": phases["hooks and the rest"] / max(source["kfac_ms"] - source["sgd_ms"], 1e-9),
        "phases_from": "a round timed by device events" if attribution else "the typical round",
        "eigen_recoveries": pre.stats["eigen_recoveries"],
    }
    if "baseline_ratio" in rounds[0]:
        result["baseline_ratio"] = statistics.median(r["baseline_ratio"] for r in rounds)
        result["kfac_over_baseline"] = statistics.median(r["kfac_ms"] / r["baseline_ms"] for r in rounds)
    if "kfac-pytorch_ratio" in rounds[0]:
        result["kfac_pytorch_ms"] = statistics.median(r["kfac-pytorch_ms"] for r in rounds)
        result["kfac_pytorch_measured_ratio"] = statistics.median(r["kfac-pytorch_ratio"] for r in rounds)
    return result


def profile(args: argparse.Namespace, stepper: Stepper, period: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(period):
            stepper.step()
        _sync(args.device)
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25)
    (args.out.parent / f"{args.out.name}_profile.txt").write_text(table)
    print(table)


def conv_statistics(args: argparse.Namespace) -> None:
    """--conv-statistics: every Conv2d layer's A statistics (the hooks' work) of this checkout against --baseline's,
    alternating pass by pass over the layers; the median of the per-round ratios, printed and saved (--out, or
    benchmarks/results/kfac_conv_statistics.json with --refresh-results)."""
    from hpcdl.training.models import build_model as hpcdl_model

    stem = outputs.results_stem(args.out, "kfac_conv_statistics", (".json",), refresh_results=args.refresh_results,
                                force=args.force, flag="--out")
    load, rows = os.getloadavg(), []
    torch.set_num_threads(args.threads)
    packages = {"this": import_kfac(None), "baseline": import_kfac(args.baseline)}
    for spec in args.conv_statistics.split():
        name, batch = spec.split(":")
        channels, size = (1, 28) if name.startswith("mnist") else (3, 32)
        model = hpcdl_model(name, num_classes=10, in_channels=channels)
        convs = {k: [layer for layer in p.layers.find_layers(model) if isinstance(layer, p.layers.Conv2dLayer)]
                 for k, p in packages.items()}
        inputs: list[torch.Tensor] = []
        hooks = [layer.module.register_forward_hook(lambda m, i, o, seen=inputs: seen.append(i[0]))
                 for layer in convs["this"]]
        with torch.no_grad():
            model(torch.randn(int(batch), channels, size, size))
        for hook in hooks:
            hook.remove()
        seconds: dict[str, list[float]] = {k: [] for k in packages}
        for _ in range(args.rounds + 1):  # the first round warms up and is left out
            for k, layers in convs.items():
                start = time.perf_counter()
                with torch.no_grad():
                    for layer, x in zip(layers, inputs, strict=True):
                        layer.a_moment(x)
                seconds[k].append(time.perf_counter() - start)
        ratio = statistics.median(b / t for b, t in zip(seconds["baseline"][1:], seconds["this"][1:], strict=True))
        ms = {k: 1e3 * statistics.median(v[1:]) for k, v in seconds.items()}
        print(f"{name} batch {batch}: conv A statistics {ms['baseline']:.1f} ms (baseline) -> {ms['this']:.1f} ms, "
              f"baseline/this {ratio:.2f} (median of {args.rounds} interleaved rounds, {args.threads} thread(s))")
        rows.append(dict(model=name, batch=int(batch), baseline_ms=ms["baseline"], this_ms=ms["this"], speedup=ratio))
    report = dict(threads=args.threads, rounds=args.rounds, baseline=str(args.baseline), torch=torch.__version__,
                  load_average_at_start=load, rows=rows)
    print(f"wrote {save_json(stem, report, indent=2)}")


def conv_methods(args: argparse.Namespace) -> None:
    """--conv-methods: every Conv2d layer's A statistics by each method that applies (kfac/patches.py: row products,
    autocorrelation, the unfolded patches' Gram), the model's own inputs (ResNet-50 at 224x224, channels-last, on
    CUDA; resnet32 on a CPU); per method the sum over layers, beside the fixed rule's and the fastest per layer (what
    the first step's timing picks on a GPU)."""
    from kfac import patches
    from kfac.layers import Conv2dLayer, find_layers
    from kfac.precision import fp32_products

    stem = outputs.results_stem(args.out, f"kfac_conv_methods{'' if args.device == 'cpu' else '_cuda'}", (".json",),
                                refresh_results=args.refresh_results, force=args.force, flag="--out")
    torch.set_num_threads(args.threads)
    set_tf32(args)
    model = build_model(args).to(args.device)
    x, _ = make_batch(args)
    layers = [layer for layer in find_layers(model) if isinstance(layer, Conv2dLayer)]
    inputs: list[torch.Tensor] = []
    hooks = [layer.module.register_forward_hook(lambda m, i, o, seen=inputs: seen.append(i[0])) for layer in layers]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    precisions = ("ieee", "tf32") if args.device == "cuda" else ("ieee",)
    rows, totals = [], {}
    for precision in precisions:
        with fp32_products(precision):
            for layer, x in zip(layers, inputs, strict=True):
                geometry, bias = layer.geometry, layer.has_bias
                seconds = {name: patches.method_seconds(name, x, geometry, bias, repeats=args.rounds)
                           for name in patches.applicable_methods(x, geometry)}
                fastest = min(seconds, key=seconds.__getitem__)
                moment = patches.patch_moment(x, geometry, bias)
                with fp32_products("ieee"):
                    exact = patches.patch_moment(x.double(), geometry, bias)
                error = float((moment.double() - exact).norm() / exact.norm())
                rows.append(dict(precision=precision, layer=layer.name, input=list(x.shape),
                                 kernel=list(geometry.kernel), stride=list(geometry.stride),
                                 ms={k: 1e3 * v for k, v in seconds.items()}, fixed=patches.fixed_method(x, geometry),
                                 fastest=fastest, relative_error=error))
        mine = [r for r in rows if r["precision"] == precision]
        total = {name: sum(r["ms"].get(name, r["ms"]["unfold"]) for r in mine) for name in patches.MOMENT_METHODS}
        total["fixed rule"] = sum(r["ms"][r["fixed"]] for r in mine)
        total["fastest per layer"] = sum(r["ms"][r["fastest"]] for r in mine)
        totals[precision] = total
        print(f"conv A statistics in {precision}, {len(mine)} layers, batch {args.batch_size} on {args.device} "
              "(ms, all layers; a method that does not apply counts the unfolded Gram): "
              + ", ".join(f"{k} {v:.1f}" for k, v in total.items())
              + f"; largest relative error against float64 {max(r['relative_error'] for r in mine):.1e}")
        for r in mine:
            print(f"  {r['layer']:<24} {'x'.join(map(str, r['input'][1:])):>12} k{r['kernel'][0]} s{r['stride'][0]}  "
                  + "  ".join(f"{k} {v:.2f}" for k, v in r["ms"].items()) + f"  -> {r['fastest']}")
    report = dict(device=args.device, device_name=torch.cuda.get_device_name() if args.device == "cuda" else
                  f"{args.threads} CPU threads", model="resnet50" if args.device == "cuda" else "resnet32",
                  batch=args.batch_size, repeats=args.rounds, torch=torch.__version__, totals_ms=totals, rows=rows)
    print(f"wrote {save_json(stem, report, indent=2)}")


def set_tf32(args: argparse.Namespace) -> None:
    """The training script's own choice on a GPU: TF32 for its float32 matmuls and convolutions."""
    if args.device == "cuda":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"  # type: ignore[attr-defined]
        torch.backends.cudnn.benchmark = True


# ------------------------------------------------------------------ memory, in fresh processes
def memory_child(args: argparse.Namespace) -> None:
    """Run one variant for a few steps and print its peak memory as JSON (see the module doc)."""
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    set_tf32(args)
    batch = make_batch(args)
    freqs = None if args.memory_of == "sgd" else tuple(int(v) for v in args.memory_of.split(","))
    kfac = import_kfac(args.baseline) if freqs is not None else None
    if freqs is not None and args.kfac_pytorch is not None:
        kfac = kfac_pytorch_adapter.load_beside(args.kfac_pytorch)
    base_rss = _current_rss()
    stepper = Stepper(args, batch, kfac, freqs)  # type: ignore[arg-type]
    steps = min(12, math.lcm(*freqs)) if freqs else 12
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        stepper.step()
    _sync(args.device)
    if args.device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    print(json.dumps({"variant": args.memory_of, "peak_bytes": peak}), flush=True)


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_memory(args: argparse.Namespace, variant: str, baseline: Path | None = None,
                   kfac_pytorch: Path | None = None) -> float:
    command = [sys.executable, __file__, "--device", args.device, "--precision", args.precision]
    command += ["--threads", str(args.threads), "--batch-size", str(args.batch_size), "--memory-of", variant]
    command += ["--kfac-method", args.kfac_method, "--amp-dtype", args.amp_dtype]
    command += ["--kfac-statistics-precision", args.kfac_statistics_precision]
    if args.kfac_factor_examples is not None:
        command += ["--kfac-factor-examples", str(args.kfac_factor_examples)]
    if baseline is not None:
        command += ["--baseline", str(baseline)]
    if kfac_pytorch is not None:
        command += ["--kfac-pytorch", str(kfac_pytorch)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    line = next(line for line in reversed(out.splitlines()) if line.startswith("{"))
    return json.loads(line)["peak_bytes"] / 2**30


# ------------------------------------------------------------------ output
def write_json(report: dict, out: Path) -> None:
    save_json(out, report, indent=2)


def write(report: dict, out: Path) -> None:
    write_json(report, out)
    header = "precision,factor_update_freq,inv_update_freq,sgd_ms,kfac_ms,median_ratio,min_ratio,max_ratio"
    lines = [header + ",target,kfac_pytorch_ratio,peak_gib,sgd_peak_gib,baseline_ratio"]
    for r in report["results"]:
        lines.append(
            f"{r['precision']},{r['factor_update_freq']},{r['inv_update_freq']},{r['sgd_ms']:.1f},{r['kfac_ms']:.1f},"
            f"{r['ratio']:.3f},{r['min_ratio']:.3f},{r['max_ratio']:.3f},{r['target'] or ''},"
            f"{r['kfac_pytorch_ratio'] or ''},{_fmt(r.get('peak_gib'))},"
            f"{_fmt(report['sgd_peak_gib'].get(r['precision']))},{_fmt(r.get('baseline_ratio'))}"
        )
    outputs.output_file(out, ".csv").write_text("\n".join(lines) + "\n")
    plot(report, out)


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def plot(report: dict, out: Path) -> None:
    results = report["results"]
    labels = [f"({r['factor_update_freq']}, {r['inv_update_freq']})" + (" AMP" if r["precision"] == "amp" else "")
              for r in results]
    xs = list(range(len(labels)))
    with_memory = any(r.get("peak_gib") is not None for r in results)
    with figure(out, 1, 2 if with_memory else 1, figsize=(11 if with_memory else 6.4, 3.8), squeeze=False) \
            as (_, axes):
        ax = axes[0][0]
        spread = [[r["ratio"] - r["min_ratio"] for r in results], [r["max_ratio"] - r["ratio"] for r in results]]
        ax.bar([x - 0.2 for x in xs], [r["ratio"] for r in results], width=0.4, yerr=spread, capsize=4,
               label="hpcdl kfac (median, min-max)")
        ax.bar([x + 0.2 for x in xs], [r["kfac_pytorch_ratio"] or 0 for r in results], width=0.4,
               label="kfac-pytorch (issues)", color="tab:gray")
        if any(r.get("baseline_ratio") for r in results):
            ax.plot(xs, [r.get("baseline_ratio") or float("nan") for r in results], "kD", label="previous hpcdl kfac")
        for x, r in zip(xs, results, strict=True):
            if r["target"]:
                ax.hlines(r["target"], x - 0.45, x + 0.45, colors="tab:red", linestyles="--",
                          label="target" if x == 0 else None)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(xs, labels)
        ax.set_xlabel("(factor, inverse) update frequency")
        ax.set_ylabel("step time / SGD step time")
        ax.set_title(f"K-FAC overhead, {report['model']}, batch {report['batch'][0]}, {report['device_name']}",
                     fontsize=9)
        ax.legend(fontsize=8)
        if with_memory:
            ax = axes[0][1]
            unit = "GiB" if report["device"] == "cuda" else "GiB (peak RSS growth)"
            ax.bar([x - 0.2 for x in xs], [r.get("peak_gib") or 0 for r in results], width=0.4, label="hpcdl kfac")
            ax.bar([x + 0.2 for x in xs], [r.get("kfac_pytorch_peak_gib") or 0 for r in results], width=0.4,
                   color="tab:gray", label="kfac-pytorch (issue)")
            for precision, peak in report["sgd_peak_gib"].items():
                ax.axhline(peak, color="black", linewidth=0.8, linestyle=":" if precision == "amp" else "-",
                           label=f"SGD {precision}")
            ax.set_xticks(xs, labels)
            ax.set_ylabel(f"peak memory, {unit}")
            ax.set_title("peak memory (fresh process per variant)", fontsize=9)
            ax.legend(fontsize=8)


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    parser = RankZeroParser(prog="benchmarks/kfac_overhead.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precisions", default=None, help="cuda: 'fp32 amp' (default); cpu: 'fp32'")
    parser.add_argument("--amp-dtype", choices=tuple(AMP_DTYPES), default="bf16",
                        help="autocast's dtype for 'amp' (fp16 with the GradScaler; bf16, hpcdl.train --amp auto's "
                             "choice on GPUs that have it, without)")
    parser.add_argument("--threads", type=integer(1, 256), default=2, help="CPU threads (cpu only)")
    parser.add_argument("--batch-size", type=integer(1), default=64)
    parser.add_argument("--rounds", type=integer(1), default=5)
    parser.add_argument("--kfac-method", choices=("eigen", "inverse", "newton"), default="eigen",
                        help="hpcdl K-FAC's decomposition method (docs/kfac.md; newton: matrix products only)")
    parser.add_argument("--kfac-tf32", action="store_true",
                        help="hpcdl K-FAC's statistics (and newton's first steps) in TF32 on CUDA, as hpcdl.train "
                             "runs it")
    parser.add_argument("--kfac-statistics-precision", choices=("same", "bf16"), default="same",
                        help="hpcdl K-FAC's statistics_dtype: bf16 rounds a float32 model's layer inputs first "
                             "(the GPU's half-precision matrix units; docs/kfac.md)")
    parser.add_argument("--kfac-factor-examples", type=integer(1), default=None,
                        help="hpcdl K-FAC's factor_examples: the examples of a batch its statistics use (default all)")
    parser.add_argument("--configs", type=frequency_pairs, default=None,
                        help="(factor,inverse) pairs, e.g. '1,10 10,100'")
    parser.add_argument("--quick", action="store_true", help="one round of (1,10) only")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--memory-configs", type=frequency_pairs, default=None,
                        help="the (factor,inverse) pairs whose peak memory is measured (default: every --configs pair)")
    parser.add_argument("--baseline", type=Path, default=None, help="a checkout whose kfac/ is a third contender")
    parser.add_argument("--kfac-pytorch", type=Path, default=None,
                        help="kfac-pytorch's checkout or install site: a contender beside ours (no install needed)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler table for (1, 10)")
    parser.add_argument("--conv-statistics", metavar="MODEL:BATCH ...", default=None,
                        help="instead: time each conv layer's A statistics against --baseline's, e.g. "
                             "'resnet32:4 mnist_cnn:256'")
    parser.add_argument("--conv-methods", action="store_true",
                        help="instead: time each conv layer's A statistics by every method kfac/patches.py has")
    parser.add_argument("--out", type=Path, default=None,
                        help="results stem: STEM.json/.csv/.png (default: a new folder under runs/bench/; "
                             "--refresh-results replaces benchmarks/results/kfac_overhead*)")
    outputs.add_arguments(parser)
    parser.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.set_defaults(partial=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible (torch.cuda.is_available() is False)")
    if args.kfac_pytorch is not None:
        try:
            kfac_pytorch_adapter.package_dir(args.kfac_pytorch)
        except ValueError as error:
            parser.error(f"--kfac-pytorch: {error}")
    if args.memory_of is not None:
        memory_child(args)
        return
    if args.conv_statistics is not None:
        if args.baseline is None:
            parser.error("--conv-statistics needs --baseline DIR (a checkout whose kfac/ it is compared with)")
        conv_statistics(args)
        return
    if args.conv_methods:
        conv_methods(args)
        return
    args.configs = [(1, 10)] if args.quick else (args.configs or frequency_pairs(DEFAULT_CONFIGS[args.device]))
    memory_configs = args.configs if args.memory_configs is None else args.memory_configs
    unmeasured = [f"{f},{i}" for f, i in memory_configs if (f, i) not in args.configs]
    if unmeasured:
        parser.error(f"--memory-configs {' '.join(unmeasured)}: not among the timed pairs "
                     f"({' '.join(f'{f},{i}' for f, i in args.configs)}); memory is measured beside a timed pair")
    suffix = "" if args.device == "cpu" else "_cuda"
    args.out = outputs.results_stem(args.out, f"kfac_overhead{suffix}", (".json", ".csv", ".png"),
                                    refresh_results=args.refresh_results, force=args.force, flag="--out")
    if args.quick:
        args.rounds = 1
    precisions = (args.precisions or ("fp32 amp" if args.device == "cuda" else "fp32")).split()
    if args.device == "cpu" and precisions != ["fp32"]:
        parser.error("--precisions: the CPU benchmark runs in fp32 only")

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"{args.threads} CPU threads"
    report: dict = {
        "device": args.device,
        "device_name": device_name,
        "model": "resnet50" if args.device == "cuda" else "resnet32",
        "batch": [args.batch_size, 3, 224, 224] if args.device == "cuda" else [args.batch_size, 3, 32, 32],
        "threads": args.threads if args.device == "cpu" else torch.get_num_threads(),
        "rounds": args.rounds,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "baseline": str(args.baseline) if args.baseline else None,
        "kfac_pytorch": str(args.kfac_pytorch) if args.kfac_pytorch else None,
        "kfac_method": args.kfac_method,
        "amp_dtype": args.amp_dtype,
        "kfac_statistics_precision": args.kfac_statistics_precision,
        "kfac_factor_examples": args.kfac_factor_examples,
        "results": [],
        "sgd_peak_gib": {},
    }
    for precision in precisions:
        args.precision = precision
        args.partial = lambda done: write_json(dict(report, results=report["results"] + done, partial=True), args.out)
        results = run(args)
        if not args.no_memory:
            report["sgd_peak_gib"][precision] = measure_memory(args, "sgd")
            for r in results:
                if (r["factor_update_freq"], r["inv_update_freq"]) not in memory_configs:
                    continue
                variant = f"{r['factor_update_freq']},{r['inv_update_freq']}"
                r["peak_gib"] = measure_memory(args, variant)
                if args.baseline:
                    r["baseline_peak_gib"] = measure_memory(args, variant, args.baseline)
                if args.kfac_pytorch:
                    r["kfac_pytorch_measured_peak_gib"] = measure_memory(args, variant, kfac_pytorch=args.kfac_pytorch)
                write_json(dict(report, results=report["results"] + results, partial=True), args.out)
                if precision == "fp32":
                    key = (r["factor_update_freq"], r["inv_update_freq"])
                    r["kfac_pytorch_peak_gib"] = REFERENCE_KFAC_PYTORCH_GIB.get(args.device, {}).get(key)
        report["results"].extend(results)
    report["load_average_at_end"] = os.getloadavg()
    write(report, args.out)
    for r in report["results"]:
        met = "" if r["target"] is None else ("  (target met)" if r["ratio"] <= r["target"] else "  (target MISSED)")
        memory = f"  peak {r['peak_gib']:.2f} GiB" if r.get("peak_gib") is not None else ""
        base = f"  previous version {r['baseline_ratio']:.2f}" if r.get("baseline_ratio") else ""
        if r.get("kfac_pytorch_measured_ratio"):
            base += f"  kfac-pytorch {r['kfac_pytorch_measured_ratio']:.2f}"
        print(
            f"{r['precision']} ({r['factor_update_freq']}, {r['inv_update_freq']}): K-FAC/SGD = {r['ratio']:.2f}"
            f"{met}{base}{memory}  extra {r['extra_ms_per_step']:.1f} ms/step, unattributed "
            f"{100 * r['unattributed_share']:.1f} %: {r['phase_ms_per_step']}"
        )
    print(f"wrote {outputs.output_file(args.out, '.json')}, .csv, .png")


# ---- the figures the documents quote (benchmarks/figures.py) -------------------------------------------

FREQUENCIES = ((1, 10), (10, 10), (10, 100))


def _at(factors: int, inverse: int) -> dict[str, Any]:
    return next(r for r in results("kfac_overhead")["results"]
                if (r["factor_update_freq"], r["inv_update_freq"]) == (factors, inverse))


def _table() -> str:
    rows = []
    for f, i in FREQUENCIES:
        r = _at(f, i)
        target = f"≤ {r['target']}× (kfac-pytorch: {r['kfac_pytorch_ratio']}×)" if r.get("target") else ""
        rows.append((f"({f}, {i})", f"{r['sgd_ms']:.1f}", f"{r['kfac_ms']:.1f}",
                     f"{times(r['ratio'])} ({r['min_ratio']:.2f}–{r['max_ratio']:.2f})",
                     times(r["baseline_ratio"]), target))
    return table(["(factor, inverse) freq", "SGD ms", "K-FAC ms",
                  f"K-FAC / SGD (median of {results('kfac_overhead')['rounds']} rounds; min–max)",
                  "the previous kfac / SGD", "target"], rows)


def _conv_speedups() -> str:
    rows = results("kfac_conv_statistics")["rows"]
    resnet = [r for r in rows if r["model"] == "resnet32"]
    others = "".join(f", {times(r['speedup'])} on {r['model']}'s {r['batch']} examples" for r in rows
                     if r["model"] != "resnet32")
    return (" / ".join(times(r["speedup"]) for r in resnet) + " at batch " + " / ".join(str(r["batch"]) for r in resnet)
            + f" on resnet32{others} ({results('kfac_conv_statistics')['threads']} thread)")


def _small_batch() -> str:
    run = results("kfac_overhead_b4")
    return ", ".join(f"{times(r['baseline_ratio'])} → {times(r['ratio'])} at ({r['factor_update_freq']}, "
                     f"{r['inv_update_freq']})" for r in run["results"]) + f" (resnet32, batch {run['batch'][0]})"


FIGURES = {"overhead.conv_statistics": _conv_speedups, "overhead.small_batch": _small_batch,
           "overhead.ratios": lambda: " / ".join(times(_at(f, i)["ratio"]) for f, i in FREQUENCIES),
           "overhead.10_10": lambda: times(_at(10, 10)["ratio"]), "overhead.table": _table}


if __name__ == "__main__":
    run_main(main, program="kfac_overhead.py")
