"""A minimal progress bar on stderr, drawn only when stderr is a terminal."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["Progress", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # unreachable


class Progress:
    """``with Progress(total_bytes, "verify") as p: p.update(n)``; silent unless on a TTY."""

    def __init__(
        self, total: int, desc: str, *, stream: TextIO | None = None, enabled: bool | None = None
    ) -> None:
        self.total = max(int(total), 0)
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.done = 0
        self._t0 = time.monotonic()
        self._last = 0.0

    def __enter__(self) -> Progress:
        return self

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.done / self.total if self.total else 1.0
        width = 30
        fill = int(width * min(frac, 1.0))
        rate = self.done / max(now - self._t0, 1e-9)
        self.stream.write(
            f"\r{self.desc} [{'#' * fill}{'.' * (width - fill)}] {frac * 100:5.1f}% "
            f"{human_bytes(self.done)}/{human_bytes(self.total)} {human_bytes(rate)}/s"
        )
        self.stream.flush()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
