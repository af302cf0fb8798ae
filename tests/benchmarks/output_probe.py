"""Runs result-writing programs up to the point where they decide where their results go, and stops them there.

``python output_probe.py CASES.json REPORT.json``: CASES is a list of ``{"program": ..., "argv": [...]}``
(a path to a script, or ``-m module``). For each case a forked child patches
:mod:`hpcdl.persistence.outputs`' deciding functions with a probe, runs the program as ``__main__`` in a
scratch working directory and ends at the first decision (``os._exit``), before any measurement.
REPORT gets, per case, what the program asked the one rule for (or that it never asked, and how it
ended). Forking from one parent that has imported torch, torchvision, matplotlib and the training stack once
keeps the whole probe to seconds. The programs reach the rule as ``outputs.<function>``, so the patch made in
the child holds even for modules the parent imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import matplotlib.pyplot  # noqa: F401 - these heavy libraries are imported once here, so that every forked
import torch  # noqa: F401 - child starts with them (torchvision alone takes seconds); none of them starts MPI
import torchvision  # noqa: F401

import hpcdl.training.job  # noqa: F401 - the training stack most programs import (it asks nothing of the rule)
from hpcdl.persistence import outputs


def probe(case: dict[str, Any], report: Path) -> None:
    """In the child: patch the rule's entry points, run the program, write what it asked (never returns)."""

    def decided(kind: str, requested: Any, name: str, refresh_results: bool) -> None:
        row = {**case, "decided": kind, "requested": None if requested is None else str(requested), "name": name,
               "refresh_results": refresh_results}
        report.write_text(json.dumps(row))
        os._exit(0)

    def stem(requested: Any, name: str, suffixes: Any, *, refresh_results: bool = False, **_: Any) -> Path:
        decided("results_stem", requested, name, refresh_results)
        raise AssertionError("unreachable")

    def folder(requested: Any, name: str, *, refresh_results: bool = False, **_: Any) -> Path:
        decided("results_folder", requested, name, refresh_results)
        raise AssertionError("unreachable")

    os.setpgid(0, 0)  # its own process group: whatever a program that went on to measure started ends with it
    signal.alarm(60)  # a program that never asks the rule would go on to measure: the default action ends it
    outputs.results_stem = stem  # type: ignore[assignment]
    outputs.results_folder = folder  # type: ignore[assignment]
    outputs.require_launcher = lambda *_, **__: None  # type: ignore[assignment]  # one process stands for a job
    os.chdir(tempfile.mkdtemp(prefix="output-probe-"))
    program, argv = case["program"], list(case["argv"])
    ending = "returned"
    try:
        if program.startswith("-m "):
            sys.argv = [program[3:], *argv]
            runpy.run_module(program[3:], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [program, *argv]
            sys.path.insert(0, str(Path(program).parent))
            runpy.run_path(program, run_name="__main__")
    except SystemExit as exc:
        ending = f"exit {exc.code}"
    except BaseException:  # noqa: BLE001 - reported to the test, which shows it
        ending = traceback.format_exc()[-1500:]
    report.write_text(json.dumps({**case, "decided": None, "ending": ending}))
    os._exit(0)


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    rows = []
    for number, case in enumerate(cases):
        report = Path(sys.argv[2]).with_suffix(f".{number}")
        pid = os.fork()
        if pid == 0:
            probe(case, report)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # runs it started before it was stopped (none when it asked in time)
        rows.append(json.loads(report.read_text()) if report.exists()
                    else {**case, "decided": None, "ending": f"no report (wait status {status})"})
    Path(sys.argv[2]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
