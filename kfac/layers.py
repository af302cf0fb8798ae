"""Which modules K-FAC preconditions, and how each turns its tensors into factor statistics.

A :class:`KFACLayer` knows three things about its module: the sum of a aᵀ over its inputs
(with the count it is an average over), the same for g gᵀ over the gradients of its outputs,
and how to read and write its gradient as one matrix (out x in, bias as the last column).
The conventions (what counts as an example, how convolution positions are averaged) are
written out in docs/kfac.md.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from kfac.patches import ConvGeometry, bordered_moment, mean_patches, patch_moment
from kfac.precision import bmm, mm, operand, wide_sum

SkipSpec = str | type
# How a convolution's positions enter its factors (docs/kfac.md): KFC's expand (every position an example
# of a shared linear layer) or K-FAC-reduce (Eschenhagen et al. 2023: positions summed first, per example).
CONV_APPROXIMATIONS = ("expand", "reduce")


def factor_dtype(dtype: torch.dtype) -> torch.dtype:
    """Factors are float64 for a float64 model and float32 otherwise (half precision included)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class KFACLayer(ABC):
    """One preconditioned module: its factor statistics and its gradient as a matrix."""

    module: nn.Linear | nn.Conv2d

    def __init__(self, name: str, module: nn.Linear | nn.Conv2d) -> None:
        self.name = name
        self.module = module
        self.has_bias = module.bias is not None
        self.dtype = factor_dtype(module.weight.dtype)

    @property
    def weight(self) -> Tensor:
        return self.module.weight

    @property
    def bias(self) -> Tensor | None:
        return self.module.bias

    @property
    def device(self) -> torch.device:
        return self.module.weight.device

    @property
    @abstractmethod
    def a_dim(self) -> int:
        """Size of the A factor (inputs, plus one for the bias)."""

    @property
    @abstractmethod
    def g_dim(self) -> int:
        """Size of the G factor (outputs)."""

    @abstractmethod
    def a_moment(self, x: Tensor) -> tuple[Tensor, float]:
        """Σ a aᵀ over this batch's rows or patches, and the count that turns it into A."""

    @abstractmethod
    def g_moment(self, grad_output: Tensor) -> tuple[Tensor, float]:
        """Σ δ δᵀ over the rows or positions of ``grad_output`` (unscaled), and the count for G."""

    @abstractmethod
    def examples(self, grad_output: Tensor) -> int:
        """How many examples a mean-reduced loss averaged over: the per-example gradient scale."""

    @abstractmethod
    def first_examples(self, tensor: Tensor, limit: int) -> Tensor:
        """The first ``limit`` examples of a batched input or output gradient (an unbatched one whole)."""

    def parameters(self) -> list[Tensor]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def grad_matrix(self, dtype: torch.dtype) -> Tensor | None:
        """The gradient as (out, in[+1]) in ``dtype``; None when the weight has no gradient."""
        weight_grad = self.weight.grad
        if weight_grad is None:
            return None
        matrix = weight_grad.reshape(weight_grad.shape[0], -1).to(dtype)
        if self.bias is not None:
            bias_grad = self.bias.grad
            column = torch.zeros_like(matrix[:, :1]) if bias_grad is None else bias_grad.to(dtype)[:, None]
            matrix = torch.cat([matrix, column], dim=1)
        return matrix

    def set_grad(self, matrix: Tensor) -> None:
        """Write a preconditioned gradient matrix back into the parameters' .grad."""
        weight, bias = self.weight, self.bias
        weight_part = matrix[:, :-1] if bias is not None else matrix
        if weight.grad is not None:
            weight.grad.copy_(weight_part.reshape(weight.shape))
        if bias is not None and bias.grad is not None:
            bias.grad.copy_(matrix[:, -1])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, A {self.a_dim}x{self.a_dim}, G {self.g_dim}x{self.g_dim})"


class LinearLayer(KFACLayer):
    """nn.Linear: every row of the input (all leading dimensions) is one example."""

    module: nn.Linear

    @property
    def a_dim(self) -> int:
        return self.module.in_features + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_features

    def a_moment(self, x: Tensor) -> tuple[Tensor, float]:
        rows = operand(x.reshape(-1, x.shape[-1]), self.dtype)
        moment = mm(rows.T, rows)
        if self.has_bias:
            moment = bordered_moment(moment, wide_sum(rows, 0), float(rows.shape[0]))
        return moment, float(rows.shape[0])

    def g_moment(self, grad_output: Tensor) -> tuple[Tensor, float]:
        rows = operand(grad_output.reshape(-1, grad_output.shape[-1]), self.dtype)
        return mm(rows.T, rows), float(rows.shape[0])

    def examples(self, grad_output: Tensor) -> int:
        return grad_output.numel() // grad_output.shape[-1]

    def first_examples(self, tensor: Tensor, limit: int) -> Tensor:
        return tensor[:limit] if tensor.dim() > 1 else tensor


class Conv2dLayer(KFACLayer):
    """nn.Conv2d after KFC: A sums over output positions, G averages over them (docs/kfac.md).

    With ``approximation="reduce"`` (K-FAC-reduce) A is |T| times the Gram of each example's mean patch
    and G the Gram of each example's output gradient summed over positions, with the same counts: the
    A statistics cost N·D² instead of N·|T|·D² (D the patch size), and the factors are exact where every
    position sees the same input, where KFC's expand is exact for independent positions.
    """

    module: nn.Conv2d

    def __init__(self, name: str, module: nn.Conv2d, approximation: str = "expand") -> None:
        super().__init__(name, module)
        if approximation not in CONV_APPROXIMATIONS:
            raise ValueError(f"conv approximation must be one of {CONV_APPROXIMATIONS}, got {approximation!r}")
        self.geometry = ConvGeometry.of(module)
        self.reduce = approximation == "reduce"

    @property
    def a_dim(self) -> int:
        kh, kw = self.module.kernel_size
        return self.module.in_channels * kh * kw + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_channels

    def a_moment(self, x: Tensor) -> tuple[Tensor, float]:
        if x.dim() == 3:  # unbatched input (C, H, W)
            x = x.unsqueeze(0)
        if not self.reduce:
            return patch_moment(operand(x, self.dtype), self.geometry, self.has_bias), float(x.shape[0])
        x = x.to(self.dtype)
        means = mean_patches(x, self.geometry)
        positions = math.prod(self.geometry.output_size(*self.geometry.pad(x[:1]).shape[-2:]))
        moment = (means.T @ means).mul_(positions)
        if self.has_bias:  # the border is expand's: Σ of the patches and their count
            moment = bordered_moment(moment, means.sum(0).mul_(positions), float(x.shape[0] * positions))
        return moment, float(x.shape[0])

    def g_moment(self, grad_output: Tensor) -> tuple[Tensor, float]:
        if grad_output.dim() == 3:
            grad_output = grad_output.unsqueeze(0)
        n, out = grad_output.shape[:2]
        positions = grad_output[0, 0].numel()
        if self.reduce:
            sums = grad_output.reshape(n, out, positions).sum(2, dtype=self.dtype)
            return sums.T @ sums, float(n * positions)
        if positions >= out and not grad_output.is_contiguous(memory_format=torch.channels_last):
            # Per-example Grams straight from the NCHW layout, no transpose copy: the (N, out, out)
            # intermediate is no larger than the gradient itself when positions >= out.
            per_example = operand(grad_output.reshape(n, out, positions), self.dtype)
            moment = bmm(per_example, per_example.transpose(1, 2)).sum(0)
        else:
            # Deep layers (few positions, many channels: ResNet-50's layer4 has 49 and 2,048): one
            # (N·positions, out) matrix, like a weight gradient, instead of an (N, out, out) stack that
            # would be N·out/positions times the gradient's size (a GiB at batch 64). Free of copies
            # for a channels-last gradient.
            rows = operand(grad_output.movedim(1, -1).reshape(-1, out), self.dtype)
            moment = mm(rows.T, rows)
        return moment, float(n * positions)

    def examples(self, grad_output: Tensor) -> int:
        return 1 if grad_output.dim() == 3 else grad_output.shape[0]

    def first_examples(self, tensor: Tensor, limit: int) -> Tensor:
        return tensor if tensor.dim() == 3 else tensor[:limit]


def _matches(name: str, module: nn.Module, skip: Iterable[SkipSpec]) -> bool:
    for spec in skip:
        if isinstance(spec, type):
            if isinstance(module, spec):
                return True
        elif name == spec or name.startswith(spec + ".") or type(module).__name__.lower() == spec.lower():
            return True
    return False


def find_layers(model: nn.Module, skip_layers: Sequence[SkipSpec] = (),
                conv_approximation: str = "expand") -> list[KFACLayer]:
    """The Linear and Conv2d modules of ``model`` that K-FAC will precondition, in model order.

    ``skip_layers`` holds module names (a name also skips everything under it), class names
    (case-insensitive) or classes. A Linear layer takes inputs of any rank (a transformer's
    (batch, sequence, features): every row is one example). What K-FAC cannot precondition takes
    the optimizer's plain step, and is said once, in one warning each: grouped and depthwise
    convolutions (their Fisher block is not one Kronecker product of the shapes used here), and
    any other module with trainable parameters of its own (embeddings, norms, other convolutions,
    nn.MultiheadAttention, whose projections run without calling their modules).
    """
    layers: list[KFACLayer] = []
    grouped: list[str] = []
    others: list[tuple[str, nn.Module]] = []
    attention = [name for name, module in model.named_modules() if isinstance(module, nn.MultiheadAttention)]
    for name, module in model.named_modules():
        if _matches(name, module, skip_layers):
            continue
        modelled = isinstance(module, (nn.Linear, nn.Conv2d)) and not _inside(name, attention)
        if not modelled:
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                others.append((name, module))
            continue
        if not module.weight.requires_grad:
            continue
        if isinstance(module, nn.Conv2d):
            if module.groups != 1:
                grouped.append(f"{name or 'the model'} (groups={module.groups})")
                continue
            layers.append(Conv2dLayer(name, module, conv_approximation))
        else:
            layers.append(LinearLayer(name, module))
    if grouped:  # one warning for all of them: a MobileNet has dozens
        warnings.warn(f"K-FAC skips {len(grouped)} grouped or depthwise convolution(s), left to the optimizer as "
                      f"they are: {_first_few(grouped)}", stacklevel=2)
    # A weight tied to a preconditioned layer's (a GPT's embedding and output layer) is that layer's parameter:
    # K-FAC preconditions it through that layer, and the module sharing it is said to, not listed as plain.
    owner = {id(layer.module.weight): layer.name for layer in layers}
    plain: list[str] = []
    tied: list[str] = []
    for name, module in others:
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        label = f"{name or 'the model'} ({type(module).__name__})"
        if all(id(p) in owner for p in own):
            tied.append(f"{name or 'the model'}'s weight is {owner[id(own[0])]}'s")
        else:
            plain.append(label)
    if plain:
        warnings.warn(f"K-FAC leaves {len(plain)} layer(s) it does not model to the optimizer's plain step: "
                      f"{_first_few(plain)}", stacklevel=2)
    if tied:
        warnings.warn(f"K-FAC preconditions tied weights through the layer it models: {_first_few(tied)} "
                      "(the whole gradient, the other use's part included, with that layer's factors)", stacklevel=2)
    return layers


def _inside(name: str, parents: Sequence[str]) -> bool:
    return any(name.startswith(parent + ".") for parent in parents)


def _first_few(names: Sequence[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
