"""The deferred snapshot (``async_save="deferred"``): a save the training loop does not feel.

Parameters and optimizer states do not change between ``save()`` and the next
``optimizer.step()``: the forward and backward of the next step only read them. So ``save()``
queues their copies into the host buffers (device tensors on a side stream after the work
already queued; CPU tensors on a copier thread) and returns; the next step waits for them
(a step pre-hook: on the GPU in stream order, no host wait; on the CPU by joining the
copier) before it changes anything. What the next forward may write in place (buffers such
as BatchNorm's running statistics) and Python values are copied at the call; offloaded
states need no copy (they are frozen, as for any asynchronous save).

The promise stays that the checkpoint holds the state of the ``save()`` call, and what would
break it is detected: a parameter or state written in place between ``save()`` and the next
step (an EMA, a manual edit) bumps its version counter, which is compared before the step (or,
when no step came, once the copies are done); then that save fails and is not committed.
Writes through ``.data`` bypass the version counter and are not detected.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from muon_ckpt._errors import CheckpointError
from muon_ckpt._tensors import local_tensor
from muon_ckpt.state import HostStaging

__all__ = ["DeferredCopies", "hook_step"]


class DeferredCopies:
    """The copies of one save that finish after ``save()`` returned, and the version counters
    of their sources at the call."""

    def __init__(self, step: int, staging: HostStaging, sources: dict[str, torch.Tensor]) -> None:
        self.step = step
        self._staging = staging
        self._versions = {
            k: (local_tensor(t), local_tensor(t)._version) for k, t in sources.items()
        }
        self._lock = threading.Lock()
        self._changed: list[str] | None = None  # decided once: before the step, or at the write

    def before_step(self) -> None:
        """The next optimizer step is about to change parameters and states: it waits for the
        copies, and what changed since the call is noted (the save then fails)."""
        self._staging.before_step()
        self._decide()

    def verify(self) -> None:
        """Once every copy has landed (the job, before its commit): raise CheckpointError if a
        source was written in place between the call and the next step."""
        changed = self._decide()
        if changed:
            shown = ", ".join(changed[:5]) + (
                f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            )
            raise CheckpointError(
                f"saving step {self.step}: {shown} changed in place between save() and the next "
                "optimizer.step() while async_save='deferred' was still copying it, so the "
                "checkpoint cannot be the state of the save() call; it is not committed. In "
                "this mode, leave parameters and optimizer states alone until the next step "
                "(apply an EMA or manual edit after it), or use async_save=True"
            )

    def _decide(self) -> list[str]:
        with self._lock:
            if self._changed is None:
                self._changed = sorted(k for k, (t, v) in self._versions.items() if t._version != v)
                self._versions = {}
            return self._changed


def hook_step(optimizer: torch.optim.Optimizer | None, saves: Any) -> Any:
    """Make ``optimizer.step()`` wait for the deferred copies of the save ``saves.deferred``
    names (a step pre-hook, which every ``torch.optim.Optimizer`` runs); its removable handle.
    ``saves`` is held weakly: the optimizer's hook must not keep the saves (and through them
    the model and optimizer) alive in a cycle once the manager is dropped."""
    if optimizer is None:
        raise ValueError(
            "async_save='deferred' needs the optimizer: its next step() waits for the copies "
            "of a save, and nothing else tells when the parameters change; pass optimizer=, "
            "or use async_save=True"
        )

    held = weakref.ref(saves)

    def before_step(*_: Any) -> None:
        deferred = getattr(held(), "deferred", None)
        if deferred is not None:
            deferred.before_step()

    handles = [optimizer.register_step_pre_hook(before_step)]
    # An offloading optimizer's toggle moves (and parks) the states the copies read: it waits
    # for them first, as a step does, and the versions are compared before the move (a move is
    # no change of value).
    relayout = getattr(optimizer, "register_relayout_pre_hook", None)
    if relayout is not None:
        handles.append(relayout(before_step))
    return _Handles(handles)


class _Handles:
    """Removable handles removed together."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
