"""``python -m hpcdl.train``: the entry point; the program lives in :mod:`hpcdl.training.train`.

From your own script: ``hpcdl.train.run(task, **flags)`` and ``hpcdl.train.main(task, **flags)``
(:mod:`hpcdl.training.api`, docs/training.md "Your own model").
"""

from hpcdl.training.api import main, run
from hpcdl.training.task import Task, accuracy
from hpcdl.training.train import main_cli

__all__ = ["Task", "accuracy", "main", "run"]

if __name__ == "__main__":
    main_cli()
