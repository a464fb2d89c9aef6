"""import_optimizer_state on N ranks into FSDP2-sharded (DTensor) Muon states, uneven shards and
offload included: every shard gets exactly its slice of the source."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from tests._ckpt import TinyNet, make_muon, train
from tests._dist import dist_device, run_on_ranks


def body_import_into_dtensor_states(rank, world_size, sources, offload, expected_file):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from muon_ckpt import import_optimizer_state

    # Tensors cannot be returned through the harness's queue: compare here.
    want = torch.load(expected_file, weights_only=True)
    mesh = init_device_mesh(dist_device().type, (world_size,))
    checked = 0
    for name, source in sources.items():
        torch.manual_seed(1)
        model = TinyNet().to(dist_device())
        fully_shard(model, mesh=mesh)
        opt = make_muon(model)
        if offload:
            opt.turn_on_cpu_offload()
        report = import_optimizer_state(opt, source, model=model, adam_into_muon=True)
        assert opt.cpu_offload == offload
        assert sorted(report.imported) == sorted(want) and report.fresh == [], str(report)
        opt.turn_off_cpu_offload()
        for fqn, p in model.named_parameters():
            assert isinstance(p, DTensor)
            st = opt.state[p]
            if fqn in ("fc1.weight", "fc2.weight"):
                pairs = [("momentum_buffer", "exp_avg")]
            else:
                pairs = [("moment1", "exp_avg"), ("moment2", "exp_avg_sq"), ("step", "step")]
            for dst, src_key in pairs:
                v = st[dst]
                full = (v.full_tensor() if isinstance(v, DTensor) else v).cpu()
                assert torch.equal(full, want[fqn][src_key]), (name, fqn, dst)
                checked += 1
    return checked


@pytest.mark.parametrize(("world_size", "offload"), [(2, False), (3, True)])
def test_import_on_n_ranks_into_sharded_states(tmp_path, world_size, offload):
    torch.manual_seed(0)
    src = TinyNet()
    src_opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    train(src, src_opt, 3)
    torch.save(src_opt.state_dict(), tmp_path / "adamw.pt")
    flat = get_optimizer_state_dict(
        src, src_opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    dcp.save(flat, checkpoint_id=str(tmp_path / "titan"), no_dist=True)
    expected = {n: dict(src_opt.state[p]) for n, p in src.named_parameters()}
    torch.save(expected, tmp_path / "expected.pt")
    sources = {"torch.save": str(tmp_path / "adamw.pt"), "dcp": str(tmp_path / "titan")}
    results = run_on_ranks(
        body_import_into_dtensor_states, world_size, sources, offload, str(tmp_path / "expected.pt")
    )
    # 2 matrices x 1 key + 4 others x 3 keys, per source, on every rank
    assert results == [2 * (2 + 4 * 3)] * world_size
