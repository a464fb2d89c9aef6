"""The optional ``zstandard`` package (``compression="zstd"``, ``store._codec``): imported
when needed, with an error that says how to install it."""

from __future__ import annotations

from typing import Any

__all__ = ["require_zstd"]


def require_zstd() -> Any:
    """The ``zstandard`` module, or an ImportError that says how to get it."""
    try:
        import zstandard
    except ImportError as e:
        raise ImportError(
            "compression='zstd' (and reading a step saved with it) needs the zstandard "
            "package: pip install 'muon-ckpt[zstd]' (or pip install zstandard)"
        ) from e
    return zstandard
