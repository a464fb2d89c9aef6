"""No silent optimizer change: a checkpoint records, per parameter, the update rule that ran
(Muon with its Newton-Schulz method and dtype, or AdamW: ``Muon.update_rule``), and a strict
load into an optimizer that would update a parameter by another rule raises
``CheckpointMismatchError`` naming the parameters and how to accept the change; nothing is
read. ``strict=False`` loads and reports the change. Hyperparameters are no change, and a
checkpoint saved before the record existed keeps loading with the rule it ran."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from muon_ckpt import CheckpointManager, CheckpointMismatchError
from tests import REPO
from tests._ckpt import TinyNet, train

FIXTURE = os.path.join(REPO, "tests", "fixtures", "v1_crc32")


def _muon(model, *, adamw=(), muon=(), **mat_kw):
    """Muon on TinyNet: the matrices fc1/fc2 by Muon, the rest by AdamW; ``adamw`` names
    matrices moved to the AdamW group, ``muon`` other params moved into Muon's."""
    from optim import Muon

    mats, rest = [], []
    for n, p in model.named_parameters():
        into_muon = (p.ndim == 2 and not n.startswith("emb") and n not in adamw) or n in muon
        (mats if into_muon else rest).append((n, p))
    kw = {"ns_method": "standard", "ns_dtype": "fp32", **mat_kw}
    return Muon(
        [
            {"params": [p for _, p in mats], "names": [n for n, _ in mats], "lr": 0.02, **kw},
            {
                "params": [p for _, p in rest],
                "names": [n for n, _ in rest],
                "use_muon": False,
                "lr": 1e-3,
            },
        ]
    )


def _net():
    """TinyNet with matrices of aspect ratio 3 (12x4, 4x12): the Gram iteration runs on them
    where a group asks for it."""
    return TinyNet(dim=4)


def _saved(url, **kw):
    torch.manual_seed(0)
    model = _net()
    opt = _muon(model, **kw)
    train(model, opt, 2, seed=1)
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        mgr.save(2)
    return mgr.step_info(2)


def _state(model, opt):
    return [p.detach().clone() for p in model.parameters()] + [
        v.clone() for st in opt.state.values() for v in st.values()
    ]


@pytest.mark.parametrize(
    ("saved", "loaded", "shown"),
    [
        (
            {},
            {"adamw": ("fc2.weight",)},
            "'fc2.weight': saved muon(ns_method=standard, ns_dtype=fp32), here adamw",
        ),
        ({}, {"muon": ("emb.weight",)}, "'emb.weight': saved adamw, here muon(ns_method="),
        (
            {"ns_method": "gram"},
            {"ns_method": "standard"},
            "'fc1.weight': saved muon(ns_method=gram, ns_dtype=fp32), here "
            "muon(ns_method=standard, ns_dtype=fp32)",
        ),
        (
            {},
            {"ns_dtype": "bf16"},
            "'fc1.weight': saved muon(ns_method=standard, ns_dtype=fp32), here "
            "muon(ns_method=standard, ns_dtype=bf16)",
        ),
    ],
    ids=["muon-to-adamw", "adamw-to-muon", "ns-method", "ns-dtype"],
)
def test_a_strict_load_under_another_update_rule_is_refused_naming_the_params(
    tmp_path, saved, loaded, shown
):
    url = str(tmp_path / "run")
    _saved(url, **saved)
    torch.manual_seed(1)
    model = _net()
    opt = _muon(model, **loaded)
    train(model, opt, 1, seed=5)
    before = _state(model, opt)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with (
        CheckpointManager(url, model=model, optimizer=opt) as mgr,
        pytest.raises(CheckpointMismatchError) as e,
    ):
        mgr.load()
    msg = str(e.value)
    assert shown in msg, msg
    assert "would be updated by another rule than when the checkpoint was saved" in msg
    assert "load(strict=False)" in msg and "last_load_report.rules" in msg
    # Nothing read: parameters, states and groups as they were.
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, opt), strict=True))
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


def test_strict_false_loads_reports_the_change_and_keeps_this_optimizers_rule(tmp_path):
    url = str(tmp_path / "run")
    _saved(url)
    model = _net()
    opt = _muon(model, adamw=("fc2.weight",))
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        assert mgr.load(strict=False) == 2
        report = mgr.last_load_report
    assert report.rules == [
        ("fc2.weight", "muon(ns_method=standard, ns_dtype=fp32)", "adamw"),
    ]
    assert "update rule changed: fc2.weight" in report.summary()
    assert str(opt.update_rule(model.fc2.weight)) == "adamw"
    assert str(opt.update_rule(model.fc1.weight)) == "muon(ns_method=standard, ns_dtype=fp32)"
    train(model, opt, 1, seed=3)


def test_the_manifest_records_each_params_rule_and_hyperparameters_are_no_change(tmp_path):
    url = str(tmp_path / "run")
    _saved(url)
    from muon_ckpt.store import open_storage, resolve

    rules = resolve(open_storage(url), 2).manifest.extra["update_rules"]
    assert rules["fc1.weight"] == "muon(ns_method=standard, ns_dtype=fp32)"
    assert rules["fc1.bias"] == rules["emb.weight"] == "adamw"
    model = _net()
    opt = _muon(model)
    opt.param_groups[0]["lr"] = 0.5  # another lr, as a schedule sets it: no change of rule
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        assert mgr.load() == 2
        assert not mgr.last_load_report
    assert opt.param_groups[0]["lr"] == 0.02  # back with the state, as torch's load does


def test_a_checkpoint_without_a_record_loads_with_the_rule_it_ran(tmp_path):
    """muon-ckpt 0.2's step (tests/fixtures/v1_crc32) records no rule and no ns_method or
    ns_dtype: it loads into a Muon that asks for others, and goes on with what those versions
    ran (Newton-Schulz in bf16, the standard iteration), not this optimizer's choice."""
    url = str(tmp_path / "v1")
    shutil.copytree(FIXTURE, url)
    model = TinyNet()
    opt = _muon(model, ns_method="gram", ns_dtype="fp32")
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        assert mgr.load() == 2
    assert str(opt.update_rule(model.fc1.weight)) == "muon(ns_method=standard, ns_dtype=bf16)"
    train(model, opt, 1, seed=3)


def _torch(kind):
    def make(model):
        if kind == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.95, nesterov=True)
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    return make


@pytest.mark.parametrize(
    ("kind", "here"), [("sgd", "torch.optim.SGD"), ("adamw", "torch.optim.AdamW")]
)
def test_a_muon_checkpoint_is_refused_by_an_optimizer_that_reports_no_rule(tmp_path, kind, here):
    """Muon's step into torch's SGD (momentum) or AdamW: every Muon matrix would change rule;
    a strict load says so (not a key mismatch) and reads nothing; strict=False loads what
    fits and reports the change."""
    url = str(tmp_path / "run")
    _saved(url)
    model = _net()
    opt = _torch(kind)(model)
    before = _state(model, opt)
    with (
        CheckpointManager(url, model=model, optimizer=opt) as mgr,
        pytest.raises(CheckpointMismatchError) as e,
    ):
        mgr.load()
    msg = str(e.value)
    assert f"'fc1.weight': saved muon(ns_method=standard, ns_dtype=fp32), here {here}" in msg
    assert "load(strict=False)" in msg and "renamed" not in msg, msg
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, opt), strict=True))
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        assert mgr.load(strict=False) == 2
        changed = {f: h for f, _, h in mgr.last_load_report.rules}
    assert changed["fc1.weight"] == changed["fc2.weight"] == here


def test_another_optimizers_checkpoint_is_refused_by_muon(tmp_path):
    """torch SGD's step (no record) into Muon: every param would change rule; a strict load
    refuses it naming the saved type, strict=False loads it and reports the change."""
    url = str(tmp_path / "run")
    torch.manual_seed(0)
    model = _net()
    opt = _torch("sgd")(model)
    train(model, opt, 2, seed=1)
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        mgr.save(2)
    model = _net()
    opt = _muon(model)
    with (
        CheckpointManager(url, model=model, optimizer=opt) as mgr,
        pytest.raises(CheckpointMismatchError) as e,
    ):
        mgr.load()
    msg = str(e.value)
    assert "'fc1.weight': saved torch.optim.SGD, here muon(ns_method=standard" in msg, msg
    assert "load(strict=False)" in msg
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        assert mgr.load(strict=False) == 2
        changed = {f: s for f, s, _ in mgr.last_load_report.rules}
    assert changed["fc1.weight"] == "torch.optim.SGD"
    assert str(opt.update_rule(model.fc1.weight)) == "muon(ns_method=standard, ns_dtype=fp32)"
    train(model, opt, 1, seed=3)
