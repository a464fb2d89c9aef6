"""What the resume contract's tests share: a Stateful ``extra`` (a data position), one
whose first load fails after every tensor is written, the manager's log records, and a flipped
byte in a step's largest file."""

from __future__ import annotations

import logging

import torch

from muon_ckpt.store import Storage
from tests._ckpt import biggest_data_file


class Counter:
    """A Stateful ``extra``: a data position (a plain value and a tensor)."""

    def __init__(self, pos: int = 0) -> None:
        self.pos = pos
        self.seen = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"pos": self.pos, "seen": self.seen}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]
        self.seen.copy_(sd["seen"])


class Records(logging.Handler):
    def __init__(self, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))

    def __enter__(self) -> Records:
        lg = logging.getLogger("muon_ckpt")
        self._old = lg.level
        lg.setLevel(logging.INFO)
        lg.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        lg = logging.getLogger("muon_ckpt")
        lg.removeHandler(self)
        lg.setLevel(self._old)

    def at(self, level: int) -> list[str]:
        return [m for lv, m in self.messages if lv == level]


def flip_byte_in(st: Storage, step_dir: str, name: str) -> None:
    data = bytearray(st.read_bytes(step_dir, name))
    data[len(data) // 2] ^= 0xFF
    st.write_bytes(bytes(data), step_dir, name)


def largest_file(st: Storage, step_dir: str) -> str:
    return biggest_data_file(st, int(step_dir[-8:]))


class FailsToApply(Counter):
    """``extra`` whose first load_state_dict() fails: after DCP has written every tensor
    (the second, restore()'s, succeeds)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def load_state_dict(self, sd: dict) -> None:
        self.calls += 1
        if self.calls == 1:
            raise ValueError("cannot take the state")
        super().load_state_dict(sd)
