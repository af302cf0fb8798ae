"""hpcdl.config: every flag round-trips, presets hold only differences, and bad values get one line naming the flag."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hpcdl.runtime.errors import UsageError
from hpcdl.training.config import (
    FIELDS,
    PRESETS,
    TrainConfig,
    build_parser,
    default_backend,
    option_name,
    parse_config,
    to_argv,
)

# A valid value different from the default for every field: the round-trip test covers each flag.
CHANGED = dict(
    dataset="cifar10", data_dir="/data/cifar", synthetic_shape=[1, 16, 16], synthetic_classes=5,
    synthetic_size=100, workers=3, decode="gpu", model="resnet20", epochs=7, batch_size=16, test_batch_size=64,
    base_lr=0.05, optimizer="sgd", momentum=0.8, nesterov=True, weight_decay=0.001, label_smoothing=0.1,
    warmup_epochs=2.5, warmup_start_factor=0.1, lr_schedule="step", lr_decay=[3, 5], batches_per_allreduce=2, fp16_allreduce=True,
    use_adasum=False, device="cpu", amp="bf16", channels_last="off", deterministic="off", cudnn_benchmark=False, compile=True,
    log_every=7, kfac=False, kfac_inv_update_freq=4, kfac_factor_update_freq=3, kfac_damping=0.003, kfac_kl_clip=0.002,
    kfac_factor_decay=0.9, kfac_factor_examples=256, kfac_skip_layers=["classifier.1", "Conv2d"],
    kfac_preset="none", kfac_impl="studies.other:kfac", kfac_grad_worker_fraction=0.5, output_dir="/tmp/run", resume=True, seed=7, max_steps=11, target_accuracy=0.9, eval_every=9,
    keep_checkpoints=2, stall_timeout=60.0, max_nonfinite_steps=2, progress=False, task=None, target_metric=None,
    kfac_comm_precision="bf16", kfac_factor_precision="bf16", kfac_conv_approx="reduce", kfac_method="newton", profile_steps="2:3", backend="torch",
)
# Fields whose changed value above equals the default (so the test says why it does not change them).
# kfac and kfac_preset: --compile excludes K-FAC, and the preset needs it (its round trip is its own case below).
# task and target_metric: --task excludes --dataset, --model and others (its round trip is its own case below).
UNCHANGED_ON_PURPOSE = {"optimizer", "use_adasum", "kfac", "kfac_preset", "task", "target_metric"}
if default_backend() == "torch":  # no Horovod here: torch is the default and the only backend that validates
    UNCHANGED_ON_PURPOSE.add("backend")


def test_the_changed_values_cover_every_field() -> None:
    assert set(CHANGED) == set(FIELDS)
    defaults = TrainConfig()
    for name, value in CHANGED.items():
        if name not in UNCHANGED_ON_PURPOSE:
            assert getattr(defaults, name) != value, name


def test_the_command_line_does_not_grow() -> None:
    """The command line is capped at 60 flags: a new K-FAC knob is a preconditioner argument (and, once measured, a
    preset value) before it is a flag users must choose. Deprecated spellings are hidden and not counted."""
    shown = [action for action in build_parser()._actions
             if action.option_strings and action.help != argparse.SUPPRESS and "--help" not in action.option_strings]
    assert len(shown) <= 60, sorted(action.dest for action in shown)


@pytest.mark.parametrize("config", [TrainConfig(), TrainConfig(**CHANGED),
                                    parse_config(["--kfac-preset", "large-batch"]),
                                    parse_config(["--task", "examples.segmentation:task", "--target-metric", "0.8",
                                                  "--epochs", "3"])],
                         ids=["defaults", "every-flag-changed", "kfac-preset", "task"])
def test_every_flag_round_trips(config: TrainConfig) -> None:
    assert parse_config(to_argv(config)) == config


def test_each_default_is_written_once_and_presets_hold_only_differences() -> None:
    defaults = dataclasses.asdict(TrainConfig())
    for dataset, preset in PRESETS.items():
        for name, value in preset.items():
            assert name in FIELDS, f"preset {dataset} sets unknown field {name}"
            assert defaults[name] != value, f"preset {dataset} repeats the default of {name}"
    for action in build_parser()._actions:  # argparse holds no defaults of its own
        assert action.default in (None, "==SUPPRESS==") or action.dest == "help", action.dest


def test_unset_flags_take_the_preset_and_given_flags_win() -> None:
    config = parse_config(["--dataset", "cifar10", "--epochs", "30"])
    assert config.model == "resnet32" and config.lr_decay == [35, 75, 90] and config.epochs == 30
    assert parse_config([]).model == "digits_cnn"


def test_bare_amp_means_auto() -> None:
    assert parse_config(["--amp"]).amp == "auto"
    assert parse_config([]).amp == "off"


@pytest.mark.parametrize("argv, words", [
    (["--base-lr", "nan"], "--base-lr must be > 0 (got nan)"),
    (["--base-lr", "inf"], "--base-lr must be > 0 (got inf)"),
    (["--base-lr", "-1"], "--base-lr must be > 0"),
    (["--momentum", "1.5"], "--momentum must be [0, 1)"),
    (["--weight-decay", "nan"], "--weight-decay must be [0, 1]"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--eval-every", "0"], "--eval-every must be >= 1"),
    (["--kfac-factor-examples", "0"], "--kfac-factor-examples must be >= 1"),
    (["--kfac-grad-worker-fraction", "0"], "--kfac-grad-worker-fraction: must be a fraction in (0, 1] or auto"),
    (["--target-accuracy", "95"], "--target-accuracy must be a fraction in (0, 1]"),
    (["--synthetic-shape", "3", "0", "0"], "--synthetic-shape must be >= 1"),
    (["--lr-decay", "5", "3"], "strictly increasing"),
    (["--lr-decay", "0"], "--lr-decay must be >= 1"),
    (["--lr-decay", "3", "--lr-schedule", "cosine"], "need --lr-schedule step"),
    (["--lr-decay", "3", "--lr-schedule", "cosine", "--dataset", "cifar10"], "need --lr-schedule step"),
    (["--nesterov", "--optimizer", "adam"], "--nesterov needs --optimizer sgd"),
    (["--dataset", "synthetic", "--synthetic-shape", "3", "32", "16"], "must be square"),
    (["--resume"], "--resume needs --output-dir"),
    (["--amp", "fp16", "--device", "cpu"], "--amp fp16 needs CUDA"),
    (["--compile", "--kfac"], "--compile cannot be combined with --kfac"),
    (["--use-adasum", "--kfac"], "--use-adasum cannot be combined with --kfac"),
    (["--use-adasum", "--kfac-update-freq", "10"], "--use-adasum cannot be combined with --kfac"),
    (["--kfac-update-freq", "-1"], "--kfac-update-freq must be >= 0"),
    (["--epochs", "two"], "invalid int value: 'two'"),
    (["--dataset", "mnits"], "invalid choice: 'mnits'"),
    (["--kfac-method", "cholesky"], "invalid choice: 'cholesky'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--epoch", "1"], "unrecognized arguments: --epoch 1"),  # no abbreviations, as the launchers and run()
])
def test_bad_values_get_one_line_naming_the_flag(argv: list[str], words: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_config(argv)
    message = str(caught.value)
    assert words in message and "\n" not in message


def test_every_numeric_flag_rejects_nan() -> None:
    for name, f in FIELDS.items():
        if f.metadata["parse"] is float:
            with pytest.raises(UsageError, match=option_name(name)):
                parse_config([option_name(name), "nan"])


def test_adasum_is_refused_under_torch_in_one_line() -> None:
    with pytest.raises(UsageError, match="--use-adasum is Horovod's Adasum.*--backend horovod"):
        parse_config(["--backend", "torch", "--use-adasum"])


def test_without_horovod_the_default_is_torch_and_horovod_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "horovod" else real(name, *a))
    assert default_backend() == "torch"
    with pytest.raises(UsageError, match="Horovod is not installed here.*use --backend torch"):
        parse_config(["--backend", "horovod"])
