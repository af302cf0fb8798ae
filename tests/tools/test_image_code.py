"""Inside an image the hpcdl that runs is a decision (issue 38, kind 6): the image's own by default, a checkout's
when HPCDL_CODE asks (containers/hpcdl_code.py); the doctor says which, from where, and whether its source is the
image's. The decision and the doctor's rows are tested here on the host; the last test runs in the image."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hpcdl.tools import doctor
from tests.support.container import clean_env, hpcdl_image  # noqa: F401 - the session fixture

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def code() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hpcdl_code_under_test", REPO / "containers" / "hpcdl_code.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # on the host HPCDL_IN_CONTAINER is unset: importing it changes nothing
    return module


def checkout(where: Path) -> Path:
    (where / "hpcdl").mkdir(parents=True)
    (where / "hpcdl" / "__init__.py").write_text("")
    return where


def test_the_image_s_own_hpcdl_unless_a_checkout_is_asked_for(code: ModuleType, tmp_path: Path) -> None:
    repo = checkout(tmp_path / "repo")
    assert code.chosen_checkout({}, repo) is None  # started in a checkout: still the image's own
    assert code.chosen_checkout({"HPCDL_CODE": "image"}, repo) is None
    assert code.chosen_checkout({"HPCDL_CODE": "checkout"}, repo) == repo.resolve()
    assert code.chosen_checkout({"HPCDL_CODE": str(repo)}, tmp_path) == repo.resolve()
    with pytest.raises(code.CodeChoiceError, match=r"HPCDL_CODE=checkout asks .* holds none \(no hpcdl/__init__.py\)"):
        code.chosen_checkout({"HPCDL_CODE": "checkout"}, tmp_path)


def test_apply_puts_only_an_asked_for_checkout_first_and_records_the_choice(code: ModuleType, tmp_path: Path,
                                                                           monkeypatch) -> None:
    repo = checkout(tmp_path / "repo")
    monkeypatch.chdir(repo)
    path, env = ["/opt/hpcdl/src"], {"HPCDL_IN_CONTAINER": "1"}
    code.apply(env, path)
    assert path == ["/opt/hpcdl/src"] and env[code.CHOSEN] == "image"
    env = {"HPCDL_IN_CONTAINER": "1", "HPCDL_CODE": "checkout"}
    code.apply(env, path)
    assert path[0] == str(repo.resolve()) and env[code.CHOSEN] == str(repo.resolve())
    host: list[str] = []
    code.apply({"HPCDL_CODE": "checkout"}, host)  # outside an image it does nothing
    assert host == []


@pytest.mark.processes  # runs python / build.sh
def test_a_bad_choice_ends_python_in_one_line_before_any_hpcdl_runs(tmp_path: Path) -> None:
    """What the image's .pth does at start-up, imitated on the host with the same module."""
    env = dict(os.environ, HPCDL_IN_CONTAINER="1", HPCDL_CODE=str(tmp_path / "nowhere"),
               PYTHONPATH=str(REPO / "containers"))
    done = subprocess.run([sys.executable, "-c", "import hpcdl_code; print('ran')"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "ran" not in done.stdout
    assert done.stderr.strip().startswith("hpcdl: error: HPCDL_CODE=") and done.stderr.strip().count("\n") == 0


@pytest.mark.processes  # runs python / build.sh
def test_the_source_key_is_build_sh_s(tmp_path: Path) -> None:
    """Against containers/build.sh's own list (SOURCES) and pipeline (find | sort | sha256sum), on a copy of the
    repository's source made as the build makes the image's: the doctor reads the list off that copy."""
    (line,) = [x for x in (REPO / "containers" / "build.sh").read_text().splitlines() if x.startswith("SOURCES=(")]
    sources = line.removeprefix("SOURCES=(").removesuffix(")").split()
    for name in sources:
        source = REPO / name
        (shutil.copy2 if source.is_file() else shutil.copytree)(source, tmp_path / name)
    (tmp_path / "hpcdl" / "__pycache__").mkdir(exist_ok=True)
    (tmp_path / "hpcdl" / "__pycache__" / "x.pyc").write_bytes(b"left out")
    assert doctor.image_folders(tmp_path) == sorted(sources)
    pipeline = (f"cd {tmp_path} && find {' '.join(sources)} -type f ! -path '*/__pycache__/*' "
                "! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-8")
    expected = subprocess.run(["bash", "-c", pipeline], capture_output=True, text=True, check=True).stdout.strip()
    assert doctor.source_key(tmp_path, doctor.image_folders(tmp_path)) == expected
    (tmp_path / "hpcdl" / "train.py").write_text("# changed by a git pull\n")
    assert doctor.source_key(tmp_path, doctor.image_folders(tmp_path)) != expected


def test_the_doctor_says_which_hpcdl_runs_and_whether_it_is_the_image_s(tmp_path: Path) -> None:
    image = tmp_path / "image"
    mine = tmp_path / "repo"
    for folder in (image, mine):
        (folder / "hpcdl").mkdir(parents=True)
        (folder / "hpcdl" / "__init__.py").write_text("version = 1\n")
    own = doctor.code_rows({"HPCDL_CODE_CHOSEN": "image"}, image, image)
    assert [(r.name, r.value) for r in own] == [("hpcdl runs from", f"{image} (the image's own (default))")]

    asked = doctor.code_rows({"HPCDL_CODE_CHOSEN": str(mine), "HPCDL_CODE": "checkout"}, mine, image)
    assert "asked for by HPCDL_CODE=checkout" in asked[0].value
    assert asked[1].value == f"the image's (key {doctor.source_key(image, ['hpcdl'])})"

    (mine / "hpcdl" / "__init__.py").write_text("version = 2\n")  # a git pull since the image was built
    shadowed = doctor.code_rows({"HPCDL_CODE_CHOSEN": "image"}, mine, image)
    assert "NOT asked for" in shadowed[0].value
    assert shadowed[1].value.startswith("DIFFERS from the image's") and "make image" in shadowed[1].value


@pytest.mark.processes
def test_in_the_image_a_checkout_shadows_nothing_unless_asked(hpcdl_image: Path, tmp_path: Path) -> None:  # noqa: F811
    """Started in a folder whose ``hpcdl`` would break any run, the image still runs its own; HPCDL_CODE=checkout
    runs the folder's. Skips where no image can be built here (tests/support/container.py says why)."""
    poisoned = checkout(tmp_path / "repo")
    (poisoned / "hpcdl" / "__init__.py").write_text("raise SystemExit('the checkout ran')\n")
    command = ["ch-run", "--set-env", str(hpcdl_image), "-b", f"{tmp_path}:/mnt/0", "-c", "/mnt/0/repo", "--",
               "python", "-c", "import hpcdl; print(hpcdl.__file__)"]
    own = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert own.returncode == 0 and own.stdout.strip() == "/opt/hpcdl/src/hpcdl/__init__.py", own.stderr[-2000:]
    asked = subprocess.run(command, env=clean_env(HPCDL_CODE="checkout"), capture_output=True, text=True,
                           timeout=300)
    assert asked.returncode != 0 and "the checkout ran" in asked.stderr, asked.stderr[-2000:]
