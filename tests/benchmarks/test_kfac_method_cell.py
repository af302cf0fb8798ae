"""benchmarks/kfac_method_cell.py: each seed's round runs every K-FAC method and the first-order companions at
their tuned settings, on the ranks and virtual cluster asked for, and every command is one hpcdl.train takes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.training.config import parse_config
from tests.support.data_files import write_mnist

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "kfac_method_cell.py"


def dry_run(*flags: str) -> list[list[str]]:
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *flags], capture_output=True, text=True,
                          cwd=REPO, env={"PYTHONPATH": f"{REPO}:{REPO / 'benchmarks'}", "PATH": "/usr/bin:/bin"},
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return [line.split() for line in done.stdout.splitlines() if line.strip()]


@pytest.mark.processes  # runs the benchmark's --dry-run
def test_the_2x1_round_runs_each_method_then_muon_at_their_tuned_settings_evaluated_as_asked(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    commands = dry_run("--data-dir", str(tmp_path), "--ranks", "2", "--vcluster", "vc", "--first-order", "muon",
                       "--seeds", "3", "4", "--evals-per-epoch", "14")
    tuned = {"kfac": 0.4, "muon": 0.02}  # the tuning's picks at batch 4096 (kfac_large_batch_modern.md's table)
    names = []
    for words in commands:
        assert words[words.index("--vcluster") + 1] == "vc" and words[words.index("-np") + 1] == "2"
        flags = words[words.index("--") + 1:]
        config = parse_config(flags)
        method = f"kfac-{config.kfac_method}" if config.kfac else config.optimizer
        names.append((config.seed, method))
        # hpcdl.train's rate is per rank's batch: twice it is the tuned global rate at 2 ranks x 2048.
        assert config.batch_size * 2 == 4096
        assert abs(2 * config.base_lr - tuned["kfac" if config.kfac else method]) < 1e-9
        assert config.eval_every == 1  # 14 evaluations an epoch of 14 steps: the time to target to the step
    assert names == [(seed, m) for seed in (3, 4) for m in ("kfac-eigen", "kfac-newton", "kfac-inverse", "muon")]


@pytest.mark.processes  # runs the benchmark's --dry-run
def test_bf16_statistics_runs_name_the_plugin_that_sets_statistics_dtype(tmp_path: Path) -> None:
    """--statistics same bf16 runs each method twice, the second through --kfac-impl kfac_method_cell:bf16_statistics,
    and that plugin builds hpcdl's K-FAC with the run's settings and statistics_dtype=bfloat16."""
    import torch

    from hpcdl.training.models import build_model
    from tests.support.scripts import load_benchmark

    write_mnist(tmp_path)
    commands = dry_run("--data-dir", str(tmp_path), "--kfac-methods", "inverse", "--statistics", "same", "bf16",
                       "--seeds", "0")
    configs = [parse_config(words[words.index("hpcdl.train") + 1:] if "hpcdl.train" in words
                            else words[words.index("--") + 1:]) for words in commands]
    assert [(c.kfac_method, c.kfac_impl) for c in configs] == [
        ("inverse", "hpcdl"), ("inverse", "kfac_method_cell:bf16_statistics")]
    cell = load_benchmark("kfac_method_cell")
    pre = cell.bf16_statistics(configs[1], build_model("mnist_cnn", 10, 1), lambda: 0.1, None)
    assert pre.options.statistics_dtype == torch.bfloat16 and pre.method == "inverse"
    assert pre.options.damping == configs[1].kfac_damping


@pytest.mark.processes  # runs the benchmark's --dry-run
def test_a_variant_runs_each_method_again_with_its_flags_after_the_preset_s(tmp_path: Path) -> None:
    """--variants NAME=FLAGS: a preset value tried beside today's in the same round; the flags win over the
    preset's (hpcdl.train: flags given win), and the other runs keep the preset's values."""
    write_mnist(tmp_path)
    commands = dry_run("--data-dir", str(tmp_path), "--kfac-methods", "inverse", "--seeds", "0", "--variants",
                       "examples-512=--kfac-factor-examples 512", "clip=--kfac-kl-clip 0.005")
    configs = [parse_config(words[words.index("hpcdl.train") + 1:]) for words in commands]
    assert [(c.kfac_method, c.kfac_factor_examples, c.kfac_kl_clip) for c in configs] == [
        ("inverse", 256, 0.01), ("inverse", 512, 0.01), ("inverse", 256, 0.005)]
    assert [words[words.index("--output-dir") + 1] for words in commands] == [
        "/tmp/kfac-inverse", "/tmp/kfac-inverse+examples-512", "/tmp/kfac-inverse+clip"]


@pytest.mark.parametrize("entries", [["=--kfac-kl-clip 0.005"], ["clip="], ["a b=--momentum 0"], ["a+b=--momentum 0"],
                                     ["bf16-statistics=--momentum 0"], ["clip"],
                                     ["a=--momentum 0", "a=--momentum 0.9"]])  # the last: a name given twice
def test_a_malformed_variant_is_a_one_line_error(entries: list[str]) -> None:
    from hpcdl.runtime.errors import UsageError
    from tests.support.scripts import load_benchmark

    with pytest.raises(UsageError, match="--variants"):
        load_benchmark("kfac_method_cell").variant_flags(entries)
