"""The integrations pass their device mesh through: a step saved under a framework's own 2-D
mesh records that layout (the framework's dim names, placements per parameter) and loads
bitwise under another layout, model and Muon/AdamW state, CPU offload on.

Lightning: ``ModelParallelStrategy`` ("data_parallel" x "tensor_parallel") on 4 gloo CPU
processes under torchrun, ``MuonCheckpoint`` saving asynchronously (the job:
tests/integrations/_lightning_mesh_job.py). Lightning's ``FSDPStrategy`` is FSDP1 and needs a
GPU (its Trainer refuses ``accelerator="cpu"``): not run here (docs/integrations.md).

torchtitan: its ``ParallelDims`` meshes as ``_build_mesh_without_ep`` built them (the dims of
size > 1 in the order pp, dp_replicate, dp_shard, cp, tp; ``dp_shard_cp`` flattened; FSDP over
``("dp_replicate", "dp_shard_cp")``, TP over ``"tp"``), without torchtitan (not a test extra:
tests/integrations/test_integration_torchtitan.py says why; a release that names its dims
otherwise changes only the names recorded), saved and loaded through what
``MuonCheckpointManager`` hands the manager (``_titan_state``).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests._dist import run_on_ranks, run_script
from tests.optim._mesh_train_job import DIMS, _full
from tests.optim._meshes import Net, _tp_plan, groups

STEPS = 2


def _lightning(url, out, dp, tp, how, steps):
    four = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp * tp)]
    job = ["-m", "tests.integrations._lightning_mesh_job", str(url), str(out)]
    r = run_script([*four, *job, str(dp), str(tp), how, str(steps)], timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(out, weights_only=False)


def test_lightning_model_parallel_mesh_is_recorded_and_loads_on_another(tmp_path):
    """Saved under TP 2 then FSDP 2 on Lightning's mesh, loaded under HSDP 2x2 on Lightning's
    mesh (``fully_shard`` over the whole mesh): every param and optimizer state bitwise."""
    pytest.importorskip("pytorch_lightning")
    url = tmp_path / "run"
    saved = _lightning(url, tmp_path / "a.pt", 2, 2, "tp+fsdp", STEPS)
    assert saved["resumed"] is None and saved["step"] == STEPS
    layout = saved["layout"]
    assert {"shape": [2, 2], "dims": ["data_parallel", "tensor_parallel"]} in layout["meshes"]
    gate = layout["params"]["net.blocks.0.gate.weight"]  # column-parallel, then fully_shard
    assert layout["meshes"][gate["mesh"]]["dims"] == ["data_parallel", "tensor_parallel"]
    assert gate["placements"] == ["_S(0, 2)", "S(0)"], gate

    loaded = _lightning(url, tmp_path / "b.pt", 2, 2, "hsdp", STEPS)  # (nothing left to train)
    assert loaded["resumed"] == STEPS
    assert saved["state"].keys() == loaded["state"].keys()
    assert any(k.endswith(".momentum_buffer") for k in saved["state"])
    for k, v in saved["state"].items():
        assert torch.equal(loaded["state"][k], v), k


# --------------------------------------------------------------------- torchtitan's meshes


def _titan_mesh(dp_replicate: int, dp_shard: int, tp: int):
    """torchtitan's world mesh of ``ParallelDims(dp_replicate, dp_shard, cp=1, tp, pp=1)``."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}
    names = tuple(n for n, d in sizes.items() if d > 1)
    world = init_device_mesh("cpu", tuple(sizes[n] for n in names), mesh_dim_names=names)
    dp = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
    world[dp]._flatten(mesh_dim_name="dp")
    if "dp_shard" in names:
        world[("dp_shard",)]._flatten(mesh_dim_name="dp_shard_cp")
    return world


def _titan_model(world) -> nn.Module:
    """Laid out as torchtitan's parallelize functions do: TP over ``"tp"``, then FSDP per
    block and at the root over ``("dp_replicate", "dp_shard_cp")`` (HSDP) or ``"dp_shard_cp"``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = Net(*DIMS)
    names = world.mesh_dim_names
    if "tp" in names:
        parallelize_module(model, world["tp"], _tp_plan())
    dp = world[("dp_replicate", "dp_shard_cp") if "dp_replicate" in names else ("dp_shard_cp",)]
    for b in model.blocks:
        fully_shard(b, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


class _Value:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return dict(self.value)

    def load_state_dict(self, state):
        self.value = dict(state)


def _titan_run(url, world, train: bool):
    from muon_ckpt.integrations._titan_state import load_titan, titan_manager
    from optim import Muon

    model = _titan_model(world)
    opt = Muon(groups(model), chunk_size=2, warmup_step=1)
    opt.turn_on_cpu_offload()
    sched = _Value({"last_epoch": 0})
    states = {"train_state": _Value({"step": 0, "ntokens_seen": 0})}
    mgr = titan_manager(
        url,
        model=model,
        optimizer=opt,
        lr_schedulers=sched,
        states=states,
        dataloader=None,
        async_save=True,
    )
    got = load_titan(mgr, None, states)
    batch = world["dp"].get_local_rank()  # (tensor-parallel ranks share their batch)
    if train:
        for step in range(1, STEPS + 1):
            g = torch.Generator().manual_seed(step + 10 * batch)
            model(torch.randn(3, 3, DIMS[0] + 2, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            sched.value = {"last_epoch": step}
            states["train_state"].value = {"step": step, "ntokens_seen": 32 * step}
            mgr.save(step)
    mgr.close()
    opt.turn_off_cpu_offload()
    full = {}
    for n, p in model.named_parameters():
        full[f"param {n}"] = _full(p.detach())
        for k, v in opt.state[p].items():
            full[f"state {n}.{k}"] = _full(v)
    info = mgr.step_info()
    own = states["train_state"].value
    return {"loaded": got, "state": full, "layout": info.layout, "sched": sched.value, "own": own}


def body_titan_meshes(rank, world_size, root):
    hsdp, tp = _titan_mesh(2, 2, 1), _titan_mesh(1, 2, 2)
    out = {}
    for name, a, b in (("hsdp-to-tp", hsdp, tp), ("tp-to-hsdp", tp, hsdp)):
        url = os.path.join(root, name)
        out[name] = (_titan_run(url, a, train=True), _titan_run(url, b, train=False))
    return out


def test_torchtitans_parallel_dims_are_recorded_and_load_on_another(tmp_path):
    """HSDP (dp_replicate 2 x dp_shard 2) saved, loaded under dp_shard 2 x tp 2, and the
    reverse, on 4 gloo ranks: the manifest records torchtitan's dim names; params, Muon's and
    AdamW's states, the lr scheduler and each rank's train state load bitwise."""
    results = run_on_ranks(body_titan_meshes, 4, str(tmp_path), timeout=600)
    for rank, res in enumerate(results):
        for name, (saved, loaded) in res.items():
            dims = [m["dims"] for m in saved["layout"]["meshes"]]
            want = (
                ["dp_replicate", "dp_shard_cp"] if name == "hsdp-to-tp" else ["dp_shard_cp", "tp"]
            )
            assert want in dims, (name, dims)
            assert saved["loaded"] is None and loaded["loaded"] == STEPS, (rank, name)
            assert loaded["sched"] == {"last_epoch": STEPS}
            # (the same number of ranks: each rank's own state loads too)
            assert loaded["own"] == saved["own"] == {"step": STEPS, "ntokens_seen": 32 * STEPS}
            assert saved["state"].keys() == loaded["state"].keys()
            for k, v in saved["state"].items():
                assert torch.equal(loaded["state"][k], v), (rank, name, k)


# --------------------------------------------------------------------- FSDP1 (FSDPStrategy)


def _fsdp1_flattened(model: nn.Module) -> None:
    """``model``'s params made what FSDP1 (``use_orig_params=True``, Lightning's default) leaves
    them between steps: 1-D views of this rank's piece of one flat shard. By FSDP1's own
    ``FlatParamHandle``: its wrapper needs an accelerator, the handle does not."""
    import torch.distributed as dist
    from torch.distributed.fsdp._flat_param import FlatParamHandle, HandleShardingStrategy

    handle = FlatParamHandle(
        list(model.parameters()),
        model,
        torch.device("cpu"),
        HandleShardingStrategy.FULL_SHARD,
        False,
        None,
        None,
        False,
        dist.group.WORLD,
        True,
    )
    handle.shard()
    handle.init_flat_param_attributes()
    handle._use_sharded_views()


def body_fsdp1(rank, world_size, url):
    from muon_ckpt import CheckpointManager
    from optim import Muon

    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    _fsdp1_flattened(model)
    assert all(p.ndim == 1 for p in model.parameters())
    errors = {}
    try:
        Muon([{"params": [model[0].weight, model[1].weight]}])
    except ValueError as e:
        errors["muon"] = str(e)
    try:
        CheckpointManager(url, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    except ValueError as e:
        errors["manager"] = str(e)
    return errors


def test_fsdp1_flat_shards_are_refused_by_muon_and_the_manager(tmp_path):
    """Lightning's FSDPStrategy shards with FSDP1, whose params are pieces of flat shards: Muon
    cannot orthogonalise them (its 1-D refusal used to say to move the matrices to AdamW),
    and their optimizer state cannot be placed in a checkpoint (it used to save each key from
    one rank: the other ranks' pieces were lost). Both refuse, naming fully_shard (FSDP2)."""
    url = str(tmp_path / "run")
    for errors in run_on_ranks(body_fsdp1, 2, url, timeout=300):
        assert "FSDP1" in errors.get("muon", ""), errors
        assert "fully_shard" in errors["muon"] and "AdamW" not in errors["muon"], errors
        assert "FSDP1" in errors.get("manager", ""), errors
        assert "'0.weight'" in errors["manager"] and "fully_shard" in errors["manager"], errors
    assert not os.path.exists(os.path.join(url, "step-00000001"))
