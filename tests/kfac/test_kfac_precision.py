"""The precision policy of each K-FAC stage (docs/kfac.md, "Precision"), on the CPU and on a GPU.

Factors and preconditioning run in IEEE float32 whatever the script chose for its own matmuls
(TF32 on a GPU would put them ~1e-3 off); a float32 model's preconditioned gradient then matches
the float64 dense-solve reference to the tolerance the CPU tests hold. The CUDA test repeats the
same checks on a GPU with TF32 switched on, and runs a steady-state step under CUDA's sync debug
mode (any host synchronisation is an error). It is skipped without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac import KFACPreconditioner, solve
from kfac.precision import ieee_fp32
from tests.kfac.test_kfac_reference import dense_solve, grad_matrix, reference_factors, rel_err

FLOAT32_TOL = 1e-5
CUDA = torch.cuda.is_available()


@pytest.fixture
def tf32_on() -> Iterator[None]:
    """The training script's choice: TF32 for matmuls and convolutions (restored afterwards)."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = (matmul.fp32_precision, conv.fp32_precision)
    matmul.fp32_precision, conv.fp32_precision = "tf32", "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved


class Net(nn.Module):
    """Stride-1 conv (the autocorrelation path), a deep narrow conv (G from the (N·positions, out) matrix)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 40, 3, stride=2, padding=1, bias=False)  # 40 channels > 9 positions
        self.fc = nn.Linear(40 * 3 * 3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv2(torch.tanh(self.conv1(x)))).flatten(1))


def _data(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    return x.to(device), y.to(device)


def _check_against_dense_solve(device: str) -> None:
    """A float32 model on ``device``: factors and preconditioned gradients against the float64 reference."""
    torch.manual_seed(0)
    reference_model = Net().double()
    model = Net().to(device)  # float32
    model.load_state_dict({k: v.float() for k, v in reference_model.state_dict().items()})
    x, y = _data("cpu")
    factors = {k: (a.detach(), g.detach()) for k, (a, g) in reference_factors(reference_model, x.double(), y).items()}
    damping = 0.05
    pre = KFACPreconditioner(model, inv_update_freq=1, kl_clip=None, damping=damping)
    xd, yd = _data(device)
    # The model's own arithmetic in IEEE float32 (the reference is a float64 model: TF32 convolutions
    # would put its gradients ~1e-4 off before K-FAC saw them); K-FAC's step runs under the script's TF32.
    with ieee_fp32():
        F.cross_entropy(model(xd), yd).backward()
    raw = {layer.name: grad_matrix(layer.module).double().cpu() for layer in pre.layers}
    pre.step()
    for i, layer in enumerate(pre.layers):
        big_a, big_g = factors[layer.name]
        assert pre.a_factors[i].dtype == torch.float32
        assert rel_err(pre.a_factors[i].double().cpu(), big_a) < FLOAT32_TOL, layer.name
        assert rel_err(pre.g_factors[i].double().cpu(), big_g) < FLOAT32_TOL, layer.name
        want = dense_solve(big_a, big_g, raw[layer.name], damping)
        assert rel_err(grad_matrix(layer.module).double().cpu(), want) < FLOAT32_TOL, layer.name


def test_ieee_fp32_switches_tf32_off_inside_and_restores_the_scripts_setting() -> None:
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    try:
        matmul.allow_tf32 = True  # a script using the legacy flag
        with ieee_fp32():
            assert matmul.fp32_precision == "ieee" and torch.backends.cudnn.conv.fp32_precision == "ieee"
        assert matmul.allow_tf32 is True  # still readable with the legacy API afterwards
        matmul.allow_tf32 = False
        with ieee_fp32():
            assert matmul.fp32_precision == "ieee"
        assert matmul.allow_tf32 is False
    finally:
        matmul.fp32_precision = saved


def test_every_kfac_product_runs_in_ieee_fp32_when_the_script_enabled_tf32(
    tf32_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, set[str]] = {"a": set(), "g": set(), "precondition": set()}
    torch.manual_seed(0)
    model = Net()
    pre = KFACPreconditioner(model, inv_update_freq=1)

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            seen[name].add(torch.backends.cuda.matmul.fp32_precision + "/" + torch.backends.cudnn.conv.fp32_precision)
            return fn(*args, **kwargs)

        return wrapped

    for layer in pre.layers:
        monkeypatch.setattr(layer, "a_moment", spy("a", layer.a_moment))
        monkeypatch.setattr(layer, "g_moment", spy("g", layer.g_moment))
    monkeypatch.setattr(solve, "precondition_eigen", spy("precondition", solve.precondition_eigen))
    x, y = _data("cpu")
    F.cross_entropy(model(x), y).backward()
    pre.step()
    assert seen == {"a": {"ieee/ieee"}, "g": {"ieee/ieee"}, "precondition": {"ieee/ieee"}}
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # the script's setting is back


def test_float32_model_matches_the_float64_dense_solve_on_cpu() -> None:
    _check_against_dense_solve("cpu")


def test_decompositions_are_float32_and_retried_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    factor = torch.eye(4) * 2.0
    vectors, values = solve.eigen_decomposition(factor, torch.float32)
    assert vectors.dtype == values.dtype == torch.float32
    dtypes = []
    real = torch.linalg.eigh

    def eigh(matrix, *args, **kwargs):
        dtypes.append(matrix.dtype)
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("injected")
        return real(matrix, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    (vectors, values), how = solve.robust_eigen_decomposition(factor, torch.float32, None)
    assert dtypes == [torch.float32, torch.float64] and how == "float64_retry" and values.dtype == torch.float32


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_matches_the_dense_solve_with_tf32_on(tf32_on: None) -> None:
    _check_against_dense_solve("cuda")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_steady_state_step_never_synchronises_and_masks_skipped_steps() -> None:
    torch.manual_seed(0)
    model = Net().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model, factor_update_freq=1, inv_update_freq=100, cpu_eigen_limit=20)
    x, y = _data("cuda")
    for _ in range(2):  # first factors and decompositions (these may synchronise)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step(found_inf=torch.zeros((), device="cuda"))
        optimizer.step()
    before = [f.clone() for f in pre.a_factors + pre.g_factors]
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    model.fc.weight.grad[0, 0] = float("inf")
    found_inf = torch.ones((), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pre.step(found_inf=found_inf)  # factor update, KL clip and preconditioning, all on the device
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(before, pre.a_factors + pre.g_factors, strict=True))
    assert pre.stats["skipped_factor_updates"] == len(pre.layers)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_decompositions_split_between_host_and_gpu_equal_the_cpu_ones() -> None:
    torch.manual_seed(0)
    cpu_model = Net()
    gpu_model = Net().cuda()
    gpu_model.load_state_dict(cpu_model.state_dict())
    x, y = _data("cpu")
    pres = {}
    for name, model, data in (("cpu", cpu_model, (x, y)), ("cuda", gpu_model, _data("cuda"))):
        pres[name] = KFACPreconditioner(model, inv_update_freq=1, kl_clip=None, cpu_eigen_limit=30)
        with ieee_fp32():  # both models' own arithmetic alike (cuDNN would run the GPU's convolutions in TF32)
            F.cross_entropy(model(data[0]), data[1]).backward()
        pres[name].step()
    for i in range(len(pres["cpu"].layers)):
        for side in (0, 1):
            factor = (pres["cpu"].a_factors if side == 0 else pres["cpu"].g_factors)[i].double()
            q, d = (t.double().cpu() for t in pres["cuda"]._held.pairs[i][side])
            # A float32 eigensolver's backward error grows with n (LAPACK's bound: a small multiple of n·eps).
            tolerance = max(FLOAT32_TOL, 8 * len(d) * torch.finfo(torch.float32).eps)
            assert rel_err(q @ torch.diag(d) @ q.T, factor) < tolerance, (i, side, len(d))
    for p, q in zip(cpu_model.parameters(), gpu_model.parameters(), strict=True):
        assert rel_err(q.grad.cpu().double(), p.grad.double()) < 10 * FLOAT32_TOL  # two float32 eigensolvers


# ---- statistics of half-precision inputs (a model under autocast) -------------------------------------------------

HALF_CASES = [  # (name, module, input shape): every product form of the statistics
    ("linear", nn.Linear(24, 10), (6, 5, 24)),
    ("conv 1x1 (the pixels' Gram)", nn.Conv2d(8, 12, 1), (3, 8, 9, 9)),
    ("conv 3x3 stride 2 (row products)", nn.Conv2d(6, 10, 3, stride=2, padding=1), (4, 6, 11, 11)),
    ("conv 5x5 (row products)", nn.Conv2d(4, 6, 5), (4, 4, 12, 12)),
]


@pytest.fixture
def half_products(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The CUDA path on the CPU: half operands are kept (kfac.precision.keeps_half) and multiplied by a stand-in
    for cuBLAS's float32-result GEMM that refuses anything but half operands and returns their exact product's
    float32 rounding; returns the dtypes it multiplied."""
    import kfac.precision as precision

    seen: list[torch.dtype] = []

    def exact(product):
        def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            assert a.dtype in precision.HALF and b.dtype == a.dtype, (a.dtype, b.dtype)
            seen.append(a.dtype)
            return product(a.double(), b.double()).float()
        return run

    monkeypatch.setattr(precision, "keeps_half", lambda t, dtype: t.dtype in precision.HALF and dtype == torch.float32)
    monkeypatch.setattr(precision, "_half_mm", exact(torch.mm))
    monkeypatch.setattr(precision, "_half_bmm", exact(torch.bmm))
    return seen


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("name", "module", "shape"), HALF_CASES, ids=[c[0] for c in HALF_CASES])
def test_half_inputs_are_multiplied_as_they_are_and_give_their_float32_moments(
    half_products: list[torch.dtype], half: torch.dtype, name: str, module: nn.Module, shape: tuple[int, ...]
) -> None:
    """A and G of half-precision inputs, their products taken on the half values (no float32 copy), equal the
    moments of the same values converted to float32 first (every half value is exact in float32): only the
    order of the float32 additions differs."""
    from kfac.layers import find_layers

    (layer,) = find_layers(module)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(half)
    grad = torch.randn(module(x.float()).shape, generator=g).to(half)
    for kind, moment_of, value in (("A", layer.a_moment, x), ("G", layer.g_moment, grad)):
        before = len(half_products)
        got, count = moment_of(value)
        assert len(half_products) > before, f"{name} {kind}: the half operands were converted"
        assert got.dtype == torch.float32
        want, want_count = moment_of(value.float())
        assert count == want_count
        assert rel_err(got.double(), want.double()) < FLOAT32_TOL, f"{name} {kind}"


@pytest.mark.parametrize("method", ["autocorrelation", "rows", "unfold"])
def test_each_patch_method_gives_a_half_input_its_float32_moment(half_products: list[torch.dtype],
                                                                 method: str) -> None:
    """Every way to a conv layer's A, on a bf16 input, against the float32 input's unfolded patches; the
    autocorrelation widens the input first (its products are convolutions' weight gradients, whose half results
    would be rounded), the others multiply it as it is."""
    from kfac.patches import MOMENT_METHODS, ConvGeometry

    geometry = ConvGeometry.of(nn.Conv2d(3, 4, 3, padding=1))
    x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(1)).bfloat16()
    moment, sums, count = MOMENT_METHODS[method](x, geometry, True)
    reference, reference_sums, reference_count = MOMENT_METHODS["unfold"](x.float(), geometry, True)
    assert (len(half_products) > 0) == (method != "autocorrelation")
    assert moment.dtype == torch.float32 and sums is not None and sums.dtype == torch.float32
    assert count == reference_count
    assert rel_err(moment.double(), reference.double()) < FLOAT32_TOL
    assert rel_err(sums.double(), reference_sums.double()) < FLOAT32_TOL


def test_off_cuda_half_inputs_are_converted_to_the_factors_dtype() -> None:
    from kfac.precision import keeps_half, operand

    x = torch.ones(3, 3, dtype=torch.bfloat16)
    assert not keeps_half(x, torch.float32) and operand(x, torch.float32).dtype == torch.float32
    assert operand(torch.ones(2, dtype=torch.float64), torch.float32).dtype == torch.float32


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_half_statistics_equal_the_float64_moments_of_the_same_values() -> None:
    """cuBLAS's bf16 GEMM with float32 results (torch's out_dtype), on the GPU: every product form's A of bf16
    inputs equals the float64 moment of the same values to float32 accumulation. One test for all the forms:
    benchmarks/gpu_suite.sh's run C names its CUDA tests one per function."""
    import copy

    from kfac.layers import find_layers

    problems = []
    for name, shared, shape in HALF_CASES:
        module = copy.deepcopy(shared).cuda()  # the CPU tests' modules stay as they are
        (layer,) = find_layers(module)
        x = torch.randn(shape, device="cuda").bfloat16()
        got, _ = layer.a_moment(x)
        want, _ = find_layers(module.double())[0].a_moment(x.double())
        if got.dtype != torch.float32 or not rel_err(got.double(), want) < FLOAT32_TOL:
            problems.append(f"{name}: {got.dtype}, relative error {rel_err(got.double(), want):.1e}")
    assert not problems, "; ".join(problems)


# ---- statistics_dtype=torch.bfloat16: a float32 model's inputs rounded before the statistics -----------------


def _inputs_and_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Each Linear and Conv2d layer's input and output gradient in one forward and backward (mean loss)."""
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name: str):
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            seen[name] = [args[0].detach()]
            out.register_hook(lambda grad: seen[name].append(grad.detach()))
        return hook

    handles = [m.register_forward_hook(keep(name)) for name, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.Conv2d))]
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for handle in handles:
        handle.remove()
    return seen


def _factors(layer, x: torch.Tensor, grad: torch.Tensor, examples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, G) of one batch as the preconditioner scales them (G of per-example gradients), in float64."""
    a, a_count = layer.a_moment(x.double())
    g, g_count = layer.g_moment(grad.double())
    return a / a_count, g * examples**2 / g_count


def test_bf16_statistics_are_the_float32_moments_of_the_rounded_inputs() -> None:
    """Through the preconditioner's hooks: with statistics_dtype=bfloat16 each first factor equals the float64
    moment of the layer's input and output gradient rounded to bfloat16, and differs from the unrounded ones'
    (so the rounding happened); a float64 layer copy computes the reference."""
    import copy

    from kfac.layers import find_layers

    torch.manual_seed(0)
    model = Net()
    x, y = _data("cpu")
    seen = _inputs_and_gradients(model, x, y)
    pre = KFACPreconditioner(model, statistics_dtype=torch.bfloat16)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    for i, layer in enumerate(pre.layers):
        (exact,) = find_layers(copy.deepcopy(layer.module).double())
        inputs, grads = seen[layer.name]
        want_a, want_g = _factors(exact, inputs.bfloat16(), grads.bfloat16(), x.shape[0])
        assert rel_err(pre.a_factors[i].double(), want_a) < FLOAT32_TOL, layer.name
        assert rel_err(pre.g_factors[i].double(), want_g) < FLOAT32_TOL, layer.name
        unrounded_a, unrounded_g = _factors(exact, inputs, grads, x.shape[0])
        assert rel_err(pre.a_factors[i].double(), unrounded_a) > 1e-5, layer.name
        assert rel_err(pre.g_factors[i].double(), unrounded_g) > 1e-5, layer.name


def test_a_float64_model_and_half_inputs_are_not_rounded_again() -> None:
    from kfac.precision import statistics_input

    for t in (torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float16)):
        assert statistics_input(t, torch.bfloat16) is t
    assert statistics_input(torch.ones(2), None).dtype == torch.float32
    assert statistics_input(torch.ones(2), torch.bfloat16).dtype == torch.bfloat16


def _digits(n: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    from hpcdl.data.digits import load_digits

    train = load_digits().train
    images = train.images[n * batch : (n + 1) * batch].float() / 16.0
    return (F.interpolate(images, size=28, mode="bilinear", align_corners=False) - 0.3) / 0.4, \
        train.labels[n * batch : (n + 1) * batch]


def _exact_direction(a: torch.Tensor, g: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """(G ⊗ A + λI)⁻¹ applied to the gradient matrix, from float64 eigendecompositions (eigen's solve)."""
    da, qa = torch.linalg.eigh(a)
    dg, qg = torch.linalg.eigh(g)
    return qg @ ((qg.T @ grad @ qa) / (dg[:, None] * da[None, :] + damping)) @ qa.T


# The stated accuracy of bf16 statistics on real factors (averages of 4 to 8 batches of mnist_cnn on the embedded
# digits and of a CIFAR ResNet-20 on random images, after a few SGD steps), against float64 moments of the
# unrounded inputs: each factor within 2e-3 (bfloat16's unit roundoff is 3.9e-3; the products' errors average
# out), and every layer's preconditioned gradient, eigen's exact damped solve at the large-batch preset's
# damping of 0.003, within 2e-2 (measured here: factors at most 9.7e-4, directions at most 1.1e-2, both on the
# ResNet-20). The error grows as the damping shrinks (at 1e-5: up to 2e-1): bf16 statistics want the damping K-FAC
# is run at, not a vanishing one (docs/kfac.md, "Precision").
BF16_FACTOR_TOL, BF16_DIRECTION_TOL = 2e-3, 2e-2


@pytest.mark.parametrize("source", ["mnist_cnn", "resnet20"])
def test_bf16_statistics_of_real_factors_stay_within_the_stated_tolerance(source: str) -> None:
    import copy

    from hpcdl.training.models import build_model
    from kfac.layers import find_layers

    torch.manual_seed(0)
    if source == "mnist_cnn":
        model, batches, averaged = build_model("mnist_cnn", 10, 1), lambda k: _digits(k, 64), 4
    else:
        generator = torch.Generator().manual_seed(0)
        model, averaged = build_model("resnet20", 10, 3), 8
        images = [(torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))
                  for _ in range(2 + averaged)]
        batches = images.__getitem__
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for k in range(2):
        optimizer.zero_grad()
        F.cross_entropy(model(batches(k)[0]), batches(k)[1]).backward()
        optimizer.step()
    with pytest.warns(UserWarning) if source == "resnet20" else contextlib.nullcontext():  # its norms are plain
        layers = find_layers(model)
    sums: dict[str, list[torch.Tensor]] = {}
    for k in range(2, 2 + averaged):
        x, y = batches(k)
        seen = _inputs_and_gradients(model, x, y)
        for layer in layers:
            (exact,) = find_layers(copy.deepcopy(layer.module).double())
            inputs, grads = seen[layer.name]
            pair = [*_factors(exact, inputs, grads, x.shape[0]),
                    *_factors(exact, inputs.bfloat16(), grads.bfloat16(), x.shape[0])]
            before = sums.get(layer.name)
            sums[layer.name] = pair if before is None else [s + p for s, p in zip(before, pair, strict=True)]
    problems, worst = [], {0.003: 0.0, 1e-5: 0.0}
    for layer in layers:
        a, g, a_bf16, g_bf16 = (s / averaged for s in sums[layer.name])
        grad = layer.grad_matrix(torch.float64)  # the last batch's
        for damping in worst:
            error = rel_err(_exact_direction(a_bf16, g_bf16, grad, damping), _exact_direction(a, g, grad, damping))
            worst[damping] = max(worst[damping], error)
        errors = dict(A=rel_err(a_bf16, a), G=rel_err(g_bf16, g))
        problems += [f"{layer.name} {k} {e:.1e}" for k, e in errors.items() if not e <= BF16_FACTOR_TOL]
    assert not problems, "; ".join(problems)
    assert worst[0.003] <= BF16_DIRECTION_TOL, worst
    assert worst[1e-5] > worst[0.003], worst  # docs/kfac.md: the error grows as the damping shrinks
