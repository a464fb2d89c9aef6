"""torchtitan's checkpoint layout, written and read without torchtitan, as its code spells it
(``torchtitan/components/checkpointer/dcp.py`` 0.3: ``_flattened_model_states_sd``;
``components/optimizer/utils.py``: ``get_flat_optim_state_dict``; ``lr_scheduler.py``:
``LRSchedulersContainer.state_dict``; ``dataloader.py``: ``ParallelAwareDataloader``;
``trainer.py``: ``Trainer.state_dict``), for tests/integrations/test_integration_torchtitan.py.

A step is ``<folder>/step-<N>``, one ``dcp.save`` of::

    {**model.state_dict(),                                  # FQNs at the top level
     "optimizer": {"state.<fqn>.<key>": ..., "param_groups.<fqn>.<hparam>": ...},
     "lr_scheduler": {"last_epoch": N},
     "dataloader": {"dp_rank_<r>": pickle bytes, "world_size": W},
     "train_state": {"step": N, "ntokens_seen": T}}
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.wq = nn.Linear(16, 16, bias=False)
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(16, 32)
        self.feed_forward.w2 = nn.Linear(32, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention.wq(h)
        return h + self.feed_forward.w2(torch.relu(self.feed_forward.w1(h)))


class Tiny(nn.Module):
    """Names as torchtitan's models have them (tok_embeddings, layers.<i>, norm, output)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(32, 16)
        self.layers = nn.ModuleDict({"0": Block(), "1": Block()})
        self.norm = nn.LayerNorm(16)
        self.output = nn.Linear(16, 32, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def is_matrix(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and name.startswith("layers.")


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 32, (4, 8), generator=g)
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))


def torch_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """torchtitan's container with two optimizers: torch's Muon for the matrices of the
    layers, AdamW for the rest; built from (name, param) pairs, so groups have param_names."""
    named = list(model.named_parameters())
    mats = [(n, p) for n, p in named if is_matrix(n, p)]
    rest = [(n, p) for n, p in named if not is_matrix(n, p)]
    return [
        torch.optim.Muon(mats, lr=0.02, momentum=0.9),
        torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
    ]


def train(model: nn.Module, opts: list[torch.optim.Optimizer], steps: int) -> None:
    for step in range(steps):
        loss_of(model, step).backward()
        for o in opts:
            o.step()
            o.zero_grad()


def flat_optimizer(opts: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """``OptimizersContainer.state_dict()``: each optimizer's state by FQN, merged."""
    out: dict[str, Any] = {}
    for opt in opts:
        sd = opt.state_dict()
        fqn_of = {}
        for g in sd["param_groups"]:
            fqn_of.update(zip(g["params"], g["param_names"], strict=True))
        for pid, state in sd["state"].items():
            for key, value in state.items():
                out[f"state.{fqn_of[pid]}.{key}"] = value
        for g in sd["param_groups"]:
            for fqn in g["param_names"]:
                for key, value in g.items():
                    if key not in ("params", "param_names"):
                        out[f"param_groups.{fqn}.{key}"] = value
    return out


def titan_state(
    model: nn.Module, optimizer: dict[str, Any], step: int, *, ntokens: int = 0, dp: int = 1
) -> dict[str, Any]:
    return {
        **model.state_dict(),
        "optimizer": optimizer,
        "lr_scheduler": {"last_epoch": step},
        "dataloader": {
            **{f"dp_rank_{r}": bytes([r, step]) * 4 for r in range(dp)},
            "world_size": dp,
        },
        "train_state": {"step": step, "ntokens_seen": ntokens},
    }


def write_titan_step(folder: str, step: int, state: dict[str, Any]) -> str:
    path = os.path.join(folder, f"step-{step}")
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


class Holder:
    """A Stateful of torchtitan's kind (``lr_scheduler``, ``train_state``, ``dataloader``):
    ``state_dict()`` is its value, ``load_state_dict`` replaces it."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = dict(value)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.value)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = dict(sd)
