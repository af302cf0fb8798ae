"""Flags that read as switches take their bare form, all of them the same way; a bad CIFAR-10 label names
the batch file that holds it."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from hpcdl.data.cifar import load_cifar10
from hpcdl.runtime.errors import UsageError
from hpcdl.training.config import FIELDS, option_name, parse_config
from tests.support.data_files import write_cifar10

# Choice flags with an "off" value read as switches: --amp, --channels-last, --deterministic, ...
SWITCH_LIKE = sorted(name for name, f in FIELDS.items() if f.metadata["choices"] and "off" in f.metadata["choices"])


def test_there_are_switch_like_choice_flags() -> None:
    assert {"amp", "channels_last", "deterministic"} <= set(SWITCH_LIKE)


@pytest.mark.parametrize("name", SWITCH_LIKE)
def test_a_switch_like_flag_given_bare_turns_it_on(name: str) -> None:
    bare = getattr(parse_config([option_name(name)]), name)
    assert bare not in ("off", None) and bare in FIELDS[name].metadata["choices"]
    assert getattr(parse_config([option_name(name), "off"]), name) == "off"


def test_bare_forms_read_as_documented() -> None:
    assert parse_config(["--amp"]).amp == "auto"
    assert parse_config(["--channels-last"]).channels_last == "on"
    assert parse_config(["--deterministic"]).deterministic == "on"
    assert parse_config(["--channels-last", "--amp"]).amp == "auto"  # a bare flag before another flag


def test_a_label_out_of_range_names_the_file_that_holds_it(tmp_path: Path) -> None:
    folder = write_cifar10(tmp_path, per_batch=4)
    with open(folder / "data_batch_3", "rb") as handle:
        entry = pickle.load(handle)
    entry["labels"][2] = 12
    with open(folder / "data_batch_3", "wb") as handle:
        pickle.dump(entry, handle)
    with pytest.raises(UsageError) as caught:
        load_cifar10(folder)
    message = str(caught.value)
    assert message.startswith(f"CIFAR-10 file {folder / 'data_batch_3'}: labels range over ")
    assert message.endswith("..12, expected 0..9")
