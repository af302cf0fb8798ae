"""kfac.options: the preconditioner's settings are checked in one place, before the model is looked at."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
import torch
from torch import nn

from kfac import KFACPreconditioner
from kfac.methods import Inverse, Newton
from kfac.options import KFACOptions


class Untouchable(nn.Module):
    """A model that fails if K-FAC looks for its layers: the settings must be refused first."""

    def named_modules(self, *args, **kwargs):
        raise AssertionError("the model was looked at before the settings were checked")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(inv_update_freq=0), "inv_update_freq must be a positive integer"),
        (dict(lr=0.1, damping=-1.0), "damping must be > 0"),
        (dict(grad_worker_fraction="half"), "grad_worker_fraction must be a number in"),
        (dict(comm_dtype=torch.float16), "comm_dtype must be one of"),
        (dict(factor_comm_dtype=torch.float16), "factor_comm_dtype must be one of"),
        (dict(cpu_eigen_limit=-1), "cpu_eigen_limit must be a non-negative integer"),
        (dict(bucket_cap_mb=0.0), "bucket_cap_mb must be positive"),
        (dict(conv_approximation="mean"), "conv_approximation must be one of"),
        (dict(method=object()), "method must be one of"),
        (dict(tf32="yes"), "tf32 must be True or False"),
        (dict(statistics_dtype=torch.float16), "statistics_dtype must be one of"),
    ],
)
def test_a_bad_setting_is_one_line_before_the_model_is_looked_at(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message) as error:
        KFACPreconditioner(Untouchable(), **kwargs)
    assert "\n" not in str(error.value)


def test_the_options_are_the_constructor_s_settings() -> None:
    """Every parameter but the model and the two collaborators (grad_scaler, communicator) is an option, so a
    new setting cannot skip the checks; the defaults are the constructor's."""
    parameters = inspect.signature(KFACPreconditioner).parameters
    settings = [name for name in parameters if name not in ("model", "grad_scaler", "communicator")]
    assert [field.name for field in fields(KFACOptions)] == settings
    pre = KFACPreconditioner(nn.Linear(2, 2))
    assert all(getattr(pre.options, name) == parameters[name].default for name in settings if name != "method")


def test_a_method_name_becomes_its_class_and_an_instance_stays_itself() -> None:
    pre = KFACPreconditioner(nn.Linear(2, 2), method="inverse")
    assert type(pre.options.solver) is Inverse and pre.method == "inverse"
    newton = Newton(tf32=True)
    assert KFACPreconditioner(nn.Linear(2, 2), method=newton).options.solver is newton
    for tf32 in (False, True):  # newton named takes the preconditioner's tf32
        solver = KFACPreconditioner(nn.Linear(2, 2), method="newton", tf32=tf32).options.solver
        assert isinstance(solver, Newton) and solver.tf32 is tf32


@pytest.mark.parametrize("tf32", [False, True])
def test_the_statistics_products_run_at_the_precision_tf32_asks_for(tf32: bool) -> None:
    """Inside the hooks cuBLAS and cuDNN are switched to TF32 or IEEE as asked (read back from torch's own flags,
    which hold on a CPU too), and the caller's setting comes back after them."""
    import kfac.layers as layers

    seen: list[tuple[str, str]] = []
    a_moment, g_moment = layers.LinearLayer.a_moment, layers.LinearLayer.g_moment
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv

    def record(method):
        def wrapped(self, x):
            seen.append((matmul.fp32_precision, conv.fp32_precision))
            return method(self, x)
        return wrapped

    saved = (matmul.fp32_precision, conv.fp32_precision)
    try:
        matmul.fp32_precision = conv.fp32_precision = "ieee" if tf32 else "tf32"
        layers.LinearLayer.a_moment, layers.LinearLayer.g_moment = record(a_moment), record(g_moment)
        model = nn.Linear(3, 2)
        pre = KFACPreconditioner(model, tf32=tf32)
        model(torch.randn(4, 3)).sum().backward()
        pre.step()
        want = "tf32" if tf32 else "ieee"
        assert seen == [(want, want), (want, want)]
        assert (matmul.fp32_precision, conv.fp32_precision) == (("ieee",) * 2 if tf32 else ("tf32",) * 2)
    finally:
        layers.LinearLayer.a_moment, layers.LinearLayer.g_moment = a_moment, g_moment
        matmul.fp32_precision, conv.fp32_precision = saved


@pytest.mark.parametrize("comm_dtype, factor_comm_dtype", [(torch.bfloat16, None), (None, torch.bfloat16)])
def test_every_setting_reaches_its_own_option(comm_dtype, factor_comm_dtype) -> None:
    """The constructor hands each setting on by name: given a value unlike every other setting's, each one is
    found under its own name in ``pre.options`` (two settings swapped in the hand-off would fail here)."""
    newton = Newton(tol=1e-4)
    given = dict(factor_update_freq=2, inv_update_freq=3, damping=0.02, factor_decay=0.5, kl_clip=0.003, lr=0.4,
                 grad_worker_fraction=0.75, method=newton, eigen_dtype=torch.float64, loss_reduction="sum",
                 skip_layers=("Conv2d",), colocate_factors=False, backward_passes_per_step=4,
                 late_decompositions=True, factor_examples=7, cpu_eigen_limit=9, comm_dtype=comm_dtype,
                 factor_comm_dtype=factor_comm_dtype, bucket_cap_mb=1.5, conv_approximation="reduce", tf32=True,
                 statistics_dtype=torch.bfloat16)
    assert sorted(given) == sorted(field.name for field in fields(KFACOptions))
    defaults = inspect.signature(KFACPreconditioner).parameters
    assert all(given[name] != defaults[name].default for name in given if "comm_dtype" not in name)
    pre = KFACPreconditioner(nn.Linear(2, 2), **given)
    assert {name: getattr(pre.options, name) for name in given} == given
