"""README.md is a guide that is true, and docs/reference.md is the code's reference.

The reference's tables are the manager's options and MemoryOptions' fields (names, defaults,
and the one description each has, ``_config.OPTIONS`` and ``MEMORY_OPTIONS``), the manager's
methods and their parameters, Muon's group keys and defaults, and the command's subcommands and
flags. README's single-process quick start runs as written, its set-up commands are the ones
CI runs, and its command-line session (list, damage a data file, verify, export) does what it
shows on a run of two ranks."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import subprocess
import sys

import torch

from muon_ckpt import CheckpointManager, MemoryOptions
from muon_ckpt._config import MEMORY_OPTIONS, OPTIONS, ManagerConfig
from optim._config import GROUP_DEFAULTS
from tests import REPO
from tests._dist import run_on_ranks

_README, _REFERENCE = "README.md", os.path.join("docs", "reference.md")


def _doc(name: str) -> str:
    with open(os.path.join(REPO, name)) as f:
        return f.read()


def _section(title: str, doc: str = _README) -> str:
    text = _doc(doc)
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def _default_text(value: object) -> str:
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return "—"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def _table(section: str, header: str, doc: str = _REFERENCE) -> list[list[str]]:
    table = _section(section, doc).split(header)[1].split("\n\n")[0]  # up to the first blank line
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
    rows = _table("MemoryOptions", "| `MemoryOptions` field | default | meaning |")
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


def test_the_methods_table_is_the_managers_methods():
    rows = _table("CheckpointManager", "| method | what it does |")
    named = [m for row in rows for m in re.findall(r"`(\w+)(?:\(([^)]*)\))?", row[0])]
    assert [n for n, _ in named] == [
        "save",
        "wait",
        "load",
        "steps",
        "latest_step",
        "step_info",
        "watch_preemption",
        "close",
        "durable_step",
    ]
    for name, args in named:
        member = inspect.getattr_static(CheckpointManager, name)
        if isinstance(member, property):
            continue
        want = list(inspect.signature(member).parameters)[1:]
        shown = [a.split("=")[0].strip() for a in args.split(",") if a.strip() not in ("", "*")]
        assert shown == want, name


def test_the_group_keys_table_is_muons_group_defaults():
    rows = _table("Muon", "| group key | default | meaning |")
    shown: dict[str, str] = {}
    for keys, defaults, _ in rows:
        names, values = re.findall(r"`(\w+)`", keys), re.findall(r"`([^`]+)`", defaults)
        shown.update(zip(names, values or ["—"] * len(names), strict=True))
    assert list(shown) == ["params", "names", *[k for k in shown if k in GROUP_DEFAULTS]]
    assert set(shown) == {"params", "names", *GROUP_DEFAULTS}
    for key, default in GROUP_DEFAULTS.items():
        assert ast.literal_eval(shown[key]) == default, key


def test_the_command_table_is_the_commands_parser():
    import argparse

    from muon_ckpt.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {n: {o for a in p._actions for o in a.option_strings} for n, p in sub.choices.items()}
    rows = _table("The muon-ckpt command", "| command | what it does |")
    commands = [row[0].strip("`").split()[0] for row in rows]
    assert set(commands) == set(flags)
    for row, command in zip(rows, commands, strict=True):
        used = set(re.findall(r"--[a-z][a-z-]*", row[0]))
        assert used <= flags[command], (command, used - flags[command])


def _quick_start() -> str:
    block = re.search(r"```python\n(.*?)```", _section("Quick start: one process"), re.S)
    assert block is not None
    return block.group(1)


def test_the_single_process_quick_start_runs_as_written(tmp_path):
    code = _quick_start()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
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
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = f.read()
    pip = install.split(" && ")[2]  # pip install ... (the demo runs in the test suite)
    assert pip.replace("pip install ", "pip install -q ") in ci
    assert tests.split(" && ")[1] in ci


def _demo_like_run(rank: int, world_size: int, url: str) -> None:
    """Steps 30, 35 and 40 of a model sharded by FSDP2 on 2 ranks, as ``muon-ckpt demo``
    leaves them: every tensor changed between saves, 4 data files per rank."""
    from torch.distributed.fsdp import fully_shard

    from optim import Muon

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    fully_shard(model)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    opt = Muon([{"params": matrices}, {"params": others, "use_muon": False}])
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        for step in (30, 35, 40):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step)


def _shape(text: str) -> list[str]:
    """Output lines without what differs between two runs: save ids, sizes, times, counts."""
    for pattern, put in (
        (r"[0-9a-f]{16}", "<id>"),
        (r"\d+(\.\d+)? (B|KiB|MiB|GiB)\b", "<size>"),
        (r"bytes \d+-\d+", "bytes <range>"),
        (r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", "<time>"),
        (r"\d+ tensors", "<n> tensors"),
    ):
        text = re.sub(pattern, put, text)
    return [" ".join(line.split()) for line in text.strip().splitlines()]


def test_the_command_line_session_finds_the_damage_it_shows(tmp_path):
    run_on_ranks(_demo_like_run, 2, str(tmp_path / "checkpoints"))
    block = re.search(r"```console\n(.*?)```", _section("The `muon-ckpt` command"), re.S)
    assert block is not None
    sessions = re.split(r"^\$ ", block.group(1), flags=re.M)[1:]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    shell = f'muon-ckpt() {{ "{sys.executable}" -m muon_ckpt.cli "$@"; }}\n'
    codes = []
    for session in sessions:
        command, _, shown = session.partition("\n")
        r = subprocess.run(
            ["bash", "-c", shell + command],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert _shape(r.stdout) == _shape(shown), (command, r.stdout, r.stderr)
        codes.append((command.split()[:2], r.returncode))
    verify = [rc for words, rc in codes if words == ["muon-ckpt", "verify"]]
    assert verify == [1] and sum(rc for _, rc in codes) == 1  # only verify fails: the damage
