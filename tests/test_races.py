"""Races of the command line against a training job (issue 31), with real processes on real
storage.
"""

from __future__ import annotations

import os
import time

from muon_ckpt.store import Storage
from tests._dist import _context


def child_delete_step(url: str, opts: dict, go: str, out: str) -> None:
    from muon_ckpt.store import Catalog

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
    time.sleep(1.0)  # both waiting for the start
    open(go, "w").close()
    for p in procs:
        p.join(120)
    results = []
    for out in outs:
        with open(out) as f:
            results.append(f.read())
    assert results == ["ok", "ok"]
    assert not st.exists("step-00000001")
