"""FSDP2 (``fully_shard``) on a small transformer: save on 2 ranks, resume on 3, bitwise equal to
an uninterrupted single-process run (Muon for the block matrices, AdamW for the rest)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tests._dist import dist_device, run_on_ranks

K, S = 2, 2
VOCAB, DIM, HID = 24, 10, 14  # 10 and 14 rows shard unevenly over 3 ranks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM)
        self.up = nn.Linear(DIM, HID)
        self.down = nn.Linear(HID, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-1, -2) / DIM**0.5, dim=-1) @ v
        x = x + self.proj(a)
        return x + self.down(torch.relu(self.up(x)))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def build(world_size: int | None):
    """Model (fully_shard over ``world_size`` ranks, or plain) and its Muon optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from optim.muon import Muon

    torch.manual_seed(0)
    model = TinyTransformer().to(dist_device())
    if world_size is not None:
        mesh = init_device_mesh(dist_device().type, (world_size,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    muon = [(n, p) for n, p in named if p.ndim == 2 and n.startswith("blocks.")]
    rest = [(n, p) for n, p in named if not (p.ndim == 2 and n.startswith("blocks."))]
    opt = Muon(
        [
            {"params": [p for _, p in muon], "lr": 0.02, "weight_decay": 0.01},
            {"params": [p for _, p in rest], "use_muon": False, "lr": 2e-3},
        ]
    )
    return model, opt


def train(model, steps: range, opt) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(500 + s)
        for _, p in model.named_parameters():
            full = torch.randn(p.shape, generator=g).to(dist_device())
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements)
            p.grad = full
        opt.step()


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()

    out = {}
    for n, p in model.named_parameters():
        out[n] = full(p)
        for k, v in opt.state.get(p, {}).items():
            out[f"{n}:{k}"] = full(v)
    return out


def body_fsdp_save(rank, world_size, url):
    from muon_ckpt import CheckpointManager
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    model, opt = build(world_size)
    opt.turn_on_cpu_offload()
    train(model, range(1, K + 1), opt)
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        assert mgr.save(K)
    return True


def body_fsdp_resume(rank, world_size, url):
    from muon_ckpt import CheckpointManager
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    ref, ref_opt = build(None)
    train(ref, range(1, K + S + 1), ref_opt)
    want = snapshot(ref, ref_opt)

    model, opt = build(world_size)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the load must bring every parameter back
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        assert mgr.load() == K
    train(model, range(K + 1, K + S + 1), opt)
    got = snapshot(model, opt)
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"differ from the uninterrupted run after resuming on {world_size}: {bad}"
    # The model still runs forward (FSDP2 all-gathers the loaded shards).
    out = model(torch.arange(6, device=dist_device()).view(1, 6) % VOCAB)
    assert out.shape == (1, 6, VOCAB)
    return len(want)


def test_fsdp2_transformer_resumes_exactly_at_another_world_size(tmp_path):
    url = str(tmp_path / "fsdp")
    assert run_on_ranks(body_fsdp_save, 2, url) == [True, True]
    counts = run_on_ranks(body_fsdp_resume, 3, url)
    assert counts[0] > 20 and len(set(counts)) == 1
