"""The task interface in one process: what --task loads, what it refuses (one line each), the flags it conflicts
with, the Python API's flags, and the scoring of a task's loss and metrics against a direct computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hpcdl.runtime.errors import UsageError
from hpcdl.training.api import flags_to_argv
from hpcdl.training.config import parse_config
from hpcdl.training.models import build_model
from hpcdl.training.scoring import Scoring, TaskScoring
from hpcdl.training.task import Task, check_first_batch, load_task, task_label
from tests.support import tasks

CPU = torch.device("cpu")
SUPPORT = "tests.support.tasks"


def refused(call, *fragments: str) -> str:
    with pytest.raises(UsageError) as raised:
        call()
    message = str(raised.value)
    assert "\n" not in message and "Traceback" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


LOAD_ROWS = {
    "module does not import": ("no_such_package.tasks:task", ["cannot import no_such_package.tasks",
                                                              "ModuleNotFoundError"]),
    "no colon": (f"{SUPPORT}.digits_task", ["--task takes package.module:function"]),
    "no such function": (f"{SUPPORT}:nothing", ["tests.support.tasks has no 'nothing'"]),
    "not a function": (f"{SUPPORT}:NOT_A_FUNCTION", ["NOT_A_FUNCTION is a int, not a function"]),
    "returns the wrong kind": (f"{SUPPORT}:returns_a_model", ["returned a Linear, not an hpcdl.training.task.Task"]),
    "raises": (f"{SUPPORT}:raises", ["raised ValueError: no data here"]),
    "iterable dataset": (f"{SUPPORT}:iterable_data", ["Task.train_data is an IterableDataset"]),
}


@pytest.mark.parametrize("row", LOAD_ROWS)
def test_a_bad_task_path_or_function_is_one_line(row: str) -> None:
    spec, fragments = LOAD_ROWS[row]
    message = refused(lambda: load_task(spec), *fragments)
    assert "second line" not in message


FIRST_BATCH_ROWS = {
    "shapes the model cannot take": ("wrong_shapes", ["the task's model cannot take a first batch of inputs (2, 3) "
                                                      "float32, targets (2, 1) float32", "RuntimeError"]),
    "loss not a scalar": ("loss_not_scalar", ["the task's loss returns (2, 1) float32", "outputs (2, 1) float32"]),
    "metric not a number": ("metric_not_a_number", ["metric 'errors' returns (2, 1) float32", "not a number"]),
    "items that cannot be batched": ("ragged_data", ["train_data items cannot be batched",
                                                     "items of different shapes need Task.collate"]),
    "dict items": ("dict_items", ["train_data items are dicts (keys x, y)", "give Task.collate"]),
    "evaluation data the model cannot take": ("eval_data_mismatch", ["cannot take an evaluation batch of inputs "
                                                                     "(2, 3) float32"]),
    "a parameter the loss never reaches": ("unused_parameter", ["does not depend on the parameter(s) unused.weight, "
                                                                "unused.bias", "requires_grad_(False)"]),
}


@pytest.mark.parametrize("row", FIRST_BATCH_ROWS)
def test_a_first_batch_that_does_not_fit_is_one_line_naming_the_shapes(row: str) -> None:
    name, fragments = FIRST_BATCH_ROWS[row]
    task = load_task(f"{SUPPORT}:{name}")
    refused(lambda: check_first_batch(task, task.model, CPU), *fragments)


def test_a_good_task_passes_every_check_and_keeps_its_model_in_training_mode() -> None:
    task = load_task(f"{SUPPORT}:digits_task")
    check_first_batch(task, task.model, CPU)
    assert task.model.training


@pytest.mark.parametrize("name", ["dict_items_collated", "padded_sequences", "unused_parameter_frozen",
                                  "numpy_metric", "lazy_model"])
def test_what_users_bring_passes_the_first_batch_check(name: str) -> None:
    """Dict items with Task.collate, sequences padded by it, a frozen parameter, a numpy metric, a lazy layer
    (whose parameters the check materialises, so that they exist before they are broadcast)."""
    task = load_task(f"{SUPPORT}:{name}")
    check_first_batch(task, task.model, CPU)
    assert not any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in task.model.parameters())


def test_the_unused_parameter_check_changes_neither_buffers_nor_random_state() -> None:
    task = load_task(f"{SUPPORT}:digits_task")
    buffers = {k: v.clone() for k, v in task.model.state_dict().items()}
    torch.manual_seed(7)
    check_first_batch(task, task.model, CPU)
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))
    assert all(torch.equal(buffers[k], v) for k, v in task.model.state_dict().items())


def test_best_must_name_the_loss_or_a_metric_and_goal_a_direction() -> None:
    task = tasks.tiny_regression()
    task.best = "r2"
    refused(lambda: load_task(lambda: task), "Task.best 'r2' is neither 'loss' nor one of its metrics")
    task.best, task.goal = "loss", "lowest"
    refused(lambda: load_task(lambda: task), "Task.goal must be 'min' or 'max'")


def test_a_metric_as_best_needs_its_goal_and_the_loss_alone_goes_down() -> None:
    """best="accuracy" with no goal kept the worst evaluation as best.pt (the default was min)."""
    refused(lambda: load_task(f"{SUPPORT}:best_metric_without_goal"),
            "Task.best 'accuracy' names a metric: say which way it improves, goal='max'")
    assert load_task(f"{SUPPORT}:tiny_regression").goal == "min"


def test_a_metric_named_like_the_records_own_loss_is_refused() -> None:
    refused(lambda: load_task(f"{SUPPORT}:metric_named_loss"), "a metric may not be named 'loss'",
            "test_loss is the task's own loss")


def test_a_task_object_is_refused_for_the_function_that_builds_it() -> None:
    """Its model was built before --seed: a second run would continue the first one's weights."""
    refused(lambda: load_task(tasks.tiny_regression()), "takes the function that returns the Task",
            "before --seed was set")


def test_a_file_path_for_task_says_to_write_the_module_name() -> None:
    refused(lambda: load_task("examples/segmentation.py:task"), "not a file's: write examples.segmentation:task")


def test_one_line_keeps_the_detail_after_a_colon() -> None:
    """torch's load_state_dict message is a header line ending in a colon, the mismatch on the next."""
    from hpcdl.training.task import one_line

    model = torch.nn.Linear(4, 2)
    with pytest.raises(RuntimeError) as raised:
        model.load_state_dict(torch.nn.Linear(3, 2).state_dict())
    line = one_line(raised.value)
    assert line.startswith("Error(s) in loading state_dict for Linear:") and "size mismatch for weight" in line
    assert "\n" not in line and one_line(ValueError("first\nsecond")) == "first"


@pytest.mark.parametrize("flags, clash", [
    (["--dataset", "mnist"], "--dataset"),
    (["--model", "resnet20", "--data-dir", "/data"], "--data-dir, --model"),
    (["--target-accuracy", "0.9"], "--target-accuracy"),
])
def test_task_with_a_flag_it_conflicts_with_is_one_line(flags: list[str], clash: str) -> None:
    refused(lambda: parse_config(["--task", f"{SUPPORT}:digits_task", *flags]),
            f"--task brings its own model, data and loss: leave out {clash}")


def test_target_metric_needs_a_task_and_compile_is_refused_with_one() -> None:
    refused(lambda: parse_config(["--target-metric", "0.5"]), "--target-metric needs --task")
    refused(lambda: parse_config(["--task", f"{SUPPORT}:digits_task", "--compile"]), "--compile cannot be combined")
    config = parse_config(["--task", f"{SUPPORT}:digits_task", "--target-metric", "0.5", "--kfac"])
    assert config.task == f"{SUPPORT}:digits_task" and config.target_metric == 0.5 and config.kfac


@pytest.mark.parametrize(("flags", "fragment"), [
    (dict(lr=0.1), "no flag lr= (--lr) (did you mean"),  # argparse: "ambiguous option"
    (dict(epoch=1), "no flag epoch= (--epoch) (did you mean epochs"),  # argparse: silently --epochs
    (dict(task="x:y"), "takes the task as its first argument"),
])
def test_python_api_takes_whole_flag_names_only(flags: dict, fragment: str) -> None:
    refused(lambda: flags_to_argv(flags), fragment)
    assert flags_to_argv(dict(kfac_cov_update_freq=2)) == ["--kfac-cov-update-freq", "2"]  # a renamed flag still


def test_python_api_flags_are_the_command_lines() -> None:
    argv = flags_to_argv(dict(epochs=3, base_lr=0.1, kfac=True, progress=False, lr_decay=[2, 3], max_steps=None))
    assert argv == ["--epochs", "3", "--base-lr", "0.1", "--kfac", "--no-progress", "--lr-decay", "2", "3"]
    assert task_label(tasks.digits_task) == "tests.support.tasks:digits_task"


def test_custom_model_flag_builds_the_users_model_and_refuses_what_is_not_one() -> None:
    torch.manual_seed(3)
    mine = build_model(f"{SUPPORT}:digits_model", 10, 1)
    torch.manual_seed(3)
    builtin = build_model("digits_cnn", 10, 1)
    pairs = zip(mine.state_dict().values(), builtin.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    refused(lambda: build_model(f"{SUPPORT}:raises", 10, 1), "--model tests.support.tasks:raises raised TypeError")
    refused(lambda: build_model(f"{SUPPORT}:tiny_regression", 10, 1), "returned a Task, not a torch.nn.Module")


def one_rank_comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


def test_task_scoring_is_the_example_weighted_mean_of_a_direct_computation() -> None:
    """Batches of unequal size: each metric's reported value is its mean over all examples, computed directly."""
    torch.manual_seed(0)
    outputs, targets = torch.randn(10, 3), torch.randint(0, 3, (10,))
    batches = [(outputs[:7], targets[:7]), (outputs[7:], targets[7:])]
    task = Task(model=torch.nn.Identity(), train_data=TensorDataset(outputs), eval_data=TensorDataset(outputs),
                loss=F.cross_entropy, metrics={"hit": lambda o, t: (o.argmax(1) == t).float().mean(),
                                               "count": lambda o, t: 1}, best="hit", goal="max")
    test = TaskScoring(task).evaluate(batches, lambda x: x, CPU, one_rank_comm(), lambda **_: None)
    assert test["test_loss"] == pytest.approx(F.cross_entropy(outputs, targets).item(), rel=1e-6)
    assert test["test_hit"] == pytest.approx((outputs.argmax(1) == targets).float().mean().item())
    assert test["test_count"] == 1.0
    builtin = Scoring().evaluate(batches, lambda x: x, CPU, one_rank_comm(), lambda **_: None)
    assert builtin["test_loss"] == pytest.approx(test["test_loss"], rel=1e-6)
    assert builtin["test_accuracy"] == pytest.approx(test["test_hit"])
    scoring = TaskScoring(task)
    assert scoring.best_key == "test_hit" and scoring.improved(0.5, 0.4) and not scoring.improved(0.3, 0.4)
    task.best, task.goal = "loss", "min"
    assert TaskScoring(task).improved(0.3, 0.4) and not TaskScoring(task).train_accuracy


def test_the_documented_commands_are_the_tests_commands() -> None:
    """docs/training.md's "Your own model" prints the examples' commands exactly as tests/training/test_task_jobs.py
    runs them (the test adds --no-progress and its own --output-dir)."""
    from pathlib import Path

    from tests.training.test_task_jobs import LM, SEGMENTATION

    text = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    section = text[text.index("## Your own model"):text.index("## Figures on a GPU")]
    for flags in (LM, SEGMENTATION):
        assert f"mpirun -np 2 .venv/bin/python -m hpcdl.train {' '.join(flags)} --output-dir runs/" in section, flags


def test_kfac_skip_names_must_match_a_module() -> None:
    """A name that matches nothing skipped nothing, silently; names, names a module is inside of, and class names
    (any case) match as K-FAC matches them."""
    from hpcdl.training.job import check_skip_names

    model = build_model("digits_cnn", 10, 1)
    names = [name for name, _ in model.named_modules() if name]
    check_skip_names(model, [names[0], "conv2d", type(model).__name__.upper()])
    refused(lambda: check_skip_names(model, [names[0], "fc9"]), "--kfac-skip-layers fc9: no module of the model")


def test_task_parameter_groups_and_options_reach_the_optimizer_and_must_cover_every_parameter() -> None:
    from examples.own_model import task as own_task
    from hpcdl.training.task import task_optimizer

    task = own_task()
    rule = torch.optim.AdamW(task.model.parameters(), lr=0.01, weight_decay=0.3)
    built = task_optimizer(rule, task, task.model)
    assert [g["weight_decay"] for g in built.param_groups] == [0.05, 0.0]
    assert all(g["betas"] == (0.9, 0.95) and g["lr"] == 0.01 for g in built.param_groups)
    assert sum(len(g["params"]) for g in built.param_groups) == len(list(task.model.parameters()))
    task.param_groups = lambda model: [{"params": [model.model.head.weight]}]
    refused(lambda: task_optimizer(rule, task, task.model), "param_groups leave out model.body.1.weight")
    task.param_groups, task.optimizer_options = None, {"betas": (0.9,)}
    refused(lambda: task_optimizer(rule, task, task.model), "do not fit AdamW")
