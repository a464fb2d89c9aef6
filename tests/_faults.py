"""A small HTTP proxy that injects storage faults between s3fs and the moto server.

``FaultProxy(upstream, seed)`` listens on 127.0.0.1 and forwards every request to
``upstream``. Faults come from ``rules`` (method, path regex, optional body regex: every matching
request gets the fault) or, when ``rate`` > 0, at random from ``kinds`` with a
``random.Random(seed)``, so a run is reproducible (up to thread interleaving). Faults:

* ``"500"``, ``"503"``: an S3 error response (InternalError, SlowDown), nothing forwarded;
* ``"reset"``: the connection is closed without a response (RST);
* ``"stall"``: no response for ``stall_s`` seconds, then the connection is closed;
* ``"corrupt_request"``: one byte of the request body flipped, the request's checksum
  headers dropped (a store that does not check what it is sent); ``"truncate_request"``: the
  body cut in half, likewise;
* ``"corrupt_response"``: one byte of the response body flipped; ``"truncate_response"``:
  half the body sent under the full Content-Length, then the connection closed;
* ``"corrupt_unchecked_response"`` (never drawn at random): one byte of the response body
  flipped and the response's checksum headers dropped, so the client cannot tell (an object
  stored without a checksum, a path that damages what it carries).
"""

from __future__ import annotations

import contextlib
import http.client
import random
import re
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

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
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}
_CHECKSUM_HEADERS = re.compile(
    r"^(content-md5|x-amz-checksum-.*|x-amz-sdk-checksum-.*|x-amz-trailer)$"
)
_BODY_FAULTS = {"corrupt_request", "truncate_request"}


class FaultProxy:
    def __init__(self, upstream: str, seed: int = 0, stall_s: float | None = 2.0) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.rng = random.Random(seed)
        self.stall_s = stall_s  # None: a stall ends only when the proxy stops
        self._stopped = threading.Event()
        self.rules: list[list[Any]] = []  # [method, path, body, fault, times left]
        self.rate = 0.0
        self.kinds: tuple[str, ...] = KINDS
        self.injected: dict[str, int] = {}
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                proxy._handle(self)

            do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()

    def rule(
        self, method: str, path: str, fault: str, body: bytes | None = None, times: int = -1
    ) -> None:
        """Every ``method`` request whose path matches ``path`` (and body ``body``) gets
        ``fault``; only the first ``times`` of them when ``times`` >= 0."""
        pat = None if body is None else re.compile(body)
        self.rules.append([method, re.compile(path), pat, fault, times])

    def clear(self) -> None:
        self.rules.clear()
        self.rate = 0.0

    # ------------------------------------------------------------------ one request
    def _pick(self, method: str, path: str, body: bytes) -> str | None:
        with self._lock:
            fault = None
            for r in self.rules:
                m, p, b, f, times = r
                if times and m == method and p.search(path) and (b is None or b.search(body)):
                    fault, r[4] = f, times - 1
                    break
            if fault is None and self.rate and self.rng.random() < self.rate:
                kinds = [k for k in self.kinds if body or k not in _BODY_FAULTS]
                fault = self.rng.choice(kinds)
            if fault is not None:
                self.injected[fault] = self.injected.get(fault, 0) + 1
            flip = self.rng.randrange(1 << 30)
        return None if fault is None else f"{fault}:{flip}"

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        body = _read_body(h)
        picked = self._pick(h.command, h.path, body)
        fault, _, salt = (picked or "").partition(":")
        if fault in ("500", "503"):
            code = "InternalError" if fault == "500" else "SlowDown"
            data = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
            h.send_response(int(fault))
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(data)
            return
        if fault == "reset":
            return _reset(h)
        if fault == "stall":
            self._stopped.wait(self.stall_s)
            return _reset(h)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        if fault in _BODY_FAULTS and body:
            headers = {k: v for k, v in headers.items() if not _CHECKSUM_HEADERS.match(k.lower())}
            cut = body[: len(body) // 2]
            body = _flip(body, int(salt)) if fault == "corrupt_request" else cut
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
        if (
            fault.startswith("corrupt_")
            and fault.endswith("response")
            and data
            and h.command == "GET"
        ):
            data = _flip(data, int(salt))
        if fault == "corrupt_unchecked_response":
            out_headers = [(k, v) for k, v in out_headers if not _CHECKSUM_HEADERS.match(k.lower())]
        cut = fault == "truncate_response" and len(data) > 1 and h.command == "GET"
        h.send_response(status)
        for k, v in out_headers:
            if k.lower() not in _HOP:
                h.send_header(k, v)
        h.send_header("Content-Length", str(full))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data[: full // 2] if cut else data)
        if cut:
            h.wfile.flush()
            _reset(h)


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
