"""hpcdl.plot: curves from real-looking run directories, and one line for everything it cannot plot."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.runtime.errors import UsageError
from hpcdl.tools.plot import main, read_metrics
from tests.support.mpi_harness import REPO

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


PNG = b"\x89PNG\r\n\x1a\n"


def row(epoch: int, loss: float = 1.0) -> dict:
    return {"epoch": epoch, "global_step": 10 * epoch, "train_loss": loss / epoch, "train_accuracy": 0.5,
            "test_loss": loss / epoch + 0.1, "test_accuracy": 0.4 + 0.1 * epoch, "elapsed_seconds": 3.0 * epoch,
            "run_id": "20261123T110000-node-1-abcdef"}


def make_run(path: Path, lines: list[str] | None = None) -> Path:
    path.mkdir(parents=True)
    text = "\n".join(lines if lines is not None else [json.dumps(row(e)) for e in (1, 2, 3)])
    (path / "metrics.jsonl").write_text(text + "\n")
    return path


def test_two_runs_make_one_figure(tmp_path: Path) -> None:
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    out = tmp_path / "figs" / "curves.png"
    assert main([str(a), str(b), "-o", str(out), "--labels", "sgd", "kfac"]) == 0
    assert out.read_bytes()[:8] == PNG and [p.name for p in out.parent.iterdir()] == ["curves.png"]


def test_default_output_goes_into_the_first_run(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    assert main([str(run)]) == 0
    assert (run / "curves.png").read_bytes()[:8] == PNG


def test_a_diverged_run_with_nan_losses_still_plots(tmp_path: Path) -> None:
    lines = [json.dumps(row(1)), json.dumps(row(2, loss=math.nan)), json.dumps(row(3, loss=math.inf))]
    run = make_run(tmp_path / "run", lines)
    assert main([str(run), "-o", str(tmp_path / "c.svg")]) == 0
    assert b"<svg" in (tmp_path / "c.svg").read_bytes()[:400]


@pytest.mark.parametrize(("lines", "message"), [
    ([], r"metrics.jsonl has no epochs yet; nothing to plot"),
    (["", "  "], r"metrics.jsonl has no epochs yet"),
    ([json.dumps(row(1)), '{"epoch": 2, "train_loss": 0.'],
     r"metrics.jsonl, line 2: not JSON \(Expecting .*, column \d+\)$"),
    ([json.dumps(row(1)), "[1, 2]"], r"line 2: expected an object with epoch, train_loss"),
    ([json.dumps({k: v for k, v in row(1).items() if k != "test_loss"})], r"line 1: missing test_loss"),
    ([json.dumps({**row(1), "test_accuracy": "high"})], r"line 1: test_accuracy='high' is not a number"),
    ([json.dumps({**row(1), "epoch": True})], r"line 1: epoch=True is not a number"),
])
def test_invalid_metrics_are_one_line_naming_the_file(tmp_path: Path, lines: list[str], message: str) -> None:
    run = make_run(tmp_path / "run", lines)
    with pytest.raises(UsageError, match=message) as raised:
        main([str(run), "-o", str(tmp_path / "c.png")])
    assert str(run / "metrics.jsonl") in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "c.png").exists()


def test_missing_and_empty_run_directories(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"run directory .*nowhere does not exist"):
        read_metrics(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=r"empty has no metrics.jsonl \(is it an hpcdl run directory"):
        read_metrics(tmp_path / "empty")
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match=r"file is a file, not a run directory"):
        read_metrics(tmp_path / "file")


def test_an_existing_figure_is_replaced_only_with_force(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    out = tmp_path / "curves.png"
    out.write_bytes(b"an earlier figure")
    with pytest.raises(UsageError, match=r"curves.png already exists; add --force to replace it, or choose another -o"):
        main([str(run), "-o", str(out)])
    assert out.read_bytes() == b"an earlier figure"
    assert main([str(run), "-o", str(out), "--force"]) == 0
    assert out.read_bytes()[:8] == PNG


def test_the_repositorys_committed_figures_are_never_replaced(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    (checkout / "hpcdl").mkdir(parents=True)
    (checkout / "hpcdl" / "__init__.py").write_text("")
    (checkout / "benchmarks" / "results").mkdir(parents=True)
    committed = checkout / "benchmarks" / "results" / "curves.png"
    committed.write_bytes(b"committed")
    run = make_run(tmp_path / "run")
    for extra in ([], ["--force"]):
        with pytest.raises(UsageError, match="is in benchmarks/results, the results committed in the repository"):
            main([str(run), "-o", str(committed), *extra])
    assert committed.read_bytes() == b"committed"


@pytest.mark.parametrize(("args", "message"), [
    (["--labels", "only-one"], r"--labels needs one label per run directory \(2\), got 1"),
    (["-o", "curves.jpeg"], r"the figure's format comes from its suffix; use one of .png, .pdf, .svg"),
    (["--no-such-flag"], r"unrecognized arguments: --no-such-flag \(see --help\)"),
])
def test_bad_flags(tmp_path: Path, args: list[str], message: str) -> None:
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    with pytest.raises(UsageError, match=message):
        main([str(a), str(b), *args])


def test_command_line_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", [json.dumps({"epoch": 1})])
    result = subprocess.run([sys.executable, "-m", "hpcdl.plot", str(run)], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"hpcdl.plot: error: {run / 'metrics.jsonl'}, line 1: missing train_loss, test_loss, test_accuracy, "
        "elapsed_seconds"]


def written_by_a_run(run_dir: Path) -> Path:
    """metrics.jsonl and summary.json written by hpcdl's own writer, with values that were not finite."""
    from hpcdl.persistence.metrics import RunRecord

    record = RunRecord(run_dir, active=True, kept_through=None, run_id="20261123T110000-node-1-abcdef")
    record.log_epoch({k: v for k, v in row(1).items() if k != "run_id"})
    record.log_epoch({**{k: v for k, v in row(2).items() if k != "run_id"}, "train_loss": math.nan,
                      "test_loss": math.inf, "test_accuracy": -math.inf})
    record.log_epoch({k: v for k, v in row(3).items() if k != "run_id"})
    record.write_summary({"best_accuracy": 0.7, "final_accuracy": math.nan, "time_to_target_seconds": None})
    record.close()
    return run_dir


def strict_json(text: str) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_what_a_run_writes_with_non_finite_values_every_reader_accepts(tmp_path: Path) -> None:
    from hpcdl.persistence.metrics import RunRecord

    run = written_by_a_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [strict_json(line)["train_loss"] for line in lines][1] is None  # type: ignore[index]
    assert strict_json((run / "summary.json").read_text())["final_accuracy"] is None  # type: ignore[index]
    rows = read_metrics(run)
    assert len(rows) == 3 and math.isnan(rows[1]["train_loss"]) and rows[2]["train_loss"] == row(3)["train_loss"]
    assert main([str(run), "-o", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG
    resumed = RunRecord(run, active=True, kept_through=30, run_id="20261123T110000-node-1-abcdef")  # --resume reads it
    assert [r["epoch"] for r in resumed.history] == [1, 2, 3]


def test_a_null_epoch_is_still_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", [json.dumps({**row(1), "epoch": None})])
    with pytest.raises(UsageError, match="line 1: epoch=None is not a number"):
        read_metrics(run)


def test_a_run_of_one_row_is_drawn_as_a_point_in_every_panel(tmp_path: Path) -> None:
    """One evaluation (a one-epoch run, or --max-steps before the second) is a line of zero length: without a
    marker the axes come out empty."""
    from matplotlib.colors import to_rgba

    from hpcdl.tools.plot import draw

    fig = draw([("one", [row(1)])])
    for ax in fig.axes:
        fig.canvas.draw()
        shown = [line for line in ax.lines if line.get_marker() not in (None, "", "None", " ")
                 and line.get_markersize() > 0 and to_rgba(line.get_markerfacecolor())[3] > 0]
        assert shown, f"{ax.get_title()}: the single row draws nothing"
        x, y = shown[0].get_xydata()[0]
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        assert x0 <= x <= x1 and y0 <= y <= y1, ax.get_title()


def make_phased_run(path: Path, ranks: int = 2) -> Path:
    from hpcdl.training.phases import PHASES

    path.mkdir(parents=True)
    phases = {name: {"mean_per_rank": [0.01 * (k + 1) + r for r in range(ranks)]}
              for k, name in enumerate([*PHASES, "step"])}
    (path / "summary.json").write_text(json.dumps({"step_phases": {"steps": 5, "phases": phases}}))
    return path


def test_phases_draw_one_bar_per_rank_and_run(tmp_path: Path) -> None:
    from hpcdl.tools.plot import draw_phases, read_phases

    runs = [(name, read_phases(make_phased_run(tmp_path / name))) for name in ("kfac", "muon")]
    fig = draw_phases(runs)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [
        "kfac rank 0", "kfac rank 1", "muon rank 0", "muon rank 1"]
    assert main(["--phases", str(tmp_path / "kfac"), str(tmp_path / "muon")]) == 0
    assert (tmp_path / "kfac" / "phases.png").read_bytes().startswith(PNG)


def test_phases_of_a_run_without_a_summary_is_one_line(tmp_path: Path) -> None:
    make_run(tmp_path / "run")
    with pytest.raises(UsageError, match="has no summary.json"):
        main(["--phases", str(tmp_path / "run")])
    (tmp_path / "run" / "summary.json").write_text("{}")
    with pytest.raises(UsageError, match="has no step_phases"):
        main(["--phases", str(tmp_path / "run")])


def test_a_task_run_plots_its_first_metric_or_its_loss(tmp_path: Path) -> None:
    """--task runs have no accuracy unless the task says so: the second panel shows their first metric."""
    from hpcdl.tools.plot import plot_runs, read_metrics, score_key

    base = {"epoch": 1, "train_loss": 1.0, "test_loss": 0.9, "elapsed_seconds": 2.0}
    segmentation = make_run(tmp_path / "seg", [json.dumps({**base, "test_iou": 0.7, "test_pixel_accuracy": 0.9})])
    language = make_run(tmp_path / "lm", [json.dumps(base)])
    assert score_key(read_metrics(segmentation)[0]) == "test_iou"
    assert score_key(read_metrics(language)[0]) == "test_loss"
    assert plot_runs([segmentation, language], tmp_path / "curves.png").stat().st_size > 0
