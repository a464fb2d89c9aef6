"""Preferring the corruption error over a parser's complaint: a damaged item often fails to
parse before its file's checksum is known; and what any other failure to parse an item is."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from muon_ckpt._errors import CheckpointCorruptError, CheckpointError
from muon_ckpt.load._declared import UntrustedItem

__all__ = ["parsing", "prefer_corruption"]

T = TypeVar("T")


def prefer_corruption(run: Callable[[], T], verdict: Callable[[], BaseException | None]) -> T:
    """``run()``; if it raises (a damaged item often fails to parse before its file's checksum
    is known), raise the corruption that ``verdict()`` finds instead, when there is one. An
    item found untrusted with no corruption of its file is a crafted step: corrupt too."""
    try:
        return run()
    except CheckpointCorruptError:
        raise
    except Exception as e:
        found = verdict()
        if isinstance(found, CheckpointCorruptError):
            raise found from e
        if isinstance(e, UntrustedItem):
            raise CheckpointCorruptError(str(e)) from e
        raise


def parsing(run: Callable[[], T], where: str, hint: str = "") -> T:
    """``run()`` (parsing items of the file ``where``); anything it raises but the
    checkpoint's own errors, the storage's and ``UntrustedItem`` is a CheckpointError
    naming the file (torch.load of a damaged or crafted item raises anything)."""
    try:
        return run()
    except (CheckpointError, OSError, UntrustedItem):
        raise
    except Exception as e:
        raise CheckpointError(f"{where}: cannot load it: {type(e).__name__}: {e}{hint}") from e
