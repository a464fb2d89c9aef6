"""CRC implementations: which code computes CRC32C here, and zlib's crc32 for older manifests.

CRC32C (Castagnoli) is the default checksum of new manifests: CPUs compute it in hardware
(SSE4.2 ``crc32``, ARMv8 ``crc32c``) at memory speed, and S3 and GCS use it for object
checksums. Python has no CRC32C of its own; the first of these that imports is used:

* ``crc32c`` (the ``crc32c`` package): any buffer (tensor memory, bytearray) without a copy,
  the GIL released; hardware-accelerated where the CPU has the instruction;
* ``google-crc32c`` (the ``google-crc32c`` package's C extension): hardware-accelerated, but
  it takes ``bytes`` only (a buffer is copied first);
* ``python``: a table-driven CRC32C in pure Python, correct but about a thousand times
  slower; used only to READ a CRC32C manifest when neither package is installed (with a
  one-time warning), never chosen for writing.

Without a fast CRC32C, saves record zlib's crc32 (``write_algorithm``), with a one-time
warning: verification is never skipped, only the algorithm changes (the manifest says which).
``MUON_CKPT_CRC32C=crc32c|google-crc32c|python`` forces one implementation (benchmarks, tests).
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
import zlib
from collections.abc import Callable
from typing import Any

__all__ = ["ALGORITHMS", "crc_function", "implementation", "write_algorithm"]

log = logging.getLogger("muon_ckpt")

CRC32C, CRC32 = "crc32c", "crc32"
ALGORITHMS = (CRC32C, CRC32)
_ENV = "MUON_CKPT_CRC32C"
_INSTALL = "pip install crc32c (or google-crc32c)"

CrcFn = Callable[[int, Any], int]  # (running crc, bytes-like) -> crc


def _zlib_crc32(crc: int, data: Any) -> int:
    return zlib.crc32(data, crc)


def _table() -> list[int]:
    poly, out = 0x82F63B78, []  # CRC32C, reflected
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        out.append(c)
    return out


_TABLE: list[int] = []


def _python_crc32c(crc: int, data: Any) -> int:
    if not _TABLE:
        _TABLE.extend(_table())
    t, c = _TABLE, crc ^ 0xFFFFFFFF
    for b in memoryview(data).cast("B"):
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _load(name: str) -> CrcFn | None:
    """The CRC32C function of implementation ``name``, or None when it does not import."""
    if name == "python":
        return _python_crc32c
    try:
        if name == "crc32c":
            import crc32c

            fn = crc32c.crc32c
            return lambda crc, data: fn(data, crc)
        if name == "google-crc32c":
            import google_crc32c

            if google_crc32c.implementation != "c":
                return None  # its own pure-Python fallback: no faster than ours
            ext = google_crc32c.extend

            def g(crc: int, data: Any) -> int:
                # It parses bytes only ("y#"), and releases the GIL for bytes only.
                return ext(crc, data if isinstance(data, bytes) else bytes(data))

            return g
    except ImportError:
        return None
    raise ValueError(
        f"{_ENV}={name!r} is not a CRC32C implementation; expected one of crc32c, "
        "google-crc32c, python (or leave it unset)"
    )


_lock = threading.Lock()
_chosen: tuple[str, CrcFn] | None = None
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    log.warning(message)


def _crc32c() -> tuple[str, CrcFn]:
    """(name, function) of the CRC32C implementation of this process, chosen once."""
    global _chosen
    if _chosen is None:
        forced = os.environ.get(_ENV)
        for name in [forced] if forced else ["crc32c", "google-crc32c", "python"]:
            fn = _load(name)
            if fn is not None:
                _chosen = (name, fn)
                break
        else:
            raise ImportError(
                f"{_ENV}={forced}: that package does not import here; {_INSTALL}, or unset it"
            )
    return _chosen


def implementation() -> str:
    """Which code computes CRC32C in this process: crc32c, google-crc32c or python."""
    return _crc32c()[0]


def write_algorithm() -> str:
    """The algorithm new manifests record: CRC32C when a fast implementation is installed,
    else zlib's crc32 (with a one-time warning)."""
    if _crc32c()[0] != "python":
        return CRC32C
    _warn_once(
        "write",
        "muon-ckpt: no hardware CRC32C package is installed, so checkpoints are checksummed "
        f"with zlib's crc32 (slower; the manifest records which). {_INSTALL} for CRC32C",
    )
    return CRC32


def crc_function(algorithm: str, where: str = "") -> CrcFn:
    """The running-CRC function of ``algorithm`` (a manifest's ``crc32c`` or ``crc32``)."""
    if algorithm == CRC32:
        return _zlib_crc32
    if algorithm == CRC32C:
        name, fn = _crc32c()
        if name == "python":
            _warn_once(
                "read",
                f"muon-ckpt: {where or 'this checkpoint'} records CRC32C checksums and no "
                f"CRC32C package is installed: verifying with a pure-Python CRC32C, which is "
                f'very slow. {_INSTALL}, or load with verify="size" to check sizes only',
            )
        return fn
    raise ValueError(f"checksum algorithm {algorithm!r}: expected one of {ALGORITHMS}")
