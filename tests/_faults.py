"""A small HTTP proxy that injects storage faults between s3fs and the moto server.

``FaultProxy(upstream, seed, ranks=n)`` listens on 127.0.0.1, one port per rank (``urls[r]``:
rank ``r``'s endpoint; ``url`` is rank 0's), and forwards every request to ``upstream``.
Faults come from ``rules`` (method, path regex, optional body regex, and optionally the
request's ``kind`` and the ``rank`` whose port it came to: every matching request gets the
fault, or only the first ``times``) or, when ``rate`` > 0, at random from ``kinds`` with a
``random.Random(seed)``, so a run is reproducible (up to thread interleaving). The kind of a
request (``kind_of``): ``LIST``, ``GET``, ``HEAD``, ``PUT``, ``COPY``, ``CREATE`` / ``PART`` /
``COMPLETE`` / ``ABORT`` (a multipart upload), ``DELETE`` (one object or a bulk delete),
``BUCKET`` (anything else on a bucket). Faults:

* ``"500"``, ``"503"``: an S3 error response (InternalError; SlowDown, with the XML body S3
  sends), nothing forwarded;
* ``"reset"``: the connection is closed without a response (RST);
* ``"stall"``: no response for ``stall_s`` seconds, then the connection is closed;
* ``"delay"``: the request is forwarded after ``delay_s`` seconds (a slow store, no error);
* ``"hold"`` (never drawn at random): the request is forwarded once ``release()`` (or
  ``clear()``) is called, which also ends the holding rules: a store slower than whatever
  the test waits out first, without a time to outlast (``hold_s``: a bound, never reached);
* ``"slow"`` (never drawn at random): the response body sent in pieces of ``SLOW_PIECE``
  bytes, ``slow_s`` seconds apart (a live link slower than the request's budget);
* ``"corrupt_request"``: one byte of the request body flipped, the request's checksum
  headers dropped (a store that does not check what it is sent); ``"truncate_request"``: the
  body cut in half, likewise;
* ``"flip_request"``: one byte of the body flipped on the way, answered as S3 answers a body
  that fails the checksum it came with (400 BadDigest; moto checks none); one that came
  without a checksum is stored damaged; ``"short_request"``: fewer bytes than the request's
  Content-Length arrived, answered as S3 does (400 IncompleteBody);
* ``"corrupt_response"``: one byte of the response body flipped; ``"truncate_response"``:
  half the body sent under the full Content-Length (a short body, a lying length), then the
  connection closed;
* ``"corrupt_unchecked_response"`` (never drawn at random): one byte of the response body
  flipped and the response's checksum headers dropped, so the client cannot tell (an object
  stored without a checksum, a path that damages what it carries).

``seen``: requests forwarded or faulted, per ``(rank, kind)``; ``log``: ``(rank, kind, method,
path, fault)`` of each. Processes other than the proxy's (the ranks of a distributed test)
change the rules through ``FaultControl(proxy.control_url)``: HTTP requests to the proxy
itself, under ``/__faults__/``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import re
import socket
import struct
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

KINDS = (
    "500",
    "503",
    "reset",
    "stall",
    "corrupt_request",
    "truncate_request",
    "corrupt_response",
    "truncate_response",
)
REQUEST_KINDS = (
    "LIST",
    "GET",
    "HEAD",
    "PUT",
    "COPY",
    "CREATE",
    "PART",
    "COMPLETE",
    "ABORT",
    "DELETE",
    "BUCKET",
)
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}
_CHECKSUM_HEADERS = re.compile(
    r"^(content-md5|x-amz-checksum-.*|x-amz-sdk-checksum-.*|x-amz-trailer)$"
)
_BODY_FAULTS = {"corrupt_request", "truncate_request", "flip_request", "short_request"}
_CONTROL = "/__faults__/"
SLOW_PIECE = 64 << 10


def kind_of(method: str, path: str, headers: Any = None) -> str:
    """The S3 request a (method, path with query) is, as ``REQUEST_KINDS`` names it."""
    u = urlsplit(path)
    q = parse_qs(u.query, keep_blank_values=True)
    key = u.path.strip("/").partition("/")[2]  # (path-style: /bucket/key)
    copy = headers is not None and headers.get("x-amz-copy-source")
    if method == "HEAD":
        return "HEAD"
    if method == "DELETE":
        return "ABORT" if "uploadId" in q else "DELETE"
    if method == "POST":
        if "uploads" in q:
            return "CREATE"
        if "uploadId" in q:
            return "COMPLETE"
        return "DELETE" if "delete" in q else "BUCKET"
    if method == "PUT":
        if "partNumber" in q:
            return "PART"
        if not key:
            return "BUCKET"
        return "COPY" if copy else "PUT"
    if method == "GET":
        if key:
            return "GET"
        return "LIST" if ("list-type" in q or "prefix" in q or not q) else "BUCKET"
    return "BUCKET"


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        seed: int = 0,
        stall_s: float | None = 2.0,
        *,
        ranks: int = 1,
        delay_s: float = 1.0,
    ) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.rng = random.Random(seed)
        self.stall_s = stall_s  # None: a stall ends only when the proxy stops
        self._stopped = threading.Event()
        self.delay_s = delay_s
        self.slow_s = 0.05  # seconds between the pieces of a "slow" body
        self.hold_s = 180.0  # the longest a "hold" waits for release() (a test that hangs)
        self._released = threading.Event()  # set by release(): what held requests wait for
        # [method, path, body, fault, times left, kind, rank, at]
        self.rules: list[list[Any]] = []
        self.rate = 0.0
        self.kinds: tuple[str, ...] = KINDS
        self.injected: dict[str, int] = {}
        self.seen: dict[tuple[int, str], int] = {}
        self.log: list[tuple[int, str, str, str, str | None]] = []
        self._lock = threading.Lock()
        self._servers = [self._server(rank) for rank in range(ranks)]
        self._threads = [
            threading.Thread(target=s.serve_forever, daemon=True) for s in self._servers
        ]

    def _server(self, rank: int) -> ThreadingHTTPServer:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # The headers and the body go out in two writes: with Nagle's algorithm the body
            # waited for the client's delayed ACK, 40 ms on every GET and LIST.
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path.startswith(_CONTROL):
                    proxy._control(self)
                else:
                    proxy._handle(self, rank)

            do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        return server

    @property
    def urls(self) -> list[str]:
        """Each rank's endpoint (``endpoint_url`` of its storage options)."""
        return [f"http://127.0.0.1:{s.server_address[1]}" for s in self._servers]

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def control_url(self) -> str:
        return self.url

    def start(self) -> FaultProxy:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self.release()
        for s in self._servers:
            s.shutdown()
            s.server_close()

    def rule(
        self,
        method: str,
        path: str,
        fault: str,
        body: bytes | None = None,
        times: int = -1,
        *,
        kind: str | None = None,
        rank: int | None = None,
        at: int | None = None,
    ) -> None:
        """Every ``method`` request ("*": any) whose path matches ``path`` (and body
        ``body``; and, when given, of request kind ``kind`` that came to rank ``rank``'s
        port) gets ``fault``; only the first ``times`` of them when ``times`` >= 0. ``at``:
        the byte a corrupting fault flips (default: one drawn at random; 0 makes a JSON body
        invalid)."""
        if kind is not None and kind not in REQUEST_KINDS:
            raise ValueError(f"kind must be one of {REQUEST_KINDS}, got {kind!r}")
        pat = None if body is None else re.compile(body)
        with self._lock:
            self.rules.append([method, re.compile(path), pat, fault, times, kind, rank, at])

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.rate = 0.0
        self.release()

    def release(self) -> None:
        """Forward every held request, and hold no more (the "hold" rules end)."""
        with self._lock:
            self.rules = [r for r in self.rules if r[3] != "hold"]
            released, self._released = self._released, threading.Event()
        released.set()

    def count(self, kind: str | None = None, rank: int | None = None) -> int:
        """Requests seen so far of ``kind`` (None: any) that came to ``rank``'s port (None:
        any)."""
        with self._lock:
            return sum(
                n
                for (r, k), n in self.seen.items()
                if (kind is None or k == kind) and (rank is None or r == rank)
            )

    # ------------------------------------------------------------------ control
    def _control(self, h: BaseHTTPRequestHandler) -> None:
        """Rules set and cleared by other processes (``FaultControl``)."""
        what = h.path[len(_CONTROL) :]
        args = json.loads(_read_body(h) or b"{}")
        if what == "rule":
            body = args.pop("body", None)
            self.rule(body=None if body is None else body.encode("latin-1"), **args)
            out: Any = None
        elif what == "clear":
            self.clear()
            out = None
        elif what == "release":
            self.release()
            out = None
        elif what == "seen":
            with self._lock:
                out = [[r, k, n] for (r, k), n in self.seen.items()]
        elif what == "log":
            with self._lock:
                out = [list(x) for x in self.log]
        else:
            h.send_error(404)
            return
        data = json.dumps(out).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    # ------------------------------------------------------------------ one request
    def _pick(
        self, rank: int, method: str, kind: str, path: str, body: bytes
    ) -> tuple[str | None, threading.Event]:
        """The fault of this request (``fault:salt``) and the event a "hold" waits for."""
        with self._lock:
            fault, at = None, None
            for r in self.rules:
                m, p, b, f, times, k, rk, flip_at = r
                if (
                    times
                    and m in (method, "*")
                    and (k is None or k == kind)
                    and (rk is None or rk == rank)
                    and p.search(path)
                    and (b is None or b.search(body))
                ):
                    fault, r[4], at = f, times - 1, flip_at
                    break
            if fault is None and self.rate and self.rng.random() < self.rate:
                kinds = [k for k in self.kinds if body or k not in _BODY_FAULTS]
                fault = self.rng.choice(kinds)
            if fault is not None:
                self.injected[fault] = self.injected.get(fault, 0) + 1
            self.seen[rank, kind] = self.seen.get((rank, kind), 0) + 1
            self.log.append((rank, kind, method, path, fault))
            flip = self.rng.randrange(1 << 30)
            released = self._released
        return None if fault is None else f"{fault}:{flip if at is None else at}", released

    def _handle(self, h: BaseHTTPRequestHandler, rank: int) -> None:
        body = _read_body(h)
        kind = kind_of(h.command, h.path, h.headers)
        picked, released = self._pick(rank, h.command, kind, h.path, body)
        fault, _, salt = (picked or "").partition(":")
        if fault in ("500", "503"):
            return _s3_error(h, fault)
        checked = any(_CHECKSUM_HEADERS.match(k.lower()) for k in h.headers)
        if fault == "short_request" and body:
            return _s3_error(h, "IncompleteBody")
        if fault == "flip_request" and body and checked:
            return _s3_error(h, "BadDigest")
        if fault == "reset":
            return _reset(h)
        if fault == "stall":
            self._stopped.wait(self.stall_s)
            return _reset(h)
        if fault == "delay":
            time.sleep(self.delay_s)
        if fault == "hold":
            released.wait(self.hold_s)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        if fault in _BODY_FAULTS and body:
            if fault != "flip_request":
                headers = {
                    k: v for k, v in headers.items() if not _CHECKSUM_HEADERS.match(k.lower())
                }
            cut = body[: len(body) // 2]
            body = cut if fault == "truncate_request" else _flip(body, int(salt))
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            conn.request(
                h.command, h.path, body=body, headers={**headers, "Content-Length": str(len(body))}
            )
            resp = conn.getresponse()
            data = resp.read()
            status, out_headers = resp.status, resp.getheaders()
        finally:
            conn.close()
        full = len(data)
        if fault.startswith("corrupt_") and fault.endswith("response") and data:
            data = _flip(data, int(salt))
        if fault == "corrupt_unchecked_response":
            out_headers = [(k, v) for k, v in out_headers if not _CHECKSUM_HEADERS.match(k.lower())]
        cut = fault == "truncate_response" and len(data) > 1 and h.command != "HEAD"
        if h.command == "HEAD":  # (no body: the length is the object's, as the store said)
            full = int(dict((k.lower(), v) for k, v in out_headers).get("content-length") or 0)
        h.send_response(status)
        for k, v in out_headers:
            if k.lower() not in _HOP:
                h.send_header(k, v)
        h.send_header("Content-Length", str(full))
        h.end_headers()
        if fault == "slow" and h.command != "HEAD":
            for at in range(0, len(data), SLOW_PIECE):
                h.wfile.write(data[at : at + SLOW_PIECE])
                h.wfile.flush()
                self._stopped.wait(self.slow_s)
        elif h.command != "HEAD":
            h.wfile.write(data[: full // 2] if cut else data)
        if cut:
            h.wfile.flush()
            _reset(h)


class FaultControl:
    """A FaultProxy's rules, set from another process (a rank of a distributed test)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/") + _CONTROL

    def _post(self, what: str, args: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(
            self.url + what, data=json.dumps(args or {}).encode(), method="POST"
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def rule(self, method: str, path: str, fault: str, **kw: Any) -> None:
        """``FaultProxy.rule`` (``body`` as a str)."""
        self._post("rule", {"method": method, "path": path, "fault": fault, **kw})

    def clear(self) -> None:
        self._post("clear")

    def release(self) -> None:
        self._post("release")

    def seen(self) -> dict[tuple[int, str], int]:
        return {(r, k): n for r, k, n in self._post("seen")}

    def log(self) -> list[tuple[int, str, str, str, str | None]]:
        return [tuple(x) for x in self._post("log")]  # type: ignore[misc]


_S3_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "BadDigest": (
        400,
        "BadDigest",
        "The CRC32 you specified did not match the calculated checksum.",
    ),
    "IncompleteBody": (
        400,
        "IncompleteBody",
        "You did not provide the number of bytes specified by the Content-Length HTTP header.",
    ),
}


def _s3_error(h: BaseHTTPRequestHandler, which: str) -> None:
    """The error response S3 sends (``_S3_ERRORS``), with its XML body."""
    status, code, text = _S3_ERRORS[which]
    rid = uuid.uuid4().hex[:16].upper()
    data = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{text}</Message>"
        f"<RequestId>{rid}</RequestId><HostId>{rid}{rid}</HostId></Error>"
    ).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/xml")
    h.send_header("x-amz-request-id", rid)
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(data)


def _read_body(h: BaseHTTPRequestHandler) -> bytes:
    if "chunked" in h.headers.get("Transfer-Encoding", ""):
        out = bytearray()
        while True:
            size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            out += h.rfile.read(size)
            h.rfile.readline()
    n = int(h.headers.get("Content-Length") or 0)
    return h.rfile.read(n) if n else b""


def _flip(data: bytes, salt: int) -> bytes:
    b = bytearray(data)
    b[salt % len(b)] ^= 0x10
    return bytes(b)


def _reset(h: BaseHTTPRequestHandler) -> None:
    """Close the client's connection with a TCP reset (no response)."""
    with contextlib.suppress(OSError):
        h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    h.close_connection = True
    with contextlib.suppress(OSError):
        h.connection.close()
