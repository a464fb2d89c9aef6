"""The SIGINT storm of tests/manager/test_interrupt_storm.py with the memory tier on:
every save also keeps its step in host memory, whose job the
main thread starts (and joins at the next call) in the middle of the storm, and loads come
from the memory tier. Every SIGINT must still leave its call as exactly one
KeyboardInterrupt, with no muon-ckpt thread running but the memory job the manager holds
(joined by its next call), never an abort, and every committed step must load bitwise.

Before the fix the memory job's thread was started and joined without deferring Ctrl-C: an
interrupt that landed in ``Thread.start()`` or ``join()`` left a job the manager did not hold
(it read snapshot buffers the next save reused), or one whose release never ran. Those
windows are narrow: a storm hits them by chance, not every time; tests/manager/test_interrupt_tail.py
and tests/manager/test_interrupt_close.py hit the wider ones on purpose.
"""

from __future__ import annotations

from tests.manager.test_interrupt_storm import storm

SIGNALS = 30  # (each save writes a memory part too: slower calls, fewer signals)


def test_sigint_storm_inside_save_and_load_with_the_memory_tier(tmp_path):
    memory = {"interval": 1, "dir": str(tmp_path / "mem"), "keep": 2}
    storm(str(tmp_path / "run"), {}, SIGNALS, memory)
