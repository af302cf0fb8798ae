"""benchmarks/kfac_large_batch.py's own arguments: zero, negative, NaN, unparsable values and missing files are
one line naming the argument, before any run starts (not a traceback hours into the grid)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpcdl.runtime.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "kfac_large_batch.py"
RESULTS = "benchmarks/results/kfac_large_batch_target.json"
DIGITS = ["--dataset", "digits", "--methods", "sgd", "--dry-run"]


BAD = {
    "zero epochs": (["--epochs", "0"], "argument --epochs: must be an integer >= 1 (got 0)"),
    "negative jobs": (["--jobs", "-1"], "argument --jobs: must be an integer >= 1 (got -1)"),
    "zero batch": (["--batches", "0"], "argument --batches: must be an integer >= 1 (got 0)"),
    "zero micro-batch": (["--micro-batch", "0"], "argument --micro-batch: must be an integer >= 1 (got 0)"),
    "NaN damping": (["--damping", "nan"], "argument --damping: must be a finite number > 0 (got nan)"),
    "negative warm-up": (["--warmup-epochs", "-1"], "argument --warmup-epochs: must be a finite number >= 0"),
    "unparsable timeout": (["--run-timeout", "soon"], "argument --run-timeout: not a number: 'soon'"),
    "infinite kl clip": (["--kl-clip", "inf"], "argument --kl-clip: must be a finite number > 0 (got inf)"),
    "seed out of range": (["--seeds", str(2**63)],
                          f"argument --seeds: must be an integer in [0, 2**63 - 1] (got {2**63})"),
    "NaN rate": (["--target-cell", "--lrs", "kfac=nan"], "--lrs kfac=nan: must be a finite number > 0 (got nan)"),
    "unparsable rate": (["--target-cell", "--lrs", "sgd=fast"], "--lrs sgd=fast: not a number: 'fast'"),
    "zero rate": (["--target-cell", "--lrs", "sgd=0"], "--lrs sgd=0: must be a finite number > 0 (got 0)"),
    "missing rates file": (["--target-cell", "--rates-from", "no/such.json"], "--rates-from no/such.json: No such"),
    "missing tuning file": (["--target-cell", "--tuned-from", "no/such.json"], "--tuned-from no/such.json: No such"),
    "missing report": (["--report", "no/such.json"], "--report no/such.json: No such file"),
    "report of another file": (["--report", "pyproject.toml"], "--report pyproject.toml is not a results file"),
    "report batches": (["--report", f"{RESULTS}@big"], "FILE@BATCHES takes global batches such as FILE@128,512"),
    "bad kfac flags": (["--kfac-flags", "--momentum 2"], "--kfac-flags '--momentum 2': --momentum must be"),
    "unbalanced kfac flags": (["--kfac-flags", "--momentum '0.5"], "--kfac-flags \"--momentum '0.5\": "),
    "keep without out": (["--keep"], "--keep adds to the results at --out"),
}


@pytest.mark.parametrize("row", BAD)
def test_a_bad_argument_is_one_line_naming_it(study: Any, row: str, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    argv, message = BAD[row]
    with pytest.raises(UsageError) as raised:
        study.parse_args([*DIGITS, *argv])
    text = str(raised.value)
    assert message in text and "\n" not in text, text


def test_good_arguments_still_parse(study: Any, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    args = study.parse_args([*DIGITS, "--target-cell", "--lrs", "sgd=0.05", "--seeds", str(2**63 - 1),
                             "--rates-from", RESULTS, "--kfac-flags", "--momentum 0.9"])
    assert study.target_rates(args)["sgd"] == 0.05


@pytest.mark.processes
def test_the_command_line_prints_one_line_and_no_traceback(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), *DIGITS, "--epochs", "nan"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == ["kfac_large_batch: error: argument --epochs: not an integer: 'nan' "
                                        "(see --help)"], done.stderr
