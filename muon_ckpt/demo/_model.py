"""The demo's model and data: a tiny causal transformer LM on synthetic token sequences.

Data is a pure function of (seed, step, rank), so a resumed run sees exactly the batches an
uninterrupted one does, with no data-loader state to restore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DemoConfig", "TinyLM", "batch", "param_groups"]


@dataclass(frozen=True)
class DemoConfig:
    vocab: int = 128
    dim: int = 64
    layers: int = 2
    heads: int = 4
    seq: int = 32
    batch: int = 8  # sequences per rank per step


class Block(nn.Module):
    def __init__(self, c: DemoConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.norm1 = nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.norm2 = nn.LayerNorm(c.dim)
        self.up = nn.Linear(c.dim, 4 * c.dim)
        self.down = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, c: DemoConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def batch(c: DemoConfig, seed: int, step: int, rank: int, device: torch.device) -> torch.Tensor:
    """Synthetic sequences: each token is the previous one plus 1 or 2 (mod vocab), so the
    best possible loss is ln 2 = 0.693."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    x = torch.empty(c.batch, c.seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, c.vocab, (c.batch,), generator=g)
    jump = 1 + torch.randint(0, 2, (c.batch, c.seq + 1), generator=g)
    for t in range(1, c.seq + 1):
        x[:, t] = (x[:, t - 1] + jump[:, t]) % c.vocab
    return x.to(device)


def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Muon for the blocks' weight matrices; AdamW for embeddings, head, norms and biases."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        is_matrix = p.ndim == 2 and name.startswith("blocks.")
        (muon if is_matrix else adamw).append((name, p))
    return [
        {
            "params": [p for _, p in muon],
            "names": [n for n, _ in muon],
            "lr": 0.02,
            "weight_decay": 0.01,
        },
        {
            "params": [p for _, p in adamw],
            "names": [n for n, _ in adamw],
            "use_muon": False,
            "lr": 1e-2,
            "weight_decay": 0.0,
        },
    ]
