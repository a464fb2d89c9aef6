"""Preemption: a signal (SIGTERM by default) becomes "finish the pending save, save the
current step, exit with code 0", on every rank, at the next ``save()``.

A handler cannot save in the middle of a forward or an optimizer step, so it only sets a
flag. Every ``save(step)`` call of a watching manager (due or not) then asks the other ranks
whether any of them got the signal (one all-reduce of one integer on the manager's gloo
group), so that all ranks decide at the same step. Nothing is installed unless asked
(``CheckpointManager.watch_preemption``); ``close()`` puts the previous handlers back.
"""

from __future__ import annotations

import datetime
import logging
import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from muon_ckpt._collective import comm_failure, rank

__all__ = ["PreemptionWatch"]

_log = logging.getLogger("muon_ckpt")


_LAST_WORK: list[Any] = []  # the exit's last collective (``exit``), kept until the end


class PreemptionWatch:
    """Signal handlers that set ``received`` (installed from the main thread)."""

    def __init__(self, signals: Iterable[int]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "watch_preemption() installs signal handlers, which Python allows only in "
                "the main thread; call it from there"
            )
        self.received: int | None = None  # the signal number, once one came
        self._group: Any = None  # the gloo group of the agreement (``agreed``)
        self._previous: dict[int, Any] = {}
        for s in dict.fromkeys(int(s) for s in signals):
            self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        # Only a flag: a handler runs between two bytecodes of whatever the main thread does.
        if self.received is None:
            self.received = signum

    def agreed(self, timeout: float, step: int) -> bool:
        """Whether any rank received a signal, at the ``save(step)`` every rank is in: a
        collective on a gloo group of its own (made by the first call), since the manager's
        group may be busy with a save in the background, and two threads' collectives on one
        group would pair up wrongly across ranks."""
        flag = torch.tensor([self.received or 0], dtype=torch.int32)
        try:
            if dist.is_available() and dist.is_initialized():
                if self._group is None:
                    self._group = dist.new_group(
                        backend="gloo", timeout=datetime.timedelta(seconds=timeout)
                    )
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        except RuntimeError as e:
            raise comm_failure(e, "agreeing on preemption") from e
        signum = int(flag.item())
        if signum and self.received is None:
            self.received = signum  # another rank's
        if signum and rank() == 0:
            _log.warning(
                "preempted (%s): finishing the pending save, then saving step %d",
                signal.Signals(signum).name,
                step,
            )
        return bool(signum)

    def exit(self, step: int) -> None:
        """Step ``step`` is committed: leave the training loop with exit code 0."""
        if rank() == 0:
            _log.warning("preempted: step %d is committed; exiting with code 0", step)
        if self._group is not None:
            # torch + gloo may abort the process at exit ("terminate called without an
            # active exception", pytorch#190489) when it ends right after a blocking
            # collective: the last one is asynchronous, and its Work lives until the exit.
            work = dist.barrier(group=self._group, async_op=True)
            work.wait()
            _LAST_WORK.append(work)
        raise SystemExit(0)

    def restore(self) -> None:
        """Put the handlers back that were there before (main thread only: elsewhere, at
        exit, they are left as they are)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
