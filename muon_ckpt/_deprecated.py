"""CheckpointManager's keywords of before 0.3, accepted with a DeprecationWarning until 0.4
(docs/changelog.md): the memory tier's six became ``memory=MemoryOptions(...)`` and
``snapshot`` became a mode of ``async_save``. Delete this module in 0.4."""

from __future__ import annotations

import difflib
import os
import sys
import warnings
from typing import Any, TypedDict

from muon_ckpt._config import MemoryOptions

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # (torch depends on typing_extensions)
    from typing_extensions import Unpack

__all__ = ["DeprecatedOptions", "Unpack", "upgrade"]

SNAPSHOT_MODES = ("blocking", "deferred")

# Old keyword -> its MemoryOptions field.
MEMORY_RENAMES = {
    "memory_interval": "interval",
    "memory_dir": "dir",
    "replicas": "replicas",
    "node_size": "node_size",
    "memory_keep": "keep",
    "memory_flush": "flush",
}


class DeprecatedOptions(TypedDict, total=False):
    """The old keywords, typed as they were (a type checker still checks them)."""

    snapshot: str
    memory_interval: int | None
    memory_dir: str | None
    replicas: int
    node_size: int | None
    memory_keep: int
    memory_flush: bool


def _warn(old: str, value: Any, new: str, depth: int = 0) -> None:
    # stacklevel: this function, upgrade() (and ``depth`` functions it calls),
    # CheckpointManager.__init__, then the caller's line, which the warning names.
    warnings.warn(
        f"CheckpointManager({old}={value!r}): {old} is deprecated since muon-ckpt 0.3 and "
        f"removed in 0.4; pass {new}",
        DeprecationWarning,
        stacklevel=4 + depth,
    )


def upgrade(given: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """The manager's options ``given`` with the old keywords ``old`` moved to their new
    spelling, one DeprecationWarning per old keyword. TypeError for a keyword neither spelling
    has, or an option given in both spellings; ValueError for a value the old one refused."""
    for name in old:
        if name not in MEMORY_RENAMES and name != "snapshot":
            near = difflib.get_close_matches(name, [*given, *MEMORY_RENAMES, "snapshot"], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise TypeError(
                f"CheckpointManager() got an unexpected keyword argument {name!r}{hint}"
            )
    out = dict(given)
    memory = {k: v for k, v in old.items() if k in MEMORY_RENAMES}
    if memory and given.get("memory") is not None:
        names = ", ".join(f"{k}=" for k in memory)
        raise TypeError(
            f"CheckpointManager() got both memory= and {names}: the memory tier's options are "
            f"memory=MemoryOptions(...) since 0.3; pass them there only"
        )
    if "snapshot" in old and given.get("async_save") == "deferred":
        raise TypeError(
            'CheckpointManager() got both async_save="deferred" and snapshot=: the snapshot '
            'mode is async_save\'s since 0.3; pass async_save="deferred" only'
        )
    if memory:
        fields = {MEMORY_RENAMES[k]: v for k, v in memory.items()}
        for k, v in memory.items():
            off = k == "memory_interval" and v is None  # (the tier off: memory=None)
            new = "memory=None" if off else f"memory=MemoryOptions({MEMORY_RENAMES[k]}={v!r})"
            _warn(k, v, new)
        out["memory"] = _memory(fields)
    if "snapshot" in old:
        out["async_save"] = _snapshot(old["snapshot"], given.get("async_save", False))
    return out


def _memory(fields: dict[str, Any]) -> MemoryOptions | None:
    """The tier the old keywords ``fields`` (renamed) ask for. As before 0.3, without
    memory_interval the tier is off and the others do nothing, but a bad value of one is
    still a ValueError."""
    if fields.get("interval") is not None:
        return MemoryOptions(**fields)
    # (checked only: a placeholder interval and dir, so that only the values given can fail)
    d = fields.get("dir")
    MemoryOptions(**{**fields, "interval": 1, "dir": os.sep if d is None else d})
    return None


def _snapshot(mode: Any, async_save: Any) -> Any:
    """``async_save`` with the old ``snapshot=mode`` folded in."""
    if not (isinstance(mode, str) and mode in SNAPSHOT_MODES):
        raise ValueError(
            f"snapshot must be one of {SNAPSHOT_MODES}, got {mode!r}; snapshot is deprecated: "
            f'pass async_save=True (a blocking snapshot) or async_save="deferred"'
        )
    if mode == "blocking":
        _warn("snapshot", mode, "nothing: async_save=True takes a blocking snapshot", 1)
        return async_save
    _warn("snapshot", mode, 'async_save="deferred"', 1)
    if async_save is False:
        raise ValueError(
            "snapshot='deferred' needs async_save=True: a synchronous save writes the state "
            'before it returns, so there is nothing to defer; pass async_save="deferred"'
        )
    return "deferred" if async_save is True else async_save
