"""LARS, LAMB, Muon (timm), SOAP (pytorch-optimizer), AdamW and the warm-up start in hpcdl.train: values against
their formulas and against the libraries' own optimizers, Muon's step against the exact polar factor, non-finite
steps skipped, one-line errors, the slow-bf16 warning, and whole 2-rank jobs that resume bit-identically and equal,
bit for bit, a 1-rank run on the same global batch."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from pytorch_optimizer.optimizer.soap import SOAP
from timm.optim import Lamb, Lars, Muon
from torch import nn

from hpcdl.data.order import rank_order
from hpcdl.runtime import cpu_features
from hpcdl.runtime.errors import UsageError
from hpcdl.training.config import TrainConfig, parse_config
from hpcdl.training.guarded_rules import GuardedLamb, GuardedLars, GuardedMuon, GuardedSoap
from hpcdl.training.loop import micro_batches
from hpcdl.training.optimizers import build_preconditioner, build_update_rule
from hpcdl.training.schedule import LRSchedule, warmup_start
from tests.support.backends import backend_param
from tests.support.mpi_harness import run_mpi
from tests.support.reliability_runs import assert_usage_error, checkpoint_steps, load_checkpoint, run_job, same_weights

processes = pytest.mark.processes  # the job tests start mpirun


# ---- warm-up -----------------------------------------------------------------------------------


@pytest.mark.parametrize("start_factor", [None, 0.1, 1.0])
@pytest.mark.parametrize("ranks", [1, 4])
def test_warmup_follows_the_linear_formula_from_its_start(start_factor: float | None, ranks: int) -> None:
    base, warmup = 0.05, 2.0
    peak = base * ranks
    start = warmup_start(base, peak, start_factor)
    assert start == (base if start_factor is None else start_factor * peak)
    schedule = LRSchedule(start, peak, warmup, total_epochs=10, kind="cosine")
    for progress in (0.0, 0.25, 0.5, 1.0, 1.5, 1.999):
        expected = start + (peak - start) * progress / warmup
        assert schedule(progress) == pytest.approx(expected, rel=1e-12)
    assert schedule(warmup) == pytest.approx(peak)  # cosine starts at the peak when the warm-up ends
    assert schedule(10.0) == pytest.approx(0.0, abs=1e-12)


def test_one_rank_warmup_ramps_only_with_a_start_factor() -> None:
    flat = parse_config(["--base-lr", "0.4", "--warmup-epochs", "1"])
    ramp = parse_config(["--base-lr", "0.4", "--warmup-epochs", "1", "--warmup-start-factor", "0.01"])
    assert warmup_start(flat.base_lr, 0.4, flat.warmup_start_factor) == 0.4  # one rank: base == peak, no ramp
    assert warmup_start(ramp.base_lr, 0.4, ramp.warmup_start_factor) == pytest.approx(0.004)


# ---- bad values: one line naming the flag --------------------------------------------------------


@pytest.mark.parametrize("argv, fragment", [
    (["--optimizer", "lion"], "--optimizer"),
    (["--warmup-start-factor", "0"], "--warmup-start-factor must be a fraction in (0, 1]"),
    (["--warmup-start-factor", "1.5"], "--warmup-start-factor must be a fraction in (0, 1]"),
    (["--warmup-start-factor", "nan"], "--warmup-start-factor must be"),
    (["--warmup-start-factor", "0.1", "--warmup-epochs", "0"], "--warmup-start-factor needs --warmup-epochs > 0"),
    (["--optimizer", "lamb", "--nesterov"], "--nesterov needs --optimizer sgd"),
    (["--optimizer", "muon", "--nesterov"], "--nesterov needs --optimizer sgd"),
    (["--optimizer", "muon", "--kfac"], "--optimizer muon cannot be combined with --kfac: Muon sets every singular"),
    (["--optimizer", "soap", "--kfac-preset", "large-batch"], "--optimizer soap cannot be combined with --kfac: SOAP"),
    (["--optimizer", "muon", "--momentum", "1"], "--momentum must be"),
])
def test_bad_values_are_one_line_naming_the_flag(argv: list[str], fragment: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_config(argv)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("spec, fragment", [
    ("nonsense", "takes hpcdl or module:function"),
    ("no_such_module_here:make", "ModuleNotFoundError"),
    ("math:no_such_function", "math has no 'no_such_function'"),
    ("math:pi", "pi is a float, not a function"),
])
def test_a_bad_kfac_impl_is_one_line(spec: str, fragment: str) -> None:
    config = TrainConfig(kfac=True, kfac_impl=spec)
    with pytest.raises(UsageError) as caught:
        build_preconditioner(config, nn.Linear(2, 2), lambda *_: 0.1, None)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_kfac_impl_calls_the_factory_with_the_jobs_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def factory(config, model, lr, scaler):
        seen.update(config=config, model=model, lr=lr(), scaler=scaler)
        return "preconditioner"

    monkeypatch.setattr(math, "test_factory", factory, raising=False)
    config, model = TrainConfig(kfac=True, kfac_impl="math:test_factory"), nn.Linear(2, 2)
    assert build_preconditioner(config, model, lambda *_: 0.25, None) == "preconditioner"
    assert seen == dict(config=config, model=model, lr=0.25, scaler=None)
    assert build_preconditioner(TrainConfig(kfac_impl="math:test_factory"), model, lambda *_: 0.1, None) is None


FOREIGN_KFAC = {
    "kfac/__init__.py": "OWNER = 'foreign'\n",  # another package named kfac, as kfac-pytorch's is
    "foreign_plugin.py": """
import sys

import kfac


class Counting:
    def __init__(self):
        self.steps = 0

    def step(self, found_inf=None):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def factory(config, model, current_lr, scaler):
    assert kfac.OWNER == "foreign", kfac.__file__
    print("plugin kfac:", sys.modules["kfac"].__file__, flush=True)
    return Counting()
""",
}


@processes
def test_a_kfac_impl_plugin_runs_beside_another_package_named_kfac(tmp_path: Path) -> None:
    """kfac-pytorch's package is also ``kfac``: a job whose --kfac-impl is a plugin must not import the repository's
    kfac (the large-batch study puts kfac-pytorch first on the path, and ran from a directory without ours)."""
    for name, text in FOREIGN_KFAC.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    result = run_mpi(1, ["-m", "hpcdl.train", "--output-dir", str(tmp_path / "run"), "--no-progress", "--kfac",
                         "--kfac-impl", "foreign_plugin:factory", "--epochs", "1", "--max-steps", "2"],
                     timeout=120, env={"PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"plugin kfac: {tmp_path / 'kfac' / '__init__.py'}" in result.stdout
    checkpoint = sorted((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt"))[-1]
    assert torch.load(checkpoint, weights_only=False)["kfac"] == {"steps": 2}  # the loop stepped the plugin


# ---- the update rules against timm's own, and the non-finite skip ---------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _step_with(optimizer: torch.optim.Optimizer, model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize("name, reference", [("lars", Lars), ("lamb", Lamb), ("muon", Muon), ("soap", SOAP)])
def test_the_rule_is_the_librarys_with_the_configured_hyperparameters(name: str, reference: type) -> None:
    config = TrainConfig(optimizer=name, momentum=0.8, weight_decay=1e-3)
    ours_model, timm_model = _model(), _model()
    ours = build_update_rule(config, ours_model, lr=0.3)
    extra = {"momentum": 0.8} if name in ("lars", "muon") else {}
    theirs = reference(timm_model.parameters(), lr=0.3, weight_decay=1e-3, **extra)
    for seed in range(4):
        _step_with(ours, ours_model, seed)
        _step_with(theirs, timm_model, seed)
    assert same_weights(ours_model.state_dict(), timm_model.state_dict())
    assert not same_weights(ours_model.state_dict(), _model().state_dict())  # it did train


def test_muons_matrix_step_is_the_polar_factor_of_its_momentum() -> None:
    """An independent reference: from zero momentum, Muon's first step on a matrix W is -lr * s * U V^T (the
    orthogonal factor of the gradient G = U S V^T, from an SVD in float64), s = 0.2 sqrt(max(out, in)) scaling it
    to AdamW's update size. timm's five tuned quintic Newton-Schulz steps in bf16 only approximate U V^T (its
    singular values land within a few per cent of 1: 0.98-1.03 here), so the step is compared within that, not
    to its last bits; the raw gradient's direction is 0.77 from U V^T by the same measure."""
    torch.manual_seed(3)
    layer = nn.Linear(48, 32, bias=False)
    before = layer.weight.detach().clone()
    optimizer = build_update_rule(TrainConfig(optimizer="muon", weight_decay=0.0), layer, lr=0.1)
    x = torch.randn(64, 48)
    layer(x).square().sum().backward()
    u, _, vt = torch.linalg.svd(layer.weight.grad.double(), full_matrices=False)
    optimizer.step()
    step = (layer.weight.detach() - before).double()
    polar = -0.1 * 0.2 * math.sqrt(48) * (u @ vt)
    cosine = (step * polar).sum() / (step.norm() * polar.norm())
    assert cosine > 0.95, float(cosine)
    singular = torch.linalg.svdvals(step / (0.1 * 0.2 * math.sqrt(48)))
    assert singular.min() > 0.9 and singular.max() < 1.1, singular  # orthogonalised: no direction dominates
    assert torch.linalg.svdvals(layer.weight.grad.double()).max() > 5 * singular.max()  # the gradient's do


def test_muon_gives_vectors_its_adamw_and_soap_skips_its_first_update() -> None:
    """What is not a matrix (biases here) takes timm Muon's AdamW part: its first step is -lr * sign(g) (Adam's
    first step with bias correction); SOAP's first step only gathers its factors, as SOAP's reference does."""
    model = _model()
    muon = build_update_rule(TrainConfig(optimizer="muon", weight_decay=0.0), model, lr=0.01)
    bias = model[0].bias.detach().clone()
    _step_with(muon, model, 0)
    expected = bias - 0.01 * torch.sign(model[0].bias.grad)
    torch.testing.assert_close(model[0].bias.detach(), expected, rtol=0, atol=1e-6)
    soap_model = _model()
    soap = build_update_rule(TrainConfig(optimizer="soap"), soap_model, lr=0.01)
    _step_with(soap, soap_model, 0)
    assert same_weights(soap_model.state_dict(), _model().state_dict())
    _step_with(soap, soap_model, 1)
    assert not same_weights(soap_model.state_dict(), _model().state_dict())


@pytest.mark.parametrize("rule", [GuardedLars, GuardedLamb, GuardedMuon, GuardedSoap])
def test_a_flagged_step_leaves_parameters_and_state_alone(rule: type) -> None:
    model = _model()
    optimizer = rule(model.parameters(), lr=0.1, weight_decay=1e-3)
    _step_with(optimizer, model, 0)
    _step_with(optimizer, model, 2)  # SOAP's first step only gathers its factors
    params, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    optimizer.found_inf = torch.ones(())
    _step_with(optimizer, model, 1)
    assert same_weights(model.state_dict(), params)
    assert str(optimizer.state_dict()) == str(state)
    optimizer.found_inf = torch.zeros(())
    _step_with(optimizer, model, 1)
    assert not same_weights(model.state_dict(), params)


# ---- bf16 on a CPU that emulates it --------------------------------------------------------------


@pytest.mark.parametrize("native, dtype, device, warned", [
    (False, torch.bfloat16, "cpu", True),
    (True, torch.bfloat16, "cpu", False),
    (False, None, "cpu", False),
    (False, torch.float16, "cuda", False),
    (False, torch.bfloat16, "cuda", False),
])
def test_bf16_on_a_cpu_without_it_is_one_warning_line(native: bool, dtype: torch.dtype | None, device: str,
                                                       warned: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: native)
    message = cpu_features.slow_bf16_warning(dtype, torch.device(device))
    assert (message is not None) == warned
    if warned:
        assert "\n" not in message and "--amp bf16" in message and "12x slower" in message


@pytest.mark.parametrize("avx512_bf16, amx, expected",
                         [(False, False, False), (True, False, True), (False, True, True)])
def test_the_probe_reads_torchs_cpu_capabilities(avx512_bf16: bool, amx: bool, expected: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "x86_64")
    assert cpu_features.native_bf16() is expected


# ---- whole jobs ----------------------------------------------------------------------------------

FLAGS = ("--epochs", "2", "--seed", "5", "--base-lr", "0.02", "--warmup-epochs", "0.5", "--warmup-start-factor",
         "0.1", "--keep-checkpoints", "5")
# Per-rank base rates (scaled by 2 ranks): LARS's trust ratio scales the step, Muon's step is orthogonalised and
# scaled to AdamW's size, SOAP's and AdamW's are Adam's: none of them is SGD's rate.
LRS = {"lars": "2.0", "lamb": "0.005", "muon": "0.005", "soap": "0.002", "adamw": "0.002"}


@pytest.mark.parametrize("k", [2, 4])
def test_micro_batch_j_is_rank_js_batch(k: int) -> None:
    """Why a 1-rank run with accumulation k equals a k-rank run bit for bit: the same examples, in the same order,
    reach the same backward passes (each rank's batch is micro-batch j of one rank's k-times larger batch)."""
    for epoch in range(2):
        one = rank_order(1437, 5, epoch, 0, 1, 32 * k)
        for step in range(1437 // (32 * k)):
            parts = micro_batches(one[step * 32 * k:(step + 1) * 32 * k], k)
            for j in range(k):
                assert torch.equal(parts[j], rank_order(1437, 5, epoch, j, k, 32)[step * 32:(step + 1) * 32])
    batch = torch.randn(8, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in micro_batches(batch, 2))


@processes
@pytest.mark.parametrize("name, backend", [*(backend_param(name, "horovod", id=name)
                                             for name in ("lars", "lamb", "muon", "soap", "adamw")),
                                           backend_param("adamw", "torch", id="adamw-torch")])
def test_two_rank_jobs_resume_bit_identically_and_equal_one_rank(name: str, backend: str, tmp_path: Path) -> None:
    flags = (*FLAGS, "--optimizer", name, "--base-lr", LRS[name], "--backend", backend)
    whole = run_job(2, tmp_path / "whole", *flags)
    assert whole.rc == 0, whole.tail()
    cut = run_job(2, tmp_path / "cut", *flags, "--max-steps", "15")  # mid-epoch 1 (22 steps per epoch)
    assert cut.rc == 0 and checkpoint_steps(tmp_path / "cut") == [15], cut.tail()
    resumed = run_job(2, tmp_path / "cut", *flags, "--resume")
    assert resumed.rc == 0 and "resuming from" in resumed.out, resumed.tail()
    a, b = load_checkpoint(tmp_path / "whole", 44), load_checkpoint(tmp_path / "cut", 44)
    assert same_weights(a["model"], b["model"])
    assert str(a["optimizer"]) == str(b["optimizer"])
    assert a["progress"]["last_test"] == b["progress"]["last_test"]

    # 1 rank x 32 x 2 accumulated backward passes is the same global batch as 2 ranks x 32, in the same
    # summation order (micro-batch j is rank j's batch; halving each pass's loss is exact, so the accumulated
    # gradient is the ranks' average bit for bit), and the rate scales with ranks x passes alike: the runs are
    # equal, not close. A batch of 64 in one pass sums in another order: its last-bit differences are amplified
    # by the Adam-family rules (LAMB's trust ratio, AdamW's g/sqrt(v) on near-zero gradients) until, on an
    # AVX2 CPU, LAMB missed rtol 1e-4 after 44 steps, as much as the same batch in reversed order does.
    single = run_job(1, tmp_path / "single", *flags, "--batches-per-allreduce", "2")
    assert single.rc == 0, single.tail()
    c = load_checkpoint(tmp_path / "single", 44)
    assert same_weights(c["model"], a["model"])
    assert str(c["optimizer"]) == str(a["optimizer"])


@processes
def test_a_nonfinite_step_is_skipped_with_lars_and_bf16(tmp_path: Path) -> None:
    job = run_job(2, tmp_path / "run", *FLAGS, "--optimizer", "lars", "--base-lr", LRS["lars"], "--amp", "bf16",
                  "--epochs", "1", fault="1:3:nan")
    assert job.rc == 0, job.tail()
    assert "step 3: non-finite gradients, update skipped" in job.out
    # rank 0 tells the user when this CPU emulates bf16 (the probe is faked in the unit test above)
    assert job.out.count(cpu_features.SLOW_BF16_WARNING) == (0 if cpu_features.native_bf16() else 1), job.tail()
    state = load_checkpoint(tmp_path / "run", 22)
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


@processes
def test_a_bad_optimizer_is_one_line_from_the_job(tmp_path: Path) -> None:
    assert_usage_error(run_job(2, tmp_path / "run", "--optimizer", "lion", timeout=120), "--optimizer")
