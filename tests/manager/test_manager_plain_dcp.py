"""A checkpoint is readable by plain torch.distributed.checkpoint, without muon_ckpt: a fresh
interpreter that never imports it finds the documented keys and loads their values."""

from __future__ import annotations

import json
import textwrap

import torch

from muon_ckpt import CheckpointManager
from tests._dist import run_script
from tests.conftest import tiny_run, tiny_train

READER = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed.checkpoint as dcp

    path = sys.argv[1]
    md = dcp.FileSystemReader(path).read_metadata()
    keys = sorted(md.state_dict_metadata)
    sd = {
        "model.first.weight": torch.empty(6, 4),
        "optim.state.first.weight.momentum_buffer": torch.empty(6, 4),
        "optim.state.first.bias.moment2": torch.empty(6),
        "optim.state.first.bias.step": torch.empty(()),
        "optim.param_groups.first.weight.lr": 0.0,
        "optim.param_groups.first.bias.adamw_betas": None,
        "optim.param_groups.first.weight.params": None,
        "extra.sched.last_epoch": 0,
    }
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    print(json.dumps({
        "keys": keys,
        "muon_ckpt_imported": any(m.startswith("muon_ckpt") for m in sys.modules),
        "sums": {k: float(v.double().sum()) for k, v in sd.items() if torch.is_tensor(v)},
        "values": {k: v for k, v in sd.items() if not torch.is_tensor(v)},
    }))
    """
)


def test_plain_dcp_reads_the_documented_keys(tmp_path):
    model, opt = tiny_run()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        tiny_train(model, opt, 1)
        sched.step()
    CheckpointManager(str(tmp_path), model=model, optimizer=opt, extra={"sched": sched}).save(2)

    out = run_script(["-c", READER, str(tmp_path / "step-00000002")], timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["muon_ckpt_imported"] is False
    keys = set(got["keys"])
    for fqn, p in model.named_parameters():
        assert f"model.{fqn}" in keys
        for k in opt.state[p]:
            assert f"optim.state.{fqn}.{k}" in keys
    # Hyperparameters once per group, under its first param's FQN, with the group's FQNs.
    for lead in ("first.weight", "first.bias"):
        for h in ("lr", "weight_decay", "use_muon", "momentum", "params"):
            assert f"optim.param_groups.{lead}.{h}" in keys
    assert "extra.sched.last_epoch" in keys
    assert not any(k.startswith("optim.state.0") for k in keys), "keys are FQNs, not positions"

    named = dict(model.named_parameters())
    w, b = named["first.weight"], named["first.bias"]
    want = {
        "model.first.weight": w.double().sum().item(),
        "optim.state.first.weight.momentum_buffer": opt.state[w]["momentum_buffer"].double().sum(),
        "optim.state.first.bias.moment2": opt.state[b]["moment2"].double().sum().item(),
        "optim.state.first.bias.step": 2.0,
    }
    for k, v in want.items():
        assert got["sums"][k] == float(v), k
    assert got["values"]["optim.param_groups.first.weight.lr"] == opt.param_groups[0]["lr"]
    assert got["values"]["optim.param_groups.first.bias.adamw_betas"] == [0.9, 0.95]
    assert got["values"]["optim.param_groups.first.weight.params"] == [
        "first.weight",
        "second.weight",
    ]
    assert got["values"]["extra.sched.last_epoch"] == 2
