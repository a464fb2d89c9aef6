"""One retry budget per storage request: the only retry loop of a request to S3.

s3fs retries a failing request 5 times around botocore's 5 attempts (25 tries over 30-50 s,
whatever ``storage_timeout`` says). ``own_retries(fs, budget)`` turns both off for a
filesystem of ours (s3fs: ``retries = 1``, botocore: one attempt, set by ``client_options``)
and runs every request it sends through ``Budget``: s3fs sends each one through its
``_call_s3`` (the async method and its blocking twin ``call_s3``, which its files use), so
replacing those two on our own instance (never a cached one another user may share) is the
single seam. A GET's body is read inside the attempt, so a short or damaged body is retried
like an error answer.

The budget of one request (``Budget``): at most ``ATTEMPTS`` attempts; between them a pause
that doubles from ``BASE`` (``THROTTLED_BASE`` after an answer that asks to slow down: S3's
503 SlowDown, a 429, a throttling code), half of it random (jitter), so that ranks that failed
together do not retry together; and a total bounded by ``timeout`` (``storage_timeout``): no
attempt starts or goes on past it (but a GET whose body still arrives, until it is idle for a
third of it), and each attempt's connect and read timeouts are a third of it, so that a
stalled attempt leaves time for another. Retried: answers that say "try
again" (5xx, throttling, a request timeout, a checksum the store found wrong), a connection
reset or closed mid-request, a short or damaged response, a timeout. Not retried: the other
answers (a missing key, a refused access, a failed precondition: the caller needs them as
they are), nor, for the probe (``reconnect=False``), an endpoint that refuses connections or a host
name that does not resolve (a connection reset is retried). A
request that runs out of its budget raises ``RequestFailed`` (an ``OSError``) naming the rank,
the request, the object, the attempts, the time and the last answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import random
import socket
import time
from dataclasses import dataclass
from typing import Any

from muon_ckpt._collective import is_dist, rank

__all__ = ["ATTEMPTS", "Budget", "RequestFailed", "client_options", "own_retries"]

ATTEMPTS = 5  # attempts of one request at most, whatever its time allows (botocore legacy mode)
BASE = 0.05  # seconds: the first pause after a failed attempt (doubling)
THROTTLED_BASE = 0.25  # ... after an answer that asks to slow down
CAP = 5.0  # seconds: the longest pause
_SLOW_DOWN = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "RequestThrottled",
}
_AGAIN = _SLOW_DOWN | {
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "RequestTimeoutException",
    "BadDigest",
    "XAmzContentSHA256Mismatch",
    "IncompleteBody",
}
# Failures of the exchange itself, by class name (botocore's and aiohttp's, not imported here).
_TRANSIENT = {
    "HTTPClientError",  # botocore: connection closed, read timeout, response streaming error
    "ConnectTimeoutError",
    "IncompleteReadError",
    "FlexibleChecksumError",
    "ChecksumError",
    "ResponseParserError",
    "ClientPayloadError",  # aiohttp: a short or broken body
    "ServerDisconnectedError",
    "ClientOSError",
    "ServerTimeoutError",
    "IncompleteRead",
    "FSTimeoutError",
    "TimeoutError",
    "ConnectionResetError",
    "ConnectionAbortedError",
    "BrokenPipeError",
}
_CONNECT = {"EndpointConnectionError", "ClientConnectorError"}  # no connection could be made
_VERBS = {
    "get_object": "GET",
    "head_object": "HEAD",
    "head_bucket": "HEAD",
    "put_object": "PUT",
    "copy_object": "PUT (copy)",
    "upload_part": "PUT (part)",
    "upload_part_copy": "PUT (part copy)",
    "create_multipart_upload": "POST (create multipart upload)",
    "complete_multipart_upload": "POST (complete multipart upload)",
    "abort_multipart_upload": "DELETE (abort multipart upload)",
    "delete_object": "DELETE",
    "delete_objects": "POST (delete)",
    "list_objects_v2": "LIST",
    "list_object_versions": "LIST (versions)",
}


@dataclass(frozen=True)
class Budget:
    """What one request may spend: ``timeout`` seconds in all (None: no bound but the
    attempts), ``attempts`` tries; ``reconnect``: whether an endpoint that refuses
    connections is tried again."""

    timeout: float | None
    attempts: int = ATTEMPTS
    reconnect: bool = True


class RequestFailed(OSError):
    """A storage request that failed on every attempt its budget allowed; ``last`` is the
    last attempt's failure."""

    def __init__(self, message: str, last: BaseException) -> None:
        super().__init__(message)
        self.last = last

    def __reduce__(self) -> Any:  # (crosses ranks as itself, its text kept)
        return (RequestFailed, (str(self), RuntimeError(str(self.last))))

    def __str__(self) -> str:
        return str(self.args[0])


def client_options(options: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """``options`` of an S3 filesystem with the client's own retries off and each attempt's
    connect and read timeouts a third of ``timeout`` (unless the user set them), and an
    instance of our own (``own_retries`` changes it)."""
    cfg = dict(options.get("config_kwargs") or {})
    cfg["retries"] = {"total_max_attempts": 1}  # the budget is the retry loop
    if timeout is not None:
        cfg.setdefault("connect_timeout", timeout / 3)
        cfg.setdefault("read_timeout", timeout / 3)
    return {**options, "config_kwargs": cfg, "skip_instance_cache": True}


def own_retries(fs: Any, budget: Budget) -> None:
    """Every request ``fs`` (s3fs) sends runs within ``budget``; other filesystems keep
    their client's own retries. Idempotent: a second call changes the budget."""
    if not callable(getattr(type(fs), "_call_s3", None)):
        return
    fs._muon_ckpt_budget = budget
    if getattr(fs, "_muon_ckpt_owned", False):
        return
    from fsspec.asyn import sync_wrapper

    one = type(fs)._call_s3.__get__(fs, type(fs))  # s3fs's own: one attempt (retries = 1)

    async def call(method: str, *args: Any, **kwargs: Any) -> Any:
        await fs.set_session()  # (the client, made once: loading its model is no request)
        return await _within(fs._muon_ckpt_budget, one, method, args, kwargs)

    fs.retries = 1
    fs._call_s3 = call
    fs.call_s3 = sync_wrapper(call, obj=fs)
    fs._muon_ckpt_owned = True


async def _within(budget: Budget, one: Any, method: str, args: tuple, kwargs: dict) -> Any:
    start = time.monotonic()
    deadline = None if budget.timeout is None else start + budget.timeout
    attempt, answered = 0, None  # answered: the last attempt's failure that came back
    while True:
        attempt += 1
        left = None if deadline is None else deadline - time.monotonic()
        try:
            flow = _Flow()
            idle = None if budget.timeout is None else budget.timeout / 3
            return await _bounded(_attempt(one, method, args, kwargs, flow), left, flow, idle)
        except Exception as e:
            slow = _retryable(e, budget.reconnect)
            if slow is None:
                raise
            cut = isinstance(e, _Cut)
            answered = answered if cut else e
            pause = _pause(attempt, slow)
            ran_out = cut or (deadline is not None and time.monotonic() + pause >= deadline)
            if attempt >= budget.attempts or ran_out:
                why = _failed(budget, method, kwargs, attempt, start, answered or e, cut)
                raise why from e
            await asyncio.sleep(pause)


_PIECE = 1 << 20  # bytes of a GET's body read at a time (each one proof the link is live)


class _Cut(TimeoutError):
    """An attempt still running when the request's budget ran out (abandoned)."""


class _Flow:
    """When the body of an attempt's answer last brought bytes (None: not yet)."""

    at: float | None = None


async def _bounded(attempt: Any, seconds: float | None, flow: _Flow, idle: float | None) -> Any:
    """``attempt``'s result, or TimeoutError once ``seconds`` passed (it is cancelled), unless
    its answer's body still brings bytes: then once none came for ``idle`` seconds (a slow
    but live link finishes a large GET). Not ``asyncio.wait_for``, which can raise
    CancelledError instead when the attempt ends just as the time is up (Python 3.11)."""
    task = asyncio.ensure_future(attempt)
    end = None if seconds is None else time.monotonic() + seconds
    try:
        while True:
            wait = None if end is None else max(0.0, end - time.monotonic())
            done, _ = await asyncio.wait({task}, timeout=wait)
            if done or idle is None or flow.at is None or flow.at + idle <= time.monotonic():
                break
            end = flow.at + idle
    finally:
        if not task.done():
            task.cancel()
    if not done:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise _Cut()
    return task.result()


async def _attempt(one: Any, method: str, args: tuple, kwargs: dict, flow: _Flow) -> Any:
    """One attempt; a GET's body read within it (a short or damaged body fails it), each
    piece that arrives noted in ``flow``."""
    out = await one(method, *args, **kwargs)
    if method == "get_object" and isinstance(out, dict) and "Body" in out:
        body, data = out["Body"], bytearray()
        try:
            while piece := await body.read(_PIECE):
                data += piece
                flow.at = time.monotonic()
            out["Body"] = _ReadBody(bytes(data))
        finally:
            body.close()
    return out


class _ReadBody:
    """A response body already read: what s3fs calls of a streaming one."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._at = 0

    async def read(self, amt: int | None = None) -> bytes:
        end = len(self._data) if amt is None or amt < 0 else self._at + amt
        out = self._data[self._at : end]
        self._at += len(out)
        return out

    def close(self) -> None:
        self._data = b""


def _pause(attempt: int, slow: bool) -> float:
    """Seconds to wait after failed attempt ``attempt``: doubling, half of it random."""
    full = min(CAP, (THROTTLED_BASE if slow else BASE) * 2 ** (attempt - 1))
    return full / 2 + random.uniform(0, full / 2)


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and x not in out:
        out.append(x)
        x = x.__cause__ or x.__context__
    return out


def _answer(e: BaseException) -> tuple[int, str, str] | None:
    """(HTTP status, error code, message) of the store's error answer in ``e``'s chain."""
    for x in _chain(e):
        resp = getattr(x, "response", None)
        if isinstance(resp, dict) and "Error" in resp:
            status = int((resp.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
            err = resp.get("Error") or {}
            return status, str(err.get("Code") or status), str(err.get("Message") or "")
    return None


def _retryable(e: BaseException, reconnect: bool) -> bool | None:
    """None: not retried; else whether the store asked to slow down."""
    answer = _answer(e)
    if answer is not None:
        status, code, _ = answer
        if code in _SLOW_DOWN or status in (429, 503):
            return True
        return False if status >= 500 or code in _AGAIN else None
    for x in _chain(e):
        names = {c.__name__ for c in type(x).__mro__}
        if names & _CONNECT:  # (a reset or closed connection is retried, also by the probe)
            return None if not reconnect and _refused(e) else False
        if names & _TRANSIENT or _parsing(x):
            return False
    return None


def _refused(e: BaseException) -> bool:
    """Whether no connection could be made at all: refused, or the host name unknown."""
    for x in _chain(e):
        if isinstance(x, (ConnectionRefusedError, socket.gaierror)):
            return True
        if getattr(x, "errno", None) == errno.ECONNREFUSED or "DNSError" in type(x).__name__:
            return True
    return False


def _parsing(e: BaseException) -> bool:
    """Whether ``e`` was raised parsing an answer (a damaged one: botocore raises what its
    parsers meet, a ValueError from a timestamp, as it is)."""
    tb = e.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("botocore.parsers"):
            return True
        tb = tb.tb_next
    return False


def _failed(
    budget: Budget,
    method: str,
    kwargs: dict,
    attempts: int,
    start: float,
    e: BaseException,
    cut: bool = False,
) -> RequestFailed:
    """The error of a request that ran out of its budget: ``e`` is the last failure that
    came back (an answer, a reset), ``cut`` whether the last attempt was abandoned unanswered
    at the budget's end."""
    key = kwargs.get("Key") or kwargs.get("Prefix") or ""
    what = f"{_VERBS.get(method, method)} s3://{kwargs.get('Bucket', '?')}/{key}"
    if "PartNumber" in kwargs:
        what += f" (part {kwargs['PartNumber']})"
    where = f" on rank {rank()}" if is_dist() else ""
    answer = _answer(e)
    if answer is not None:
        code = "" if answer[1] == str(answer[0]) else f" {answer[1]}"  # (a HEAD has no body)
        last = f"{answer[0]}{code}: {answer[2]}".rstrip(": ")
    elif isinstance(e, _Cut):
        last = "no complete answer within the budget"
    else:
        last = f"{type(e).__name__}: {e}"
    if cut and not isinstance(e, _Cut):
        last += "; the last attempt had no complete answer when the budget ran out"
    bound = "" if budget.timeout is None else f", storage_timeout={budget.timeout:g} s"
    return RequestFailed(
        f"{what}{where} failed: {last} (gave up after {attempts} attempt(s) in "
        f"{time.monotonic() - start:.2f} s: the budget of one request, its retries included"
        f"{bound})",
        e,
    )
