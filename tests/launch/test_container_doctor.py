"""The doctor's container rows: which image, which MPI inside and outside, and whether they talk.

Pure functions on an environment and the image's files, so every launcher's case is checked here;
tests/cluster/test_container_runs.py sees the rows printed by a real run in the image.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdl.tools import doctor


def image_files(tmp_path: Path, family: str = "openmpi") -> tuple[Path, Path]:
    image = tmp_path / "image"
    image.write_text("hpcdl-cpu environment=abc source=def built=2026-01-01T00:00:00Z\n")
    labels = tmp_path / "labels"
    labels.write_text(f"hpcdl.mpi.family {family}\nhpcdl.mpi.version mpirun (Open MPI) 4.1.4\n")
    return image, labels


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"OMPI_COMM_WORLD_SIZE": "4", "HPCDL_HOST_MPI": "mpirun (Open MPI) 4.1.4"},
         "Open MPI mpirun (mpirun (Open MPI) 4.1.4)"),
        ({"PMIX_RANK": "0", "SLURM_STEP_ID": "0"}, "Slurm srun --mpi=pmix"),
        ({"PMI_RANK": "1", "PMI_SIZE": "4"}, "MPICH-family"),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}, "--mpi=pmix missing?"),
        ({}, "none (one process)"),
    ],
)
def test_the_launcher_outside_is_named_by_its_variables(env: dict[str, str], expected: str) -> None:
    assert expected in doctor.launcher_outside(env)


def test_rows_inside_an_image_that_talks_to_its_launcher(tmp_path: Path) -> None:
    image, labels = image_files(tmp_path)
    env = {"HPCDL_IN_CONTAINER": "1", "OMPI_COMM_WORLD_SIZE": "4"}
    rows = {r.name: r.value for r in doctor.container_rows(env, "Open MPI v4.1.4", 4, image, labels)}
    assert rows["image"].startswith("hpcdl-cpu environment=abc")
    assert rows["MPI inside"] == "openmpi: Open MPI v4.1.4"
    assert rows["inside and outside talk"].startswith("yes: MPI sees the 4 rank")


def test_rows_when_every_rank_runs_alone(tmp_path: Path) -> None:
    image, labels = image_files(tmp_path)
    env = {"HPCDL_IN_CONTAINER": "1", "PMI_SIZE": "4", "PMI_RANK": "2"}
    rows = {r.name: r.value for r in doctor.container_rows(env, "Open MPI v4.1.4", 1, image, labels)}
    assert rows["inside and outside talk"] == "NO: the launcher started 4, MPI sees 1"
    assert "MPICH-family" in rows["launcher outside"]


def test_no_rows_on_the_host(tmp_path: Path) -> None:
    image, labels = image_files(tmp_path)
    assert doctor.container_rows({"OMPI_COMM_WORLD_SIZE": "2"}, "Open MPI", 2, image, labels) == []


def test_the_mismatch_names_both_families_inside_an_image(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _, labels = image_files(tmp_path)
    monkeypatch.setattr(doctor, "LABELS_FILE", labels)
    monkeypatch.setattr(doctor.image_labels, "__defaults__", (labels,))
    with pytest.raises(doctor.Problem, match=r"every rank runs alone; the image's MPI is openmpi, the launcher is "
                                             r"MPICH-family"):
        doctor.check_launcher_agrees(1, {"HPCDL_IN_CONTAINER": "1", "PMI_SIZE": "4"})
