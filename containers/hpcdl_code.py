"""Which hpcdl an image's Python runs: the image's own, unless the user asks for a checkout's.

Inside an hpcdl image a job usually starts in the repository it was launched from (the launchers bind it),
and ``python -m`` puts the working folder first on ``sys.path``: the checkout's ``hpcdl`` would shadow the
image's, and after a ``git pull`` an old image would run new code on old dependencies. So the image sets
``PYTHONSAFEPATH=1`` (no working folder on the path) and imports this module at start-up (a ``.pth`` file in
its venv, containers/install.sh), which puts a checkout first only when ``HPCDL_CODE`` asks:

    HPCDL_CODE=image (or unset)   the image's own hpcdl (/opt/hpcdl/src, what the image was built from)
    HPCDL_CODE=checkout           the working folder's hpcdl (the repository the job started in)
    HPCDL_CODE=/path/to/checkout  that checkout's hpcdl

A value naming no checkout (no ``hpcdl/__init__.py`` there) ends the process with one line and exit 2. The
doctor (``python -m hpcdl.doctor``) says which hpcdl runs, from where, and whether its source is the image's.
Standard library only: it runs before any hpcdl is importable.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "HPCDL_CODE"
IMAGE_SOURCE = Path("/opt/hpcdl/src")
# Set by apply(): where the hpcdl that runs was chosen from, for the doctor.
CHOSEN = "HPCDL_CODE_CHOSEN"


class CodeChoiceError(ValueError):
    """HPCDL_CODE names no hpcdl checkout."""


def chosen_checkout(env: dict[str, str] | os._Environ[str], cwd: Path) -> Path | None:
    """The checkout whose hpcdl must run instead of the image's, or None for the image's own."""
    choice = env.get(ENV, "").strip()
    if choice in ("", "image"):
        return None
    folder = cwd if choice == "checkout" else Path(choice)
    if not (folder / "hpcdl" / "__init__.py").is_file():
        raise CodeChoiceError(f"{ENV}={choice} asks for the hpcdl of a checkout, but {folder} holds none (no "
                              f"hpcdl/__init__.py); start the job in the repository, name it ({ENV}=/path/to/repo), "
                              f"or leave {ENV} unset for the image's own hpcdl")
    return folder.resolve()


def apply(env: dict[str, str] | os._Environ[str] = os.environ, path: list[str] = sys.path) -> None:
    """At start-up inside an hpcdl image: the chosen checkout first on ``path``, the choice recorded in ``env``."""
    if env.get("HPCDL_IN_CONTAINER") != "1":
        return
    try:
        checkout = chosen_checkout(env, Path.cwd())
    except CodeChoiceError as exc:
        print(f"hpcdl: error: {exc}", file=sys.stderr, flush=True)
        os._exit(2)  # raising inside a .pth line would only print a warning and run the image's hpcdl
    except OSError:  # the working folder is gone: nothing to choose from
        checkout = None
    if checkout is None:
        env[CHOSEN] = "image"
        return
    path.insert(0, str(checkout))
    env[CHOSEN] = str(checkout)


if __name__ != "__main__":
    apply()
