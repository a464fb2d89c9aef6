"""A manifest that reads damaged is no proof of damage either: an HTTP
proxy (``tests/_faults.py``) between s3fs and moto flips the first byte of step 3's
``manifest.json`` in the responses, while the store holds it intact. ``load()`` falls back to
step 2, and the save after it retires step 3 from the line (lines never mix) but keeps its
files, or takes its place when it saves step 3 again. Before, a fault that passed (two
responses) made the save of step 3 fail as "already committed" and a save of step 4 commit a
new line beside the old line's step 3; a fault that stayed (a caching proxy serving a damaged
copy) made the save delete step 3; and a save that failed after the load left it unretired."""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointManager, CheckpointStorageError
from muon_ckpt.cli import main
from muon_ckpt.store import MANIFEST, Catalog, Storage, resolve, step_dirname, verify
from tests._faults import FaultProxy
from tests.conftest import s3_options

STEP3 = r"/step-00000003/manifest\.json$"


def _model(v: float) -> nn.Module:
    m = nn.Linear(8, 4)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(v)
    return m


def _set(model: nn.Module, v: float) -> None:
    model.load_state_dict(_model(float(v)).state_dict())


def _holds(model: nn.Module, v: float) -> bool:
    return all(torch.equal(p, torch.full_like(p, v)) for p in model.parameters())


@pytest.fixture
def run(s3_server: str, s3_bucket: tuple[str, dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Steps 1, 2 and 3 (every value the step's number) in a url on moto; the options that
    reach it through the fault proxy (``through``) and directly."""
    proxy = FaultProxy(s3_server, seed=49).start()
    bucket, direct = s3_bucket
    url = f"s3://{bucket}/run-{uuid.uuid4().hex[:6]}"
    model = _model(0.0)
    with CheckpointManager(url, model=model, storage_options=direct) as mgr:
        for s in (1, 2, 3):
            _set(model, s)
            mgr.save(s)
    through = {**s3_options(proxy.url), "config_kwargs": {"retries": {"max_attempts": 2}}}
    try:
        yield {"url": url, "proxy": proxy, "through": through, "direct": direct}
    finally:
        proxy.stop()


def _mgr(r: dict[str, Any], model: nn.Module, how: str = "through", **kw: Any) -> Any:
    return CheckpointManager(r["url"], model=model, storage_options=r[how], **kw)


def _cli(capsys: Any, r: dict[str, Any], *args: str, how: str = "direct") -> str:
    opts = [f"--storage-option={k}={json.dumps(v)}" for k, v in r[how].items()]
    main([*args, r["url"], *opts])
    return capsys.readouterr().out


@pytest.mark.parametrize("then", [3, 4])
def test_a_manifest_read_fault_neither_blocks_its_step_nor_mixes_lines(run, then, caplog):
    """Two responses of step 3's manifest damaged: the load resumes step 2. Saving step 3
    again takes the place of the step passed over; saving step 4 retires it but keeps it
    (intact: ``verify`` passes it). Either way a restart resumes the step just saved."""
    st = Storage(run["url"], run["direct"])
    run["proxy"].rule("GET", STEP3, "corrupt_unchecked_response", times=2, at=0)
    model = _model(-1.0)
    mgr = _mgr(run, model)
    assert mgr.load() == 2 and _holds(model, 2.0)
    assert run["proxy"].injected == {"corrupt_unchecked_response": 2}
    _set(model, 10 + then)
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        assert mgr.save(then)
    mgr.close()
    infos = {i.step: i for i in Catalog(st).scan()}
    assert [s for s, i in infos.items() if i.committed] == [1, 2, then]
    if then == 4:
        assert infos[3].status == "superseded" and "manifest" in (infos[3].passed_over or "")
        assert verify(resolve(st, 3)).ok
    assert ("which takes its place" if then == 3 else "its files are kept") in caplog.text
    fresh = _model(-1.0)
    assert _mgr(run, fresh, "direct").load() == then and _holds(fresh, 10 + then)  # one line


def test_a_step_whose_manifest_keeps_reading_damaged_is_kept_until_it_ages_out(run, capsys):
    """Every response of step 3's manifest damaged (a caching proxy serving a bad copy): the
    load resumes step 2 and the saves after it keep step 3 (passed over, listed again by each
    commit while it cannot be read); ``ls`` says so through the proxy and directly, ``verify``
    finds it intact, no restart resumes it, and retention (keep_last=3) deletes it with the
    steps of its age."""
    st = Storage(run["url"], run["direct"])
    mine = (step_dirname(3) + "/", f"data/{Catalog(st).manifest(3).data}/")
    before = {k: v for k, v in st.walk_files().items() if k.startswith(mine)}
    assert len(before) >= 4, before  # the manifest, .metadata and the data files
    run["proxy"].rule("GET", STEP3, "corrupt_unchecked_response", at=0)
    model = _model(-1.0)
    mgr = _mgr(run, model, keep_last=3)
    assert mgr.load() == 2
    for s in (4, 5):
        _set(model, s)
        assert mgr.save(s)
    assert before.items() <= st.walk_files().items()  # step 3's files, as they were
    assert [p[0] for p in Catalog(st).manifest(5).passed_over] == [3]
    for how in ("through", "direct"):
        out = _cli(capsys, run, "ls", how=how)
        assert re.search(r"^\s+3\s+PASSED-OVER\s", out, re.M), out
        assert "3 committed, 1 passed over" in out, out
        fresh = _model(-1.0)
        assert _mgr(run, fresh, how).load() == 5 and _holds(fresh, 5.0)
    out = _cli(capsys, run, "verify")
    assert "step 3: OK, intact on the storage (the load met a read fault)" in out, out
    mgr.save(6)
    mgr.close()
    assert Catalog(st).committed_steps() == [4, 5, 6]
    assert not st.exists(step_dirname(3), MANIFEST)


def test_a_failed_save_after_the_fallback_still_retires_and_keeps_the_step(run):
    """The first save after the load fails (its manifest's PUT answers 500 each time); the
    next one retires step 3 (still unreadable) and keeps it, so once it reads again no
    restart resumes it."""
    st = Storage(run["url"], run["direct"])
    proxy = run["proxy"]
    proxy.rule("GET", STEP3, "corrupt_unchecked_response", at=0)
    model = _model(-1.0)
    mgr = _mgr(run, model, storage_timeout=0.5)
    assert mgr.load() == 2
    _set(model, 4)
    proxy.rule("PUT", r"/step-00000004/manifest\.json", "500")
    with pytest.raises(CheckpointStorageError):
        mgr.save(4)
    proxy.rules.pop()
    assert mgr.save(4)
    mgr.close()
    proxy.clear()
    (three,) = [i for i in Catalog(st).scan() if i.step == 3]
    assert three.status == "superseded" and three.passed_over is not None, three
    fresh = _model(-1.0)
    assert _mgr(run, fresh, "direct").load() == 4 and _holds(fresh, 4.0)
