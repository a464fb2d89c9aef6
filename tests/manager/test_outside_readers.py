"""A committed step opens with torch's own readers, in an interpreter that never imports
muon_ckpt: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (one torch.save
file of full tensors) and ``dcp.load(..., no_dist=True)`` into a plain model, bitwise. Steps
saved as training saves them: CPU offload on, asynchronously, with ``extra`` and
``rank_extra``; one on a single process, one by 2 FSDP2 ranks (uneven DTensor shards)."""

from __future__ import annotations

import json
import textwrap

import torch

from muon_ckpt import CheckpointManager
from tests._dist import run_on_ranks, run_script
from tests.conftest import tiny_run, tiny_train
from tests.manager.test_manager_fsdp import build, snapshot, train

READER = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from tests.conftest import tiny_run
    from tests.manager.test_manager_fsdp import TinyTransformer

    out = {}
    for name, step, model in (
        ("one", sys.argv[1], tiny_run(seed=1)[0]),
        ("fsdp", sys.argv[2], TinyTransformer()),
    ):
        dcp_to_torch_save(step, f"{sys.argv[3]}/{name}.pt")
        # Into a plain model (its own values first, so a key not loaded would show); DCP
        # flattens {"model": {fqn: t}} to the step's "model.<fqn>" keys.
        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id=step, no_dist=True)
        out[name] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(out, f"{sys.argv[3]}/plain.pt")
    print(any(m.startswith("muon_ckpt") for m in sys.modules))
    """
)


class Position:
    """A stand-in for a data loader's position (a rank_extra object)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = sd["batches"]


def body_fsdp_save(rank, world_size, url):
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    model, opt = build(world_size)
    opt.turn_on_cpu_offload()
    train(model, range(1, 3), opt)
    mgr = CheckpointManager(url, model=model, optimizer=opt, rank_extra={"data": Position(rank)})
    with mgr:
        assert mgr.save(2)
    opt.turn_off_cpu_offload()
    return snapshot(model, opt)


def test_dcp_to_torch_save_and_plain_dcp_load_read_a_step_bitwise(tmp_path):
    model, opt = tiny_run()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.turn_on_cpu_offload()
    tiny_train(model, opt, 3)
    sched.step()
    mgr = CheckpointManager(
        str(tmp_path / "one"),
        model=model,
        optimizer=opt,
        extra={"sched": sched},
        rank_extra={"data": Position(7)},
        async_save=True,
    )
    with mgr:
        mgr.save(3)
    states = {n: opt.cpu_state(p) for n, p in model.named_parameters()}
    fsdp = run_on_ranks(body_fsdp_save, 2, str(tmp_path / "fsdp"))[0]

    one_step, fsdp_step = tmp_path / "one/step-00000003", tmp_path / "fsdp/step-00000002"
    r = run_script(["-c", READER, str(one_step), str(fsdp_step), str(tmp_path)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"  # muon_ckpt never imported

    # dcp_to_torch_save: the step's keys at the top level, each extra object's state dict
    # nested under its key, every tensor whole.
    got = torch.load(tmp_path / "one.pt", weights_only=True)
    want: dict = {f"model.{k}": v for k, v in model.state_dict().items()}
    for fqn, st in states.items():
        want.update({f"optim.state.{fqn}.{k}": v for k, v in st.items()})
    fqns = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        names = [fqns[id(p)] for p in group["params"]]
        hparams = {k: v for k, v in group.items() if k not in ("params", "names")}
        want.update({f"optim.param_groups.{names[0]}.{k}": v for k, v in hparams.items()})
        want[f"optim.param_groups.{names[0]}.params"] = names
    want["extra.sched"] = sched.state_dict()
    want["rank_extra.0.data"] = {"batches": 7}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert json.dumps(got[k], sort_keys=True) == json.dumps(v, sort_keys=True), k

    fsdp_got = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    for name, v in fsdp.items():
        fqn, _, state = name.partition(":")
        key = f"optim.state.{fqn}.{state}" if state else f"model.{fqn}"
        assert torch.equal(fsdp_got[key], v), key
    assert fsdp_got["rank_extra.0.data"] == {"batches": 0}
    assert fsdp_got["rank_extra.1.data"] == {"batches": 1}

    # dcp.load into plain models: every tensor of their state dicts, bitwise.
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(plain["one"][k], v), k
    assert sorted(plain["fsdp"]) == sorted(k for k in fsdp if ":" not in k)
    for k, v in plain["fsdp"].items():
        assert torch.equal(v, fsdp[k]), k
