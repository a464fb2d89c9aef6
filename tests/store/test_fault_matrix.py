"""The fault matrix: every kind of S3 request a save or a load makes (LIST,
GET, PUT, multipart create / part / complete, HEAD, DELETE) meets every fault a store or its
network produces (503 SlowDown with S3's body, a connection reset, a short body with a lying
Content-Length, a flipped byte, a delay), on 1 rank and on one rank of 2 (``tests/_faults.py``
between each rank and the moto server).

Transient (each kind's first request, in rounds of one fault each): the request is retried,
the save commits and the load returns it. Persistent (every request of one kind on one rank):
the save commits where that request is not needed (a slow store; a delete after the commit,
whose failure is a warning), else it ends on every rank with the same CheckpointError, a
storage or corruption error, never a collective timeout; the load under it raises or returns
the newest step. Never a silent
loss: every step reported committed loads bitwise, and after a failed save the step before
it is the newest and loads bitwise. The whole matrix shares one moto server and one proxy,
a process group of 2 ranks runs every case of its column, and the states are tiny but for one
tensor per rank just over the multipart part size."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from muon_ckpt import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointStorageError,
)
from tests._dist import run_on_ranks
from tests._faults import FaultControl, FaultProxy
from tests.conftest import s3_options

KINDS = ("LIST", "GET", "PUT", "CREATE", "PART", "COMPLETE", "HEAD", "DELETE")
FAULTS = ("503", "reset", "short", "flip", "delay")
STORAGE_TIMEOUT = 3.0  # seconds: one request's budget (a loaded host answers within it)
COLLECTIVE_TIMEOUT = 60.0  # a failing rank must report long before this
PART = 5 << 20  # the multipart part size (S3's smallest); each rank's big tensor is larger
_METHOD = {"LIST": "GET", "GET": "GET", "HEAD": "HEAD", "DELETE": "*", "PUT": "PUT"}
_METHOD.update(CREATE="POST", COMPLETE="POST", PART="PUT")


def proxy_fault(kind: str, fault: str) -> str | None:
    """The proxy's fault for ``fault`` on a request of ``kind``; None where it means nothing
    (a flipped byte where S3's protocol carries no checksum: TLS guards those bytes; a short
    body of a HEAD, which has none)."""
    if fault == "flip":
        return {"PUT": "flip_request", "PART": "flip_request", "GET": "corrupt_response"}.get(kind)
    if fault == "short":
        if kind in ("PUT", "PART"):
            return "short_request"
        return None if kind == "HEAD" else "truncate_response"
    return fault


def _rules(faults: dict[str, str], times: int, rank: int | None) -> list[dict[str, Any]]:
    return [
        {"method": _METHOD[k], "path": ".", "fault": f, "kind": k, "times": times, "rank": rank}
        for k, fault in faults.items()
        if (f := proxy_fault(k, fault)) is not None
    ]


# Transient: one round per fault, each kind's first request on every rank.
TRANSIENT = [("transient", {k: f for k in KINDS}, None) for f in FAULTS]
# Persistent: every request of a kind on one rank (of 2: rank 1, or rank 0 for the requests
# only it makes), every kind and every fault at least once; a delay of every request.
PERSISTENT = [
    ("persistent", {"LIST": "503"}, 1),
    ("persistent", {"GET": "reset"}, 1),
    ("persistent", {"PUT": "short"}, 1),
    ("persistent", {"CREATE": "reset"}, 1),
    ("persistent", {"PART": "flip"}, 1),
    ("persistent", {"COMPLETE": "short"}, 1),
    ("persistent", {"HEAD": "503"}, 0),
    ("persistent", {"DELETE": "reset"}, 0),
    ("persistent", {"GET": "flip"}, 1),
    ("persistent", dict.fromkeys(KINDS, "delay"), None),
]
CASES = TRANSIENT + PERSISTENT


def _must_commit(how: str, faults: dict[str, str]) -> bool:
    """A transient fault and a slow store never cost the save."""
    return how == "transient" or set(faults.values()) == {"delay"}


class _Big:
    """A rank's own tensor, a little over the part size: its file is a multipart upload."""

    def __init__(self) -> None:
        self.t = torch.zeros(PART // 4 + 4096)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.t.copy_(sd["t"])


def _state(rank: int) -> tuple[nn.Module, dict[str, _Big]]:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), {"big": _Big()}


def _fill(model: nn.Module, extra: dict[str, _Big], rank: int, v: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(v)
        extra["big"].t.fill_(1000.0 * rank + v)


def _holds(model: nn.Module, extra: dict[str, _Big], rank: int, v: float) -> bool:
    want = [torch.full_like(p, v) for p in model.parameters()]
    ok = all(torch.equal(p, w) for p, w in zip(model.parameters(), want))
    big = extra["big"].t
    return ok and torch.equal(big, torch.full_like(big, 1000.0 * rank + v))


def _manager(url: str, endpoint: str, rank: int) -> tuple[Any, nn.Module, dict]:
    model, extra = _state(rank)
    opts = {**s3_options(endpoint), "default_block_size": PART}
    mgr = CheckpointManager(
        url,
        model=model,
        rank_extra=extra,
        keep_last=1,
        storage_options=opts,
        storage_timeout=STORAGE_TIMEOUT,
        collective_timeout=COLLECTIVE_TIMEOUT,
    )
    return mgr, model, extra


def _column(rank: int, world: int, url: str, endpoint: str, faults: Any, cases: list) -> list:
    """Every case with one manager, one after another: the save of the next step and a load
    under the case's faults (``faults.arm``), then, the faults cleared, which step is the
    newest and what the same manager loads. Rank 0 sets the faults."""
    sync = dist.barrier if world > 1 else (lambda: None)
    mgr, model, extra = _manager(url, endpoint, rank)
    _fill(model, extra, rank, 1.0)
    mgr.save(1)
    newest, out = 1, []
    for how, kinds, who in cases:
        if rank == 0:
            faults.arm(how, kinds, who if world > 1 else None)
        sync()
        step = newest + 1
        _fill(model, extra, rank, float(step))
        t0 = time.monotonic()
        try:
            saved, error = mgr.save(step), None
        except CheckpointError as e:
            saved, error = False, (type(e).__name__, str(e))
        took = time.monotonic() - t0
        _fill(model, extra, rank, -1.0)
        try:
            got = mgr.load()
            loaded = (got, got is not None and _holds(model, extra, rank, float(got)))
        except CheckpointError as e:
            loaded = (type(e).__name__, str(e))
        sync()
        fired = faults.clear() if rank == 0 else None
        sync()
        steps = mgr.steps()
        newest = step if saved else newest
        _fill(model, extra, rank, -1.0)
        again = mgr.load()
        after = (again, again is not None and _holds(model, extra, rank, float(again)))
        record = {"saved": saved, "error": error, "took": took, "loaded": loaded, "fired": fired}
        out.append((record, step, steps, after))
    mgr.close()
    return out


def _check(
    name: str, how: str, faults: dict, outs: list[tuple[dict, int, list, tuple]], who: Any = None
) -> None:
    """The promises of one case, from every rank's record (``who``: the faulted rank)."""
    records = [o[0] for o in outs]
    armed = {(k, f) for k, fault in faults.items() if (f := proxy_fault(k, fault)) is not None}
    assert records[0]["fired"] == sorted(armed), (name, records[0]["fired"])  # each one met
    saved = {r["saved"] for r in records}
    assert len(saved) == 1, (name, records)  # every rank has the same outcome
    committed = saved.pop()
    if _must_commit(how, faults):
        assert committed, (name, records)
    if not committed:
        errors = {r["error"] for r in records}
        assert len(errors) == 1, (name, errors)  # the same error on every rank
        (kind, msg), *_ = errors
        causes = (CheckpointStorageError.__name__, CheckpointCorruptError.__name__)
        assert kind in causes, (name, kind, msg)  # never a timeout, nor torch's text for it
        if kind == CheckpointStorageError.__name__:  # the request and its object
            assert re.search(r"\b(GET|PUT|LIST|HEAD|POST|DELETE)\b[^:]* s3://", msg), (name, msg)
        if who is not None and len(records) > 1:  # the rank whose storage failed
            assert re.search(rf"\brank(\(s\))? \[?{who}\b", msg), (name, msg)
        assert all(r["took"] < COLLECTIVE_TIMEOUT for r in records), (name, records)
    for r, (_, step, steps, after) in zip(records, outs):
        newest = step if committed else step - 1  # the step before a failed save is kept
        assert steps and steps[-1] == newest, (name, steps, r)
        assert after == (newest, True), (name, after)  # and loads bitwise
        loaded = r["loaded"]
        if how == "transient":
            assert loaded == (newest, True), (name, loaded)
        else:  # a step bitwise, or an error: never "starting fresh"
            assert loaded == (newest, True) or isinstance(loaded[0], str), (name, loaded)


def _name(how: str, faults: dict[str, str]) -> str:
    return f"{how}:" + ",".join(f"{k}={v}" for k, v in faults.items())


class _Faults:
    """Arms a case's faults on a proxy (``proxy``: a FaultProxy, or a FaultControl of one)."""

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy

    def arm(self, how: str, kinds: dict[str, str], rank: int | None) -> None:
        """``kinds``' faults on ``rank``'s requests (None: every rank's)."""
        self._since = len(self._log())
        for rule in _rules(kinds, 1 if how == "transient" else -1, rank):
            self.proxy.rule(**rule)

    def clear(self) -> list[tuple[str, str]]:
        """Clear the faults; the (kind, fault) of each request that met one since ``arm``."""
        self.proxy.clear()
        return sorted({(x[1], x[4]) for x in self._log()[self._since :] if x[4] is not None})

    def _log(self) -> list[tuple[Any, ...]]:
        return list(self.proxy.log if isinstance(self.proxy, FaultProxy) else self.proxy.log())


@pytest.fixture(scope="module")
def matrix(s3_server: str) -> Iterator[tuple[FaultProxy, str]]:
    """One proxy (a port per rank) and one bucket for every case."""
    import s3fs

    proxy = FaultProxy(s3_server, ranks=2, delay_s=0.1).start()
    bucket = f"matrix-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**s3_options(s3_server)).mkdir(bucket)
    try:
        yield proxy, bucket
    finally:
        proxy.stop()


def test_one_rank(matrix):
    proxy, bucket = matrix
    url = f"s3://{bucket}/one-{uuid.uuid4().hex[:8]}"
    got = _column(0, 1, url, proxy.url, _Faults(proxy), CASES)
    for (how, faults, _), out in zip(CASES, got):
        _check(_name(how, faults), how, faults, [out])


def _two(rank: int, world: int, url: str, urls: list[str], control: str) -> list:
    return _column(rank, world, url, urls[rank], _Faults(FaultControl(control)), CASES)


def test_two_ranks_one_of_them_faulted(matrix):
    proxy, bucket = matrix
    url = f"s3://{bucket}/two-{uuid.uuid4().hex[:8]}"
    got = run_on_ranks(_two, 2, url, proxy.urls, proxy.control_url, timeout=600)
    for i, (how, faults, who) in enumerate(CASES):
        _check(_name(how, faults), how, faults, [got[0][i], got[1][i]], who)
