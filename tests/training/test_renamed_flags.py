"""Renamed K-FAC flags (issue 28): the old names still parse to the same configuration with one line of
notice, and a run checkpointed under the old names resumes under the new ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcdl.training import config as config_module
from hpcdl.training.config import FIELDS, OLD_SWITCH, RENAMED, current_names, option_name, parse_config
from hpcdl.training.train import train

# Each old spelling, and the new one it must equal.
OLD_AND_NEW = [
    (["--kfac-update-freq", "5"], ["--kfac", "--kfac-inv-update-freq", "5"]),
    (["--kfac-update-freq", "0"], ["--no-kfac"]),
    (["--kfac-preset", "large-batch", "--kfac-update-freq", "3"], ["--kfac-preset", "large-batch",
                                                                    "--kfac-inv-update-freq", "3"]),
    (["--kfac-cov-update-freq", "3"], ["--kfac-factor-update-freq", "3"]),
    (["--damping=0.3"], ["--kfac-damping", "0.3"]),
    (["--kl-clip", "0.02"], ["--kfac-kl-clip", "0.02"]),
    (["--factor-decay", "0.9"], ["--kfac-factor-decay", "0.9"]),
]


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "NOTED", set())


@pytest.mark.parametrize(("old", "new"), OLD_AND_NEW)
def test_an_old_flag_parses_to_the_new_ones_with_one_line_of_notice(old: list[str], new: list[str],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_config(old) == parse_config(new)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "is deprecated, use --kfac" in lines[0], captured.err


def test_the_notice_is_said_once_per_process(capsys: pytest.CaptureFixture[str]) -> None:
    for _ in range(3):
        parse_config(["--damping", "0.1"])
    assert capsys.readouterr().err.count("--damping is deprecated") == 1


def test_old_names_are_not_in_the_help() -> None:
    help_text = config_module.build_parser().format_help()
    for old in [*RENAMED, OLD_SWITCH]:
        assert option_name(old) + " " not in help_text and option_name(old) + "\n" not in help_text


def test_a_bad_old_switch_is_one_line() -> None:
    with pytest.raises(config_module.UsageError, match="--kfac-update-freq must be >= 0"):
        parse_config(["--kfac-update-freq", "-2"])


def test_every_renamed_flag_names_a_field() -> None:
    assert set(RENAMED.values()) <= set(FIELDS) and not set(RENAMED) & set(FIELDS)
    assert OLD_SWITCH not in FIELDS


def test_a_saved_configuration_under_old_names_reads_as_today_s() -> None:
    old = dict(kfac_update_freq=7, kfac_cov_update_freq=2, damping=0.2, kl_clip=0.05, factor_decay=0.8, epochs=3)
    assert current_names(old) == dict(kfac=True, kfac_inv_update_freq=7, kfac_factor_update_freq=2, kfac_damping=0.2,
                                      kfac_kl_clip=0.05, kfac_factor_decay=0.8, epochs=3)
    off = current_names(dict(kfac_update_freq=0))
    assert off == dict(kfac=False, kfac_inv_update_freq=FIELDS["kfac_inv_update_freq"].default)
    assert current_names({"kfac": True, "kfac_damping": 0.1}) == {"kfac": True, "kfac_damping": 0.1}


def old_header(config: dict) -> dict:
    """A checkpoint's configuration as hpcdl saved it before the rename."""
    saved = {next((o for o, n in RENAMED.items() if n == k), k): v for k, v in config.items()}
    saved[OLD_SWITCH] = saved.pop("kfac_inv_update_freq") if saved.pop("kfac") else 0
    return saved


@pytest.mark.processes
def test_a_run_checkpointed_under_the_old_names_resumes(tmp_path: Path) -> None:
    flags = ["--epochs", "1", "--seed", "3", "--kfac", "--kfac-inv-update-freq", "5", "--kfac-damping", "0.02",
             "--no-progress", "--output-dir", str(tmp_path)]
    assert train(parse_config(flags)).exit_code == 0
    newest = sorted((tmp_path / "checkpoints").glob("ckpt-*.pt"))[-1]
    state = torch.load(newest, map_location="cpu", weights_only=True)
    state["config"] = old_header(state["config"])
    assert "damping" in state["config"] and "kfac_damping" not in state["config"]
    torch.save(state, newest)
    assert train(parse_config([*flags[:-2], "--epochs", "2", "--resume", "--output-dir", str(tmp_path)])).exit_code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["epochs"] == 2
    assert summary["resumed_with_changes"] == ["--epochs 1 -> 2"]  # the renamed K-FAC settings read as unchanged
