"""The Python API for your own script under mpirun: ``hpcdl.train.run(make_task, epochs=5, kfac=True, ...)``.

Its stable surface (docs/training.md, "Your own model"): :func:`run`, :func:`main`, and from
:mod:`hpcdl.training.task` the :class:`~hpcdl.training.task.Task` dataclass and
:func:`~hpcdl.training.task.accuracy`. Flags are the command line's, as keywords (``base_lr=0.1`` is
``--base-lr 0.1``, ``kfac=True`` is ``--kfac``, ``kfac=False`` is ``--no-kfac``); they are checked exactly as on
the command line, conflicting ones too.
"""

from __future__ import annotations

import difflib
from typing import Any

from hpcdl.runtime.errors import UsageError, run_main
from hpcdl.training.config import FIELDS, OLD_SWITCH, RENAMED, flag_words, option_name, parse_config
from hpcdl.training.task import Task, TaskSource, load_task, task_label
from hpcdl.training.train import TrainResult, train


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """Keyword flags -> the command line's words (None leaves a flag out). A keyword must be a flag's whole name:
    argparse would take ``epoch=1`` for ``--epochs`` and call ``lr=0.1`` ambiguous."""
    known = {*FIELDS, *RENAMED, OLD_SWITCH} - {"task"}
    unknown = [name for name in flags if name not in known]
    if unknown:
        name = unknown[0]
        if name == "task":
            raise UsageError("run(task, ...) takes the task as its first argument, not as task=")
        # what argparse would have taken it for (the flags it begins, or is a word of), then look-alikes
        close = [f for f in FIELDS if f.startswith(name) or name in f.split("_")][:4] \
            or difflib.get_close_matches(name, list(FIELDS), n=3, cutoff=0.5)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise UsageError(f"hpcdl.train.run: no flag {name}= ({option_name(name)}){hint}; keywords are the command "
                         "line's flags written out in full, with _ for -")
    argv: list[str] = []
    for name, value in flags.items():
        argv += flag_words(name, value)
    return argv


def run(task: TaskSource, /, **flags: Any) -> TrainResult:
    """Train ``task`` (a function returning a Task, or a ``module:function`` path) on every rank of the job. A Task
    object is refused (:func:`~hpcdl.training.task.load_task` says why).

    Call it on every rank. Raises :class:`hpcdl.runtime.errors.JobError` subclasses (one-line messages) for bad
    input; :func:`main` turns them into the command line's one line and exit status.
    """
    if isinstance(task, Task):
        load_task(task)  # raises its one line, before anything starts
    # The task object goes to the job as itself; the configuration records its label (a resume must bring the same).
    config = parse_config(flags_to_argv(flags), task=task if isinstance(task, str) else task_label(task))
    return train(config, None if isinstance(task, str) else task)


def main(task: TaskSource, /, **flags: Any) -> None:
    """:func:`run` as a program: exits 0 when the run finished, else with the command line's status and line."""
    run_main(lambda: run(task, **flags).exit_code, program="hpcdl.train", whole_program=True)
