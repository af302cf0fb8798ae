"""The study tools answer wrong input in one line, exit 2 (issue 38, kind 7: the study-tool parts).

A --tune file tuned on a seed other than 0, K-FAC traffic's phases given the wrong file or run without a
launcher: each used to end in a traceback or a misleading answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAFFIC = str(REPO / "benchmarks" / "kfac_traffic.py")


def tune_file(path: Path, seed: int) -> Path:
    """A --tune results file: sgd at two rates on ``seed`` (0.07 the better), then the chosen one on seed 9."""
    def run(lr: float, run_seed: int, accuracy: float) -> dict[str, Any]:
        return dict(method="sgd", batch=4096, lr=lr, seed=run_seed, warmup=0.5, returncode=0, wall_seconds=1.0,
                    error="", command="", epochs=[dict(test_accuracy=accuracy, global_step=10, train_seconds=1.0)])

    runs = [run(0.05, seed, 0.97), run(0.07, seed, 0.98), run(0.07, 9, 0.981)]
    path.write_text(json.dumps(dict(meta={}, summary=[], runs=runs)))
    return path


def test_a_tuned_from_file_whose_tuning_seed_is_not_0_gives_its_tuned_rate(study: Any, tmp_path: Path,
                                                                         capsys) -> None:
    source = tune_file(tmp_path / "tune.json", seed=3)
    assert study.main(["--target-cell", "--tuned-from", str(source), "--methods", "sgd", "--seeds", "0",
                       "--dataset", "digits", "--dry-run"]) == 0
    (command,) = capsys.readouterr().out.strip().splitlines()
    assert f"--base-lr {0.07 / 1:.2f}" in command and "--warmup-epochs 0.5" in command, command


def test_a_tuned_from_file_that_tuned_nothing_is_one_line(study: Any, tmp_path: Path) -> None:
    source = tmp_path / "plain.json"
    source.write_text(json.dumps(dict(meta={}, runs=json.loads(tune_file(tmp_path / "t.json", 3).read_text())
                                      ["runs"][1:2])))
    with pytest.raises(study.UsageError, match="is not the results of a --tune study"):
        study.main(["--target-cell", "--tuned-from", str(source), "--methods", "sgd", "--dataset", "digits",
                    "--dry-run"])


def one_line_usage_error(done: subprocess.CompletedProcess[str], *fragments: str) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr + done.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.processes
def test_traffic_predict_given_another_phase_s_file_is_one_line(tmp_path: Path) -> None:
    wrong = tmp_path / "count.json"
    wrong.write_text(json.dumps({"kind": "count", "runs": []}))
    done = subprocess.run([sys.executable, TRAFFIC, "predict", "--measured", str(wrong), "--out", str(tmp_path / "p")],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=300)
    one_line_usage_error(done, f"--measured {wrong} is not the results of the measure phase")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.processes
def test_traffic_measure_run_alone_is_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))}
    done = subprocess.run([sys.executable, TRAFFIC, "measure", "--out", str(tmp_path / "m")], cwd=tmp_path,
                          env=dict(env, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    one_line_usage_error(done, "started as one process", "launch/mpirun.sh")
    assert not (tmp_path / "m.json").exists()


@pytest.mark.processes
def test_traffic_count_on_a_virtual_cluster_that_does_not_exist_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, TRAFFIC, "count", "--vcluster", "nosuch", "--data-dir", str(tmp_path),
                           "--out", str(tmp_path / "c")], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)
    one_line_usage_error(done, "nosuch")
