"""DCP safety pieces: non-tensor values loaded with ``weights_only=True``, and the one place
that turns DCP's failures back into muon-ckpt's errors.

DCP loads non-tensor values with ``torch.load(weights_only=False)``; here they go through
``weights_only=True``. (The ``.metadata`` pickle is read by ``store``'s restricted
unpickler; tensors are read by ``_itemread`` or DCP's ``weights_only`` reader.)
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from muon_ckpt._errors import CheckpointCorruptError, CheckpointError, CheckpointStorageError
from muon_ckpt.io._stored import UntrustedItem
from muon_ckpt.store import is_storage_failure

__all__ = ["DCP_ERRORS", "SafeLoadPlanner", "dcp_failure", "interrupt_in"]

# What a failed dcp.save/dcp.load raises: DCP's CheckpointException derives from BaseException.
DCP_ERRORS = (Exception, CheckpointException)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with ``weights_only=True``.

    ``before_write(key)``: called before a target tensor is handed out to be written into
    (every write of a load goes through ``resolve_tensor``), from the reading threads."""

    def __init__(self, before_write: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self._before_write = before_write

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if self._before_write is not None:
            self._before_write(read_item.dest_index.fqn)
        return super().resolve_tensor(read_item)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def interrupt_in(e: BaseException) -> BaseException | None:
    """The interrupt (KeyboardInterrupt, SystemExit: a BaseException that is not an
    Exception) that a failed ``dcp.save``/``dcp.load`` wraps, if any: DCP turns everything
    raised inside it into a CheckpointException, and a Ctrl-C must leave as itself."""
    if not isinstance(e, Exception):
        failures: dict[int, Any] = getattr(e, "failures", None) or {}
        for v in failures.values():
            cause = v[0] if isinstance(v, tuple) else v
            if isinstance(cause, BaseException) and not isinstance(cause, Exception):
                return cause
        if not hasattr(e, "failures"):
            return e
    return None


def dcp_failure(e: BaseException, what: str) -> CheckpointError:
    """The CheckpointError to raise for a failed ``dcp.save``/``dcp.load``: DCP wraps the
    failures of every rank (``CheckpointException.failures``); a CheckpointError raised by one
    of ours inside DCP comes back as itself (same class and message), an untrusted stored item
    (``_stored``) as a CheckpointCorruptError, anything else as a
    CheckpointError (a CheckpointStorageError when the storage failed) naming ``what`` and
    the first cause."""
    if isinstance(e, CheckpointError):
        return e
    failures: dict[int, Any] = getattr(e, "failures", None) or {}
    causes = [v[0] if isinstance(v, tuple) else v for _, v in sorted(failures.items())]
    for c in causes:
        if isinstance(c, CheckpointError):
            return type(c)(str(c))
        if isinstance(c, UntrustedItem):  # (its file's checksum found nothing, or none ran)
            return CheckpointCorruptError(str(c))
    first = causes[0] if causes else e
    ranks = f" on rank(s) {sorted(failures)}" if failures else ""
    cls = CheckpointStorageError if is_storage_failure(first) else CheckpointError
    return cls(f"{what} failed{ranks}: {type(first).__name__}: {first}")


# DCP warns on every save or load without a process group ("torch.distributed is disabled,
# unavailable or uninitialized, assuming the intent is to save in a single process"): that is
# the normal case of a single process here. Filtered once, at import: catch_warnings() is not
# thread-safe, and background saves run in their own thread.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable")
