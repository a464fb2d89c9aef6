"""torchtitan, both ways: a torchtitan step (model, torch's Muon and AdamW in its
OptimizersContainer layout, lr scheduler, dataloader, train state) imports into a model and
our Muon bitwise; a step of ours exports to a torchtitan step that torchtitan's loader (a
strict ``dcp.load`` of what its objects' ``state_dict()`` ask for) resumes bitwise.

torchtitan 0.3 is not a test extra: it needs ``datasets<4.8``, which with transformers 5
(``huggingface-hub>=2.4``) takes fsspec and s3fs back to 2025.9 for the whole CI, and its
Trainer needs a GPU. So these tests build the steps as torchtitan's code writes and reads
them (tests/integrations/_titan.py names the code). The tests at the end run torchtitan itself (its
``CheckpointManager``, ``OptimizersContainer``, ``LRSchedulersContainer``, and our
``MuonCheckpointManager`` through its ``Config.build``, killed and resumed) where torchtitan
is installed (``pip install 'muon-ckpt[torchtitan]'``), and skip, saying why, where not.
"""

from __future__ import annotations

import importlib.util
import json
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp

from muon_ckpt import CheckpointManager, CheckpointMismatchError, CheckpointNotFoundError
from muon_ckpt.cli import main
from muon_ckpt.interop import export_torchtitan, import_torchtitan
from optim import Muon
from tests._dist import run_on_ranks, run_script
from tests.integrations._titan import (
    Holder,
    Tiny,
    flat_optimizer,
    is_matrix,
    loss_of,
    titan_state,
    torch_optimizers,
    train,
    write_titan_step,
)


def _muon(model: torch.nn.Module) -> Muon:
    named = list(model.named_parameters())
    return Muon(
        [
            {"params": [p for n, p in named if is_matrix(n, p)], "lr": 0.02},
            {"params": [p for n, p in named if not is_matrix(n, p)], "use_muon": False},
        ]
    )


def test_a_torchtitan_step_imports_into_muon_bitwise(tmp_path):
    src = Tiny(0)
    opts = torch_optimizers(src)
    train(src, opts, 3)
    folder = tmp_path / "titan"
    old = Tiny(7)
    write_titan_step(str(folder), 2, titan_state(old, {}, 2))
    write_titan_step(str(folder), 3, titan_state(src, flat_optimizer(opts), 3, ntokens=96))
    (folder / "step-4").mkdir()  # no .metadata: a save cut short, not a step (as torchtitan)

    model = Tiny(1)
    opt = _muon(model)
    opt.turn_on_cpu_offload()  # imported where the states are parked
    sched, ts = Holder({"last_epoch": 0}), Holder({"step": 0, "ntokens_seen": 0})
    rep = import_torchtitan(
        str(folder), model=model, optimizer=opt, states={"lr_scheduler": sched, "train_state": ts}
    )
    assert rep.source.endswith("step-3") and rep.step == 3
    assert rep.unused == ["dataloader"] and rep.states == ["lr_scheduler", "train_state"]
    assert rep.optimizer is not None and not rep.optimizer.fresh and not rep.optimizer.unused
    assert sched.value == {"last_epoch": 3} and ts.value == {"step": 3, "ntokens_seen": 96}
    torch_muon, adamw = opts
    for (name, p), q in zip(src.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
        got = opt.cpu_state(q)
        if is_matrix(name, p):
            assert torch.equal(got["momentum_buffer"], torch_muon.state[p]["momentum_buffer"])
        else:
            st = adamw.state[p]
            assert torch.equal(got["moment1"], st["exp_avg"]), name
            assert torch.equal(got["moment2"], st["exp_avg_sq"]), name
            assert torch.equal(got["step"], st["step"]), name

    # One step directory names that step; a model of other shapes changes nothing.
    again = Tiny(1)
    rep = import_torchtitan(str(folder / "step-2"), model=again)
    assert rep.source.endswith("step-2") and rep.optimizer is None and rep.step == 2
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), old.parameters()))
    wrong = Tiny(1)
    wrong.output = torch.nn.Linear(16, 31, bias=False)
    before = [p.clone() for p in wrong.parameters()]
    with pytest.raises(CheckpointMismatchError, match=r"'output.weight' has shape \(32, 16\)"):
        import_torchtitan(str(folder), model=wrong, optimizer=_muon(wrong))
    assert all(torch.equal(a, b) for a, b in zip(before, wrong.parameters()))
    with pytest.raises(CheckpointNotFoundError, match="no torchtitan step"):
        import_torchtitan(str(tmp_path), model=Tiny(1))


def _init_state(opt: torch.optim.Optimizer) -> None:
    """torchtitan's init_optim_state: a zero-gradient step at lr 0 creates the state."""
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def test_a_step_of_ours_exports_to_what_torchtitans_loader_reads(tmp_path):
    # What MuonCheckpointManager saves of a torchtitan run with torch's AdamW in its container.
    src = Tiny(0)
    adamw = torch.optim.AdamW(list(src.named_parameters()), lr=3e-3, weight_decay=0.1)
    train(src, [adamw], 4)
    url = str(tmp_path / "run")
    with CheckpointManager(
        url,
        model=src,
        optimizer=adamw,
        extra={"lr_scheduler": Holder({"last_epoch": 4})},
        rank_extra={
            "train_state": Holder({"step": 4, "ntokens_seen": 128}),
            "dataloader": Holder({"dp_rank_0": b"position", "world_size": 1}),
        },
    ) as mgr:
        mgr.save(4)
    folder = tmp_path / "titan"
    assert main(["export", url, "--torchtitan", str(folder), "--json"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["step-4"]

    # torchtitan's loader: dcp.load (its default planner: every key asked for must be there)
    # of what ModelWrapper, OptimizersContainer, LRSchedulersContainer, the dataloader and
    # the Trainer return from state_dict(), the model's keys at the top level.
    dst = Tiny(1)
    dst_opt = torch.optim.AdamW(list(dst.named_parameters()), lr=3e-3, weight_decay=0.1)
    _init_state(dst_opt)
    want = titan_state(dst, flat_optimizer([dst_opt]), 0)
    want["dataloader"] = {"dp_rank_0": b"", "world_size": 0}
    dcp.load(want, checkpoint_id=str(folder / "step-4"), no_dist=True)
    for name, p in src.state_dict().items():
        assert torch.equal(want[name], p), name
    ref = flat_optimizer([adamw])
    assert want["optimizer"].keys() == ref.keys()
    for key, value in ref.items():
        got = want["optimizer"][key]
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key
    assert want["lr_scheduler"] == {"last_epoch": 4}
    assert want["train_state"] == {"step": 4, "ntokens_seen": 128}
    assert want["dataloader"] == {"dp_rank_0": b"position", "world_size": 1}

    # The step is torchtitan's: import_torchtitan reads it back too; a second export of the
    # same step is refused (torchtitan's own step stays as it is).
    back = Tiny(2)
    assert import_torchtitan(str(folder), model=back).model == sorted(src.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(back.parameters(), src.parameters()))
    with pytest.raises(FileExistsError, match="already holds a torchtitan step"):
        export_torchtitan(url, str(folder))


def test_a_muon_step_exports_with_torch_state_names_and_model_only(tmp_path, capsys):
    model = Tiny(0)
    opt = _muon(model)
    for step in range(2):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    url = str(tmp_path / "run")
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        mgr.save(2)
    s = export_torchtitan(url, str(tmp_path / "titan"))
    assert s.defaults == {"train_state.step": 2, "train_state.ntokens_seen": 0}
    assert s.sections == ["model", "optimizer", "train_state"]
    named = dict(model.named_parameters())
    want = {
        f"optimizer.state.{n}.momentum_buffer": opt.state[p]["momentum_buffer"]
        for n, p in named.items()
        if is_matrix(n, p)
    }
    want.update(
        {
            f"optimizer.state.{n}.exp_avg": opt.state[p]["moment1"]
            for n, p in named.items()
            if not is_matrix(n, p)
        }
    )
    want["optimizer.param_groups.norm.weight.betas"] = None
    want["optimizer.param_groups.layers.0.attention.wq.weight.use_muon"] = None
    got = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in want.items()}
    dcp.load(got, checkpoint_id=s.step_dir, no_dist=True)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
    assert got["optimizer.param_groups.norm.weight.betas"] == opt.param_groups[1]["adamw_betas"]
    assert got["optimizer.param_groups.layers.0.attention.wq.weight.use_muon"] is True

    # Weights only, for torchtitan's initial_load_path (initial_load_model_only).
    capsys.readouterr()
    out = str(tmp_path / "weights")
    assert main(["export", url, "--torchtitan", out, "--include", "model", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sections"] == ["model"] and doc["defaults"] == {}
    sd = Tiny(3).state_dict()
    dcp.load(sd, checkpoint_id=doc["out"], no_dist=True)
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    assert main(["export", url, "--torchtitan", out, "--include", "model", "optim"]) == 1
    assert "every section, or with --include model" in capsys.readouterr().err


# ------------------------------------------------ resuming on another number of ranks


def _titan_steps(rank: int, world: int, url: str, until: int) -> dict:
    """MuonCheckpointManager's state and load (``_titan_state``, torchtitan's names) around
    a loop of torchtitan's kind: resume, then train and save each step up to ``until``.
    Every rank trains on the same batches (plain tensors, DDP-like), counting its own
    tokens; the dataloader's position is each rank's own."""
    from muon_ckpt.integrations._titan_state import load_titan, titan_manager

    model = Tiny(0)
    opt = _muon(model)
    sched = Holder({"last_epoch": 0})
    train_state = Holder({"step": 0, "ntokens_seen": 0})
    loader = Holder({"rank": rank, "position": 0})
    states = {"lr_scheduler": sched, "train_state": train_state}
    mgr = titan_manager(
        url, model=model, optimizer=opt, lr_schedulers=sched, states=states, dataloader=loader
    )
    loaded = load_titan(mgr, None, states)
    began = dict(train_state.value)
    for step in range(train_state.value["step"] + 1, until + 1):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
        sched.value = {"last_epoch": step}
        tokens = train_state.value["ntokens_seen"] + 32 * (rank + 1)
        train_state.value = {"step": step, "ntokens_seen": tokens}
        loader.value = {"rank": rank, "position": loader.value["position"] + 1}
        mgr.save(step)
    mgr.close()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"loaded": loaded, "began": began, "loader": loader.value, "params": params}


def test_a_run_saved_on_two_ranks_resumes_on_one_at_its_step(tmp_path, caplog):
    """torchtitan's checkpointer (its logic, without torchtitan) resumes a step saved on 2
    gloo ranks on 1: model, optimizer and lr scheduler bitwise, the train state at the step
    loaded; each rank's token count and dataloader position fresh, with a WARNING."""
    url = str(tmp_path / "run")
    run_on_ranks(_titan_steps, 2, url, 3)
    with caplog.at_level("WARNING", logger="muon_ckpt"):
        got = _titan_steps(0, 1, url, 5)
    assert got["loaded"] == 3 and got["began"] == {"step": 3, "ntokens_seen": 0}
    assert got["loader"] == {"rank": 0, "position": 2}  # fresh at the resume: 2 steps since
    assert "the train state resumes at step 3" in caplog.text
    ref = _titan_steps(0, 1, str(tmp_path / "ref"), 5)  # one process, uninterrupted
    for name, p in ref["params"].items():
        assert torch.equal(got["params"][name], p), name


# --------------------------------------------------------------------- torchtitan itself

_NO_TITAN = importlib.util.find_spec("torchtitan") is None
_WHY = (
    "torchtitan is not installed: not a test extra (its datasets<4.8 would take fsspec and "
    "s3fs back to 2025.9 beside transformers 5); pip install 'muon-ckpt[torchtitan]'"
)


def _job(*args: str):
    r = run_script(["-m", "tests.integrations._titan_job", *args], timeout=240)
    return r


@pytest.mark.skipif(_NO_TITAN, reason=_WHY)
def test_torchtitans_checkpointer_resumes_our_export_and_we_import_its_step(tmp_path):
    r = _job("interop", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "interop: OK"


@pytest.mark.skipif(_NO_TITAN, reason=_WHY)
def test_muon_checkpoint_manager_killed_after_a_save_resumes_bitwise(tmp_path):
    r = _job("train", str(tmp_path / "ref"), str(tmp_path / "ref.pt"))
    assert r.returncode == 0, r.stderr
    run = str(tmp_path / "run")
    r = _job("train", run, str(tmp_path / "killed.pt"), "--kill-at", "8")
    assert r.returncode == -signal.SIGKILL, r.stderr
    r = _job("train", run, str(tmp_path / "resumed.pt"))
    assert r.returncode == 0, r.stderr
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    got = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert ref["loaded"] is None and got["loaded"] == 6
    assert got["losses"] == ref["losses"][6:]  # the steps after the resumed one, bitwise
    assert got["train_state"] == ref["train_state"] and got["last_epoch"] == ref["last_epoch"]
    assert got["steps"] == ref["steps"] == [9, 10]  # keep_latest_k=2, the last step saved
    for name, p in ref["params"].items():
        assert torch.equal(got["params"][name], p), name
        for k, v in ref["states"][name].items():
            assert torch.equal(got["states"][name][k], v), (name, k)
