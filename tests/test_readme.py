"""README.md is true: its options tables are the manager's and MemoryOptions' (names,
defaults, and the one description each has, ``_config.OPTIONS`` and ``MEMORY_OPTIONS``), its
single-process quick start runs as written, and its set-up commands are the ones CI runs."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys

from muon_ckpt import CheckpointManager, MemoryOptions
from muon_ckpt._config import MEMORY_OPTIONS, OPTIONS, ManagerConfig

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(_ROOT, "README.md")) as f:
        return f.read()


def _section(title: str) -> str:
    text = _readme()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def _default_text(value: object) -> str:
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return "—"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def _table(section: str, header: str) -> list[list[str]]:
    table = _section(section).split(header)[1].split("\n\n")[0]  # up to the first blank line
    return [
        [c.strip() for c in line.strip().strip("|").split(" | ")]
        for line in table.splitlines()
        if line.startswith("| `")
    ]


def _params() -> list[inspect.Parameter]:
    """CheckpointManager's options: its keywords, but the deprecated ones (``**``)."""
    params = list(inspect.signature(CheckpointManager.__init__).parameters.values())[1:]
    return [p for p in params if p.kind is not p.VAR_KEYWORD]


def test_the_options_table_is_the_managers_options():
    rows = _table("CheckpointManager", "| option | default | meaning |")
    params = _params()
    want = [[f"`{p.name}`", _default_text(p.default), OPTIONS[p.name]] for p in params]
    assert rows == want
    assert [p.name for p in params] == list(OPTIONS)


def test_the_memory_table_is_memory_options_fields():
    rows = _table("The memory tier", "| `MemoryOptions` field | default | meaning |")
    fields = dataclasses.fields(MemoryOptions)
    want = [[f"`{f.name}`", _default_text(f.default), MEMORY_OPTIONS[f.name]] for f in fields]
    assert rows == want
    assert [f.name for f in fields] == list(MEMORY_OPTIONS)
    for name, text in MEMORY_OPTIONS.items():  # the docstring is built from the one description
        assert f"{name}: {text.replace('`', '``')}" in (MemoryOptions.__doc__ or "")


def test_the_signature_and_the_config_agree_on_defaults():
    params = inspect.signature(CheckpointManager.__init__).parameters
    fields = ManagerConfig.__dataclass_fields__
    for name, f in fields.items():
        if name == "url":
            continue
        assert params[name].default == f.default, name
    assert set(fields) <= set(params)
    for name, text in OPTIONS.items():  # the docstring is built from the one description
        assert f"{name}: {text.replace('`', '``')}" in (CheckpointManager.__doc__ or "")


def _quick_start() -> str:
    block = re.search(r"```python\n(.*?)```", _section("Quick start: one process"), re.S)
    assert block is not None
    return block.group(1)


def test_the_single_process_quick_start_runs_as_written(tmp_path):
    code = _quick_start()
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for run in range(2):  # the second run resumes at step 20 and has nothing left to do
        r = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, (run, r.stderr)
        assert r.stdout.strip() == "committed steps: [15, 20]", r.stdout


def test_the_set_up_commands_are_what_ci_runs():
    block = re.search(r"```bash\n(.*?)```", _section("Set-up"), re.S)
    assert block is not None
    install, tests = block.group(1).strip().splitlines()
    with open(os.path.join(_ROOT, ".ci", "run")) as f:
        ci = f.read()
    pip = install.split(" && ")[2]  # pip install ... (the demo runs in the test suite)
    assert pip.replace("pip install ", "pip install -q ") in ci
    assert tests.split(" && ")[1] in ci
