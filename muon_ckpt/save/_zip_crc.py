"""``torch.save`` without its zip records' crc32, in the calling thread.

The manifest's checksums cover every byte a save writes; torch.save's per-record crc32 would
be a second full pass over them (``torch.serialization.set_crc32_options``). Recent torch keeps
the switch per thread (set it in each writer thread); older builds share one setting, so
concurrent users share one switch and the last one out restores the caller's.
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from contextlib import contextmanager

import torch

from muon_ckpt._threads import beside

__all__ = ["torch_save_without_zip_crc"]

_zip_crc_get = getattr(torch.serialization, "get_crc32_options", None)
_zip_crc_set = getattr(torch.serialization, "set_crc32_options", None)
_zip_crc_lock = threading.Lock()
_zip_crc_users = 0
_zip_crc_saved = True
_zip_crc_thread_local: bool | None = None


def _zip_crc_per_thread() -> bool:
    """Whether torch keeps the crc32 switch per thread (torch 2.13 does; older builds share
    one setting). Probed once: a helper thread flips it and this thread looks."""
    global _zip_crc_thread_local
    if _zip_crc_thread_local is None:
        assert _zip_crc_get is not None and _zip_crc_set is not None
        with _zip_crc_lock:
            before = _zip_crc_get()
            with beside(_zip_crc_set, not before):
                pass
            _zip_crc_thread_local = _zip_crc_get() == before
            if not _zip_crc_thread_local:
                _zip_crc_set(before)  # shared: undo the probe
    return _zip_crc_thread_local


@contextmanager
def torch_save_without_zip_crc() -> Generator[None, None, None]:
    """torch.save in this thread skips its per-record crc32 for the duration. Where torch
    shares one setting between threads, concurrent uses share one switch and the last one
    out restores the caller's setting."""
    global _zip_crc_users, _zip_crc_saved
    if _zip_crc_get is None or _zip_crc_set is None:  # pragma: no cover - no switch in torch
        yield
        return
    if _zip_crc_per_thread():
        saved = _zip_crc_get()
        _zip_crc_set(False)
        try:
            yield
        finally:
            _zip_crc_set(saved)
        return
    with _zip_crc_lock:
        if _zip_crc_users == 0:
            _zip_crc_saved = _zip_crc_get()
            _zip_crc_set(False)
        _zip_crc_users += 1
    try:
        yield
    finally:
        with _zip_crc_lock:
            _zip_crc_users -= 1
            if _zip_crc_users == 0:
                _zip_crc_set(_zip_crc_saved)
