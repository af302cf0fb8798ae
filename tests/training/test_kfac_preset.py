"""--kfac-preset large-batch: what it sets is what README and docs/kfac.md say, given flags win, and the
preconditioner hpcdl.train builds from it carries those values."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from hpcdl.runtime.errors import UsageError
from hpcdl.training.config import KFAC_PRESETS, BatchUnits, TrainConfig, parse_config, warmup_start_factor
from hpcdl.training.optimizers import build_preconditioner

REPO = Path(__file__).resolve().parents[2]
# How both documents state the preset: "`--kfac-preset large-batch` sets `<flags>`".
STATED = re.compile(r"`--kfac-preset large-batch` sets `([^`]+)`")


@pytest.mark.parametrize("document", ["README.md", "docs/kfac.md"])
def test_the_preset_is_what_the_documents_say(document: str) -> None:
    stated = STATED.findall((REPO / document).read_text())
    assert stated, f"{document} does not state what --kfac-preset large-batch sets"
    preset = parse_config(["--kfac-preset", "large-batch"])
    for flags in stated:
        spelled_out = parse_config(flags.split())  # the stated flags alone, without the preset
        assert dataclasses.replace(spelled_out, kfac_preset="large-batch") == preset, flags


def test_the_preset_turns_kfac_on_and_changes_only_what_it_lists() -> None:
    plain, preset = parse_config([]), parse_config(["--kfac-preset", "large-batch"])
    assert not plain.kfac and preset.kfac  # on
    assert (preset.kfac_inv_update_freq, preset.kfac_factor_update_freq, preset.kfac_factor_examples,
            preset.kfac_grad_worker_fraction, preset.kfac_damping, preset.kfac_kl_clip, preset.momentum) == (
        2, 1, 256, "auto", 0.003, 0.01, 0.5)
    defaults = dataclasses.asdict(TrainConfig())
    for name, value in KFAC_PRESETS["large-batch"].items():
        assert defaults[name] != value, f"the preset repeats the default of {name}"
    changed = {k for k, v in dataclasses.asdict(preset).items() if dataclasses.asdict(plain)[k] != v}
    assert changed == {"kfac_preset", *KFAC_PRESETS["large-batch"]}


def test_given_flags_win_over_the_preset_and_the_dataset_preset_stays() -> None:
    config = parse_config(["--dataset", "mnist", "--kfac-preset", "large-batch", "--kfac-damping", "0.3",
                           "--kfac-inv-update-freq", "5", "--momentum", "0.9"])
    assert (config.kfac_damping, config.kfac_inv_update_freq, config.momentum, config.kfac_kl_clip) == (
        0.3, 5, 0.9, 0.01)
    assert parse_config(["--kfac-preset", "large-batch", "--kfac-inv-update-freq", "10"]).kfac_factor_examples == 256
    given = parse_config(["--kfac-preset", "large-batch", "--kfac-grad-worker-fraction", "0.5"])
    assert given.kfac_grad_worker_fraction == 0.5
    assert config.model == "mnist_cnn" and config.weight_decay == 5e-4  # mnist's preset under it
    assert parse_config(["--kfac-preset", "large-batch", "--kfac-factor-update-freq", "3"]).kfac_factor_update_freq == 3


def test_an_unknown_preset_is_one_line() -> None:
    with pytest.raises(UsageError, match="--kfac-preset") as error:
        parse_config(["--kfac-preset", "huge"])
    assert "\n" not in str(error.value)


def test_the_preconditioner_built_from_the_preset_carries_its_values() -> None:
    config = parse_config(["--dataset", "mnist", "--kfac-preset", "large-batch"])
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    pre = build_preconditioner(config, model, lambda *_: 0.2, None)
    options = pre.options
    assert (options.inv_update_freq, options.factor_update_freq, options.factor_examples, options.damping,
            options.kl_clip) == (2, 1, 256, 0.003, 0.01)
    assert pre.grad_worker_fraction == 1.0  # auto on one rank: fraction 1, the only one there is


def test_the_preset_holds_the_peak_rate_through_the_warm_up_unless_a_factor_is_given() -> None:
    """The preset's warm-up meaning: no ramp (factor 1) where none was given; without the preset, the flag's value
    or None (the schedule's own ramp)."""
    assert warmup_start_factor(parse_config(["--kfac-preset", "large-batch"])) == 1.0
    assert warmup_start_factor(parse_config(["--kfac-preset", "large-batch", "--warmup-start-factor", "1"])) == 1.0
    assert warmup_start_factor(parse_config(["--kfac"])) is None
    assert warmup_start_factor(parse_config(["--warmup-start-factor", "0.25"])) == 0.25


def test_the_batch_units_multiply_out_from_a_config_or_a_saved_one() -> None:
    config = parse_config(["--batch-size", "8", "--batches-per-allreduce", "3"])
    units = BatchUnits.of(config, 4)
    assert (units.per_pass, units.per_rank_step, units.global_batch) == (8, 24, 96)
    assert BatchUnits.of(dataclasses.asdict(config), 4) == units  # a checkpoint's header holds the config as a dict
