"""Text from a checkpoint never reaches the terminal raw: a manifest's ``time``, a
state-dict key (an ordinary save can hold ``"\\x1b[2K\\rmodel.x"``), a stored value and a
``step-*`` directory name are printed by ``ls``, ``inspect`` and ``export`` with every
non-printable character escaped, so a row cannot clear the screen, move the cursor or reorder
itself (a bidi override); ``--json`` is escaped by JSON itself."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from muon_ckpt import CheckpointCorruptError, CheckpointManager
from muon_ckpt.cli import main
from muon_ckpt.cli._text import one_line as _one_line
from muon_ckpt.cli._text import printable as _printable
from muon_ckpt.store import MANIFEST, Storage, step_dirname

CLEAR = "\x1b[2K\r"  # erase the line, back to its start: the next text overwrites the row
NAME = CLEAR + "w"  # a parameter name (register_parameter refuses only "." and "")
EXTRA = "\u202enote\x07"  # a bidi override and a bell, in an extra state's key
RAW = ("\x1b", "\r", "\x07", "\u202e", "\x9b")  # what must not reach the terminal


class _Notes:
    def state_dict(self) -> dict[str, Any]:
        return {EXTRA: "value with \x1b]0;title\x07 in it", "n": torch.tensor([1.0, 2.0])}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


@pytest.fixture
def crafted_run(tmp_path: Any) -> str:
    """A run saved the ordinary way with control codes in a key and an extra value; then its
    manifest's time rewritten (and its checksum unaffected: the manifest has none), and a
    directory named like a step with a control code."""
    url = str(tmp_path / "run")
    model = torch.nn.Module()
    model.register_parameter(NAME, torch.nn.Parameter(torch.ones(2, 3)))
    with CheckpointManager(url, model=model, extra={"notes": _Notes()}) as mgr:
        mgr.save(1)
    st = Storage(url)
    m = json.loads(st.read_bytes(step_dirname(1), MANIFEST))
    m["time"] = "\x1b[2J\x1b[H" + m["time"] + "\r\x9b31m"
    st.write_bytes(json.dumps(m).encode(), step_dirname(1), MANIFEST)
    os.mkdir(os.path.join(url, "step-\x1b[31m1"))
    return url


def _shown(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out + err


@pytest.mark.parametrize("command", ["ls", "inspect", "export"])
def test_text_output_escapes_what_comes_from_the_checkpoint(crafted_run, capsys, tmp_path, command):
    argv = {
        "ls": ["ls", crafted_run],
        "inspect": ["inspect", crafted_run],
        "export": [
            "export",
            crafted_run,
            str(tmp_path / "o.safetensors"),
            "--include",
            "model",
            "extra",
        ],
    }[command]
    rc, shown = _shown(capsys, *argv)
    assert rc == 0, shown
    assert not [c for c in RAW if c in shown], repr(shown)
    assert all(line.isprintable() for line in shown.splitlines()), repr(shown)
    escaped = {  # escaped, not dropped: what is stored stays visible
        "ls": ["step-\\x1b[31m1", "\\x1b[2J\\x1b[H", "\\r\\x9b31m"],
        "inspect": ["\\x1b[2K\\rw", "\\u202enote\\x07", "\\x1b[2J\\x1b[H"],
        "export": ["\\u202enote\\x07"],
    }[command]
    assert all(e in shown for e in escaped), shown


def test_json_output_stays_exact(crafted_run, capsys):
    rc, out = _shown(capsys, "inspect", crafted_run, "--json")
    assert rc == 0
    keys = {k["key"] for k in json.loads(out)["keys"]}
    assert f"model.{NAME}" in keys and f"extra.notes.{EXTRA}" in keys


def test_an_error_line_escapes_too():
    """An error's message may carry names from the checkpoint: its one line is escaped."""
    line = _one_line(CheckpointCorruptError(f"step 3: key {NAME} is bad\nsee \x1b[31mthis"))
    # (whitespace, \r and \n included, is one space: one line)
    assert line == "CheckpointCorruptError: step 3: key \\x1b[2K w is bad see \\x1b[31mthis"


def test_printable_escapes_only_what_a_terminal_would_act_on():
    assert _printable("model.layers.0.w  ümlaut 漢字 \\x") == "model.layers.0.w  ümlaut 漢字 \\x"
    assert _printable(CLEAR + "a\nb\t\u202e\x9b") == "\\x1b[2K\\ra\\nb\\t\\u202e\\x9b"
