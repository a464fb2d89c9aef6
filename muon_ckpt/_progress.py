"""Progress bars (tqdm, on stderr, drawn only when stderr is a terminal) and byte sizes."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

__all__ = ["human_bytes", "progress_bar"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # unreachable


def progress_bar(
    total: int, desc: str, *, enabled: bool | None = None, stream: TextIO | None = None
) -> tqdm:
    """``with progress_bar(total_bytes, "verify") as bar: bar.update(n)``.

    ``enabled``: None draws only when ``stream`` (default stderr) is a terminal, so scripts and
    logs get no control characters.
    """
    return tqdm(
        total=max(int(total), 0),
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=stream if stream is not None else sys.stderr,
        disable=None if enabled is None else not enabled,
        dynamic_ncols=True,
    )
