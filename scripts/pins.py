"""hpcdl's pinned requirements, read from pyproject.toml, for scripts/setup.sh and scripts/wheelhouse.sh.

    python scripts/pins.py all                 # every pin (dependencies + test extra), one per line
    python scripts/pins.py missing             # the pins whose package is not installed at all
    python scripts/pins.py missing --group test   # the same, for the test extra only (deps: the rest)

`missing` is how setup.sh installs hpcdl next to an existing torch (a site module, a conda env,
an NGC container): a package that is already there, at any version, is left alone, because
replacing a site's numpy or torch under its other packages is worse than a version off the pin.
torch, torchvision, horovod and mpi4py are never listed: setup.sh handles each itself.
Standard library only (tomllib, or a small reader on Python 3.10).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
HANDLED_BY_SETUP = {"torch", "torchvision", "horovod", "mpi4py"}


def _lists_without_tomllib(text: str) -> dict[str, list[str]]:
    """`dependencies = [...]` and `test = [...]` arrays, for Python 3.10 (no tomllib)."""
    found = {}
    for name in ("dependencies", "test"):
        match = re.search(rf"(?ms)^{name}\s*=\s*\[(.*?)\]", text)
        found[name] = re.findall(r'"([^"]+)"', match.group(1)) if match else []
    return found


def pinned(pyproject: Path = PYPROJECT, group: str = "all") -> list[str]:
    """Dependencies ("deps"), the test extra ("test") or both ("all"), in file order, without duplicates."""
    text = pyproject.read_text()
    try:
        import tomllib

        data = tomllib.loads(text)
        deps, test = data["project"]["dependencies"], data["project"].get("optional-dependencies", {}).get("test", [])
    except ImportError:  # Python 3.10
        parsed = _lists_without_tomllib(text)
        deps, test = parsed["dependencies"], parsed["test"]
    lists = {"deps": [deps], "test": [test], "all": [deps, test]}[group]
    seen, out = set(), []
    for requirement in (r for group in lists for r in group):
        if requirement not in seen:
            seen.add(requirement)
            out.append(requirement)
    return out


def name_of(requirement: str) -> str:
    """The normalised distribution name of 'Name[extra]==1.0; marker'."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0]).lower()


def installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def missing(requirements: Iterable[str], is_installed: Callable[[str], bool] = installed) -> list[str]:
    """The requirements whose package is absent (any installed version counts as present)."""
    return [r for r in requirements if name_of(r) not in HANDLED_BY_SETUP and not is_installed(name_of(r))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=("all", "missing"))
    parser.add_argument("--group", choices=("all", "deps", "test"), default="all")
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT)
    args = parser.parse_args(argv)
    requirements = pinned(args.pyproject, args.group)
    if args.which == "all":
        chosen = [r for r in requirements if name_of(r) not in HANDLED_BY_SETUP]
    else:
        chosen = missing(requirements)
    print("\n".join(chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
