"""A small transformer language model on text that ships with Python: the source of the stdlib's ``textwrap``.

    mpirun -np 2 .venv/bin/python -m hpcdl.train --task examples.transformer_lm:task --optimizer adamw --base-lr 0.001 --output-dir runs/lm
    mpirun -np 2 .venv/bin/python -m hpcdl.train --task examples.transformer_lm:task --kfac --output-dir runs/lm-kfac

A character-level GPT (Radford et al.'s decoder: pre-norm blocks of causal self-attention and an MLP).
Its attention is written with nn.Linear projections, so K-FAC preconditions every projection, MLP and
the output layer on their (batch, sequence, features) inputs; the embeddings and norms take the plain
step. No dropout: an example's output depends on that example alone, so runs on any world size with
the same global batch are bit-identical. ``small_task`` is the same model, smaller, for the tests.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from hpcdl.training.task import Task

CORPUS = Path(textwrap.__file__)


class Windows(Dataset):
    """Windows of ``length`` tokens (input) and the same window shifted by one (target), every ``stride``."""

    def __init__(self, tokens: Tensor, length: int, stride: int) -> None:
        self.tokens, self.length, self.stride = tokens, length, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.length - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.stride
        window = self.tokens[start:start + self.length + 1]
        return window[:-1], window[1:]


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocabulary: int, length: int, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(length, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)
        for name, p in self.named_parameters():  # GPT-2's initialisation, scaled down for the residual outputs
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        return self.head(self.norm(self.blocks(x)))


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over every position of every sequence (nats per character)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def language_task(characters: int | None, length: int, width: int, heads: int, layers: int) -> Task:
    text = CORPUS.read_text(encoding="utf-8")[:characters]
    vocabulary = sorted(set(text))
    tokens = torch.tensor([vocabulary.index(c) for c in text], dtype=torch.int64)
    split = int(len(tokens) * 0.9)
    return Task(
        model=TinyGPT(len(vocabulary), length, width, heads, layers),
        train_data=Windows(tokens[:split], length, stride=length // 2),
        eval_data=Windows(tokens[split:], length, stride=length),
        loss=next_token_loss,
        best="loss", goal="min",
    )


def task() -> Task:
    """The model of the results file (benchmarks/results/transformer_lm.json): 2 blocks of width 64."""
    return language_task(None, length=64, width=64, heads=4, layers=2)


def small_task() -> Task:
    """One block of width 32 on the first 6,000 characters: seconds per epoch, for the tests."""
    return language_task(6000, length=32, width=32, heads=2, layers=1)
