"""Races of the command line against a training job, with real processes on real storage: a child process saves back to back while this one runs
``muon-ckpt prune`` or ``muon-ckpt verify`` over and over.

``prune`` must never collide with a writer (it takes the run's write lease: refused, naming the
holder, while a job holds it; a save that meets a prune waits for it), and every save still
succeeds. ``verify`` must report a step that retention deletes under it as deleted, never as
damaged, and never fail with a raw error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointLeaseError, CheckpointManager
from muon_ckpt.cli import main
from muon_ckpt.store import LEASE, Catalog, Storage, prune, resolve, verify
from muon_ckpt.store._identity import identity
from tests._dist import _context

RACE_SECONDS = float(os.environ.get("MUON_CKPT_RACE_SECONDS", "6"))
_MAX_SECONDS = 120.0 + RACE_SECONDS


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])  # 4 layers: several items


def child_save_until(url: str, opts: dict, stop: str, per_manager: int, keep_last: int) -> None:
    """Save steps 1, 2, 3, ... until ``stop`` exists; a manager makes ``per_manager`` saves,
    then closes (giving the lease back, as a job that ends does) and the next one resumes.
    Writes ``{"saves": n, "errors": [...]}`` to ``stop + ".json"``."""
    torch.set_num_threads(1)
    model = _model()
    saves, errors, step = 0, [], 0
    deadline = time.monotonic() + _MAX_SECONDS
    while not os.path.exists(stop) and time.monotonic() < deadline:
        mgr = CheckpointManager(
            url, model=model, storage_options=opts, keep_last=keep_last, io_threads=2
        )
        mgr.load()  # the next manager resumes the run
        try:
            for _ in range(per_manager):
                if os.path.exists(stop):
                    break
                step += 1
                try:
                    mgr.save(step)
                    saves += 1
                except Exception as e:  # every failure is recorded: none is expected
                    errors.append(f"step {step}: {type(e).__name__}: {e}")
                    errors.append("".join(traceback.format_exception(e))[-3000:])
        finally:
            mgr.close()
    with open(stop + ".json", "w") as f:
        json.dump({"saves": saves, "errors": errors}, f)


class _Saver:
    """A child process saving back to back (``child_save_until``) while the test races it."""

    def __init__(self, url: str, opts: dict, tmp_path: Any, *, per_manager: int, keep_last: int):
        self.stop = str(tmp_path / "stop")
        self.proc = _context().Process(
            target=child_save_until,
            args=(url, opts, self.stop, per_manager, keep_last),
            daemon=True,
        )
        self.proc.start()
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def racing(self, enough: bool) -> bool:
        """Whether the race goes on: for RACE_SECONDS, then until ``enough`` (both sides of
        the race were seen; on a loaded machine that takes longer), at most _MAX_SECONDS."""
        assert self.proc.is_alive(), f"the saving process exited with {self.proc.exitcode}"
        elapsed = time.monotonic() - self.started
        return elapsed < RACE_SECONDS or (not enough and elapsed < _MAX_SECONDS)

    def result(self) -> dict:
        open(self.stop, "w").close()
        self.proc.join(120)
        assert self.proc.exitcode == 0, f"the saving process exited with {self.proc.exitcode}"
        with open(self.stop + ".json") as f:
            return json.load(f)


def _url(backend: str, tmp_path: Any, request: pytest.FixtureRequest) -> tuple[str, dict, list]:
    if backend == "s3":
        bucket, opts = request.getfixturevalue("s3_bucket")
        flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
        return f"s3://{bucket}/run", opts, flags
    return str(tmp_path / "run"), {}, []


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_prune_while_a_job_saves_never_fails_a_save(backend, tmp_path, request, capsys):
    url, opts, flags = _url(backend, tmp_path, request)
    saver = _Saver(url, opts, tmp_path, per_manager=4, keep_last=3)
    pruned = refused = 0
    others: list[str] = []
    while saver.racing(enough=pruned > 0 and refused > 0):
        rc, got, err = _cli(capsys, "prune", url, "--keep", "1", "--json", *flags)
        if "no run at" in err:
            continue  # before the job's first save (no step directory yet)
        if rc == 0:
            pruned += bool(json.loads(got)["deleted"])
        elif "CheckpointLeaseError" in err and "another job holds" in err:
            refused += 1  # the job holds the lease: refused, naming it
            assert f"pid {saver.pid}" in err, err
        else:
            others.append(err)
    res = saver.result()
    assert res["errors"] == [], res["errors"][:4]
    assert others == [], others[:3]
    # Both sides of the race happened: prunes refused by a live job, and prunes that deleted.
    assert pruned > 0 and refused > 0, (pruned, refused)
    steps = CheckpointManager(url, storage_options=opts).steps()
    assert steps and steps[-1] == res["saves"]  # every save counted is committed, newest last


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_verify_during_retention_reports_deleted_steps_not_damage(
    backend, tmp_path, request, capsys
):
    url, opts, flags = _url(backend, tmp_path, request)
    saver = _Saver(url, opts, tmp_path, per_manager=10**6, keep_last=1)
    runs = 0
    statuses: set[str] = set()
    bad: list[str] = []
    while saver.racing(enough=runs >= 3):
        rc, got, err = _cli(capsys, "verify", url, "--json", *flags)
        if "no checkpoint at" in err or "no committed step" in err:
            continue  # before the first commit
        if rc != 0 or err:
            bad.append(f"rc {rc}: {err.strip()} {got.strip()[:2000]}")
            continue
        runs += 1
        statuses |= {s["status"] for s in json.loads(got)["steps"]}
    res = saver.result()
    assert res["errors"] == [], res["errors"][:4]
    assert bad == [], bad[:3]
    assert runs >= 3 and statuses <= {"ok", "skipped", "deleted"}, (runs, statuses)


# ------------------------------------------------------------------ deterministic cases
def test_a_step_deleted_or_replaced_while_verified_is_deleted_not_damaged(tmp_path):
    """The step goes (as retention deletes it: manifest first, then the files), or is
    replaced by an overwrite, after verify resolved it and before it reads the files."""
    url = str(tmp_path / "run")
    model = _model()
    with CheckpointManager(url, model=model) as mgr:
        for step in (1, 2, 3):
            mgr.save(step)
        st = Storage(url)
        r = resolve(st, 1)
        Catalog(st).delete(1)
        res = verify(r)
        assert res.deleted and res.problems == [] and res.ok, res
        r = resolve(st, 2)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        mgr.save(2, overwrite=True)
        res = verify(r)
        assert res.deleted and res.problems == [], res
    # Damage is still damage: the manifest stands, a file is gone.
    r = resolve(st, 3)
    victim = sorted(f for f in r.manifest.files if f.endswith(".distcp"))[0]
    st.rm("step-00000003", victim)
    res = verify(r)
    assert not res.deleted and res.problems == [
        f"{victim}: missing (manifest: {r.manifest.files[victim].size} bytes)"
    ]


def child_delete_step(url: str, opts: dict, go: str, out: str) -> None:
    from muon_ckpt.store import Catalog

    open(out + ".ready", "w").close()
    while not os.path.exists(go):
        time.sleep(0.001)
    try:
        Catalog(Storage(url, opts)).delete(1)
        result = "ok"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    with open(out, "w") as f:
        f.write(result)


def test_two_processes_deleting_one_step_both_succeed(tmp_path):
    """Deleting tolerates files another process deleted first (a retention and a prune that
    met despite the lease: one of them took over an expired one). Local only: S3 deletes
    missing keys without an error."""
    url, opts = str(tmp_path / "run"), {}
    st = Storage(url)
    for d in range(20):  # many files, so that the two deletions overlap
        os.makedirs(st.path("step-00000001", f"d{d}"))
        for i in range(500):
            open(st.path("step-00000001", f"d{d}", f"f{i}"), "wb").close()
    st.write_bytes(b"{}", "step-00000001", "manifest.json", durable=False)
    go = str(tmp_path / "go")
    outs = [str(tmp_path / f"out{k}") for k in range(2)]
    procs = [
        _context().Process(target=child_delete_step, args=(url, opts, go, out), daemon=True)
        for out in outs
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    while not all(os.path.exists(out + ".ready") for out in outs):  # both waiting for the start
        assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "no start"
        time.sleep(0.005)
    open(go, "w").close()
    for p in procs:
        p.join(120)
    results = []
    for out in outs:
        with open(out) as f:
            results.append(f.read())
    assert results == ["ok", "ok"]
    assert not st.exists("step-00000001")


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_prune_is_refused_while_a_job_holds_the_lease(backend, tmp_path, request, capsys):
    url, opts, flags = _url(backend, tmp_path, request)
    with CheckpointManager(url, model=_model(), storage_options=opts) as mgr:
        for step in (1, 2, 3):
            mgr.save(step)
    st = Storage(url, opts)
    now = time.time()
    job = {"owner": "x" * 32, "host": "other-host", "pid": 4242, "heartbeat": now}
    st.write_bytes(json.dumps({**job, "expires": now + 300}).encode(), LEASE)
    with pytest.raises(CheckpointLeaseError, match=r"pruning \(nothing was deleted\).*pid 4242"):
        prune(st, 1)
    rc, _, err = _cli(capsys, "prune", url, "--keep", "1", *flags)
    assert rc == 1 and "host other-host, pid 4242" in err and "once the job has ended" in err
    assert (
        "would delete 2 step(s): 1, 2"
        in _cli(capsys, "prune", url, "--keep", "1", "--dry-run", *flags)[1]
    )
    assert CheckpointManager(url, storage_options=opts).steps() == [1, 2, 3]
    st.write_bytes(json.dumps({**job, "expires": now - 1}).encode(), LEASE)  # the job died
    assert prune(st, 1).deleted == [1, 2]
    assert not st.exists(LEASE)  # given back


def test_a_save_waits_for_a_prune_to_give_the_lease_back(tmp_path):
    url = str(tmp_path / "run")
    st = Storage(url)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        now = time.time()
        pruning = {**identity(sleeper.pid), "owner": "p" * 32, "purpose": "prune"}
        st.write_bytes(
            json.dumps({**pruning, "heartbeat": now, "expires": now + 60}).encode(), LEASE
        )
        threading.Timer(1.0, st.rm, (LEASE,)).start()  # the prune is done
        t0 = time.monotonic()
        with CheckpointManager(url, model=_model()) as mgr:
            assert mgr.save(1)
        assert time.monotonic() - t0 >= 0.9
        # A prune that stopped renewing (hung, killed elsewhere) is waited for until it expires.
        now = time.time()
        st.write_bytes(
            json.dumps({**pruning, "heartbeat": now - 59, "expires": now + 1}).encode(), LEASE
        )
        with CheckpointManager(url, model=_model()) as mgr:
            assert mgr.load() == 1
            assert mgr.save(2)
    finally:
        sleeper.kill()
        sleeper.wait()
