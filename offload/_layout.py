"""The pool's layout: where the bytes of its tracked tensors live on the host."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["Group"]


@dataclass
class Group:
    """The flat CPU buffers of one (dtype, device) group, each allocated once and reused.

    ``cpu_flat`` receives offloads; ``frozen`` is the buffer a held snapshot froze (``freeze()``
    in ``_host.py``), None when none is held; ``spare`` is the second buffer between snapshots.
    """

    cpu_flat: Tensor
    spare: Tensor | None = None
    frozen: Tensor | None = None

    def __getitem__(self, name: str) -> Tensor:
        """``group["cpu_flat"]``: groups were dicts, and the seed acceptance test
        (tests/gpu/test_cpu_offload.py, never edited) reads ``pool._groups[key]["cpu_flat"]``."""
        if name != "cpu_flat":
            raise KeyError(name)
        return self.cpu_flat

    def nbytes(self) -> int:
        """Bytes of the buffers this group holds (one, or two once a snapshot was taken)."""
        bufs = (self.cpu_flat, self.spare, self.frozen)
        return sum(t.numel() * t.element_size() for t in bufs if t is not None)
