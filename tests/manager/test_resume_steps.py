"""The resume contract, which step a load takes: without ``step`` it falls back past every
damaged step to the newest that loads, a rewind abandons the newer line (and retention counts
the new one); steps are any integral; ``resume_from`` has its own storage options; a run in
one process logs its commits, retention and loads at INFO, with no torch warning.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointCorruptError, CheckpointManager
from muon_ckpt.store import Storage
from tests._ckpt import make_muon
from tests._dist import run_script
from tests.conftest import assert_same, tiny_run, tiny_snapshot, tiny_train
from tests.manager._resume import Records, flip_byte_in, largest_file


# ---------------------------------------------------------------------- fallback
def test_load_without_step_falls_back_past_every_damaged_step(tmp_path):
    url = str(tmp_path / "run")
    model, opt = tiny_run()
    mgr = CheckpointManager(url, model=model, optimizer=opt)
    snaps = {}
    for s in (1, 2, 3):
        tiny_train(model, opt, 1, seed=s)
        mgr.save(s)
        snaps[s] = tiny_snapshot(model, opt)
    st = Storage(url)
    st.rm("step-00000003", ".metadata")  # found by the manifest check, before any read
    flip_byte_in(st, "step-00000002", largest_file(st, "step-00000002"))  # found by the read
    model2, opt2 = tiny_run(seed=4)
    with Records() as rec:
        got = CheckpointManager(url, model=model2, optimizer=opt2).load()
    assert got == 1
    assert_same(tiny_snapshot(model2, opt2), snaps[1])
    warned = "\n".join(rec.at(logging.WARNING))
    assert "skipping step 3" in warned and ".metadata" in warned
    assert "skipping step 2" in warned and "crc32" in warned
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata"):
        CheckpointManager(url, model=model2, optimizer=opt2).load(step=3)  # never falls back
    st.rm("step-00000001", ".metadata")
    with pytest.raises(CheckpointCorruptError, match=r"no committed step loads cleanly.*step 3"):
        CheckpointManager(url, model=model2, optimizer=opt2).load()
    assert_same(tiny_snapshot(model2, opt2), snaps[1])


# ---------------------------------------------------------------------- rewind
def _run_to(url: str, mgr_kw: dict, start: int, stop: int, *, resume_step=None, crash_at=None):
    """A training process: build, load (``resume_step`` or auto), train start..stop with a save
    per step (the manager's interval decides); returns (model, opt, loaded step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    named = list(model.named_parameters())
    opt = make_muon(model)
    mgr = CheckpointManager(url, model=model, optimizer=opt, **mgr_kw)
    loaded = mgr.load(resume_step)
    first = (loaded or start - 1) + 1
    for step in range(first, stop + 1):
        g = torch.Generator().manual_seed(step)
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        if crash_at == step:
            return model, opt, loaded  # killed before saving this step
        mgr.save(step)
    return model, opt, loaded


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_rewind_abandons_the_newer_line(tmp_path):
    url, ref_url = str(tmp_path / "run"), str(tmp_path / "ref")
    kw = {"interval": 5, "keep_last": 2}
    _run_to(url, kw, 1, 20)
    assert CheckpointManager(url).steps() == [15, 20]
    # Rewind to 15 and train on; killed at 22 (after the new line saved 20).
    with Records() as rec:
        _, _, loaded = _run_to(url, kw, 1, 25, resume_step=15, crash_at=22)
    assert loaded == 15
    assert any("abandoned line" in m and "[20]" in m for m in rec.at(logging.WARNING))
    assert CheckpointManager(url).steps() == [15, 20]  # 15 kept: retention counts this line
    # Auto-resume: the new line's 20, and at 25 the same as an uninterrupted rewound run.
    model, _, loaded = _run_to(url, kw, 1, 25)
    assert loaded == 20
    _run_to(ref_url, {"interval": 5}, 1, 15)
    ref, _, _ = _run_to(ref_url, {"interval": 5}, 1, 25, resume_step=15)
    assert_same(_params(model), _params(ref))
    assert CheckpointManager(url).steps() == [20, 25]


# ---------------------------------------------------------------------- small contracts
def test_steps_accept_any_integral(tmp_path):
    model, opt = tiny_run()
    mgr = CheckpointManager(str(tmp_path / "run"), model=model, optimizer=opt)
    assert mgr.save(np.int64(3)) and mgr.save(torch.tensor(4))
    assert mgr.load(np.int32(3)) == 3 and mgr.load(torch.tensor(4)) == 4
    with pytest.raises(ValueError, match=r"step must be an integer >= 0, got 2\.5"):
        mgr.save(2.5)


def test_resume_from_has_its_own_storage_options(tmp_path, s3_bucket):
    bucket, opts = s3_bucket
    model, opt = tiny_run()
    tiny_train(model, opt, 1)
    CheckpointManager(f"s3://{bucket}/base", model=model, optimizer=opt, storage_options=opts).save(
        1
    )
    model2, opt2 = tiny_run(seed=1)
    mgr = CheckpointManager(
        str(tmp_path / "finetune"),
        model=model2,
        optimizer=opt2,
        resume_from=f"s3://{bucket}/base",
        resume_storage_options=opts,
    )
    assert mgr.load() == 1
    assert_same(tiny_snapshot(model2, opt2), tiny_snapshot(model, opt))


def test_info_logs_and_no_torch_warning_in_one_process(tmp_path):
    url = str(tmp_path / "run")
    script = f"""
import logging, torch
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
from muon_ckpt import CheckpointManager
from tests.conftest import tiny_run, tiny_train
model, opt = tiny_run()
mgr = CheckpointManager({url!r}, model=model, optimizer=opt, keep_last=1)
for s in (1, 2):
    tiny_train(model, opt, 1)
    mgr.save(s)
mgr.load()
"""
    r = run_script(["-c", script])
    assert r.returncode == 0, r.stderr
    err = r.stderr
    assert "torch.distributed is disabled" not in err and "Warning" not in err, err
    assert "INFO muon_ckpt committed step 2" in err and "bytes, written in" in err
    assert "INFO muon_ckpt retention (keep_last=1) deleted steps [1]" in err
    assert "INFO muon_ckpt loaded step 2" in err
