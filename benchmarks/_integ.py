"""What every framework of ``bench_integrations`` shares (not a test): the row, the model
(the same in every framework: an AdamW embedding and four Muon matrices), the clock, and the
loop over a framework's cases (a saving run, then the same command again, which resumes)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Row:
    framework: str
    path: str
    offload: bool
    blocked_ms: float
    resume_ms: float
    fit_s: float
    step_mib: float


@dataclass
class Case:
    """One save path of a framework: ``child`` (a JSON list) tells the child process what
    to build; ``saved`` globs the run's checkpoints (the newest is measured)."""

    name: str
    offload: bool
    child: list[Any]
    saved: list[str] = field(default_factory=lambda: ["step-*"])


class Net(nn.Module):
    """The benchmarks' model: ``vocab x width`` embedding rows (AdamW) and four
    ``width x width`` matrices (Muon)."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])

    def loss(self, tokens: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.blocks(self.embed(tokens)).mean(1), y)

    def muon_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        mats = [p for p in self.blocks.parameters() if p.ndim == 2]
        return mats, [p for p in self.parameters() if all(p is not m for m in mats)]


def data(a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows and targets for ``a.steps + 2`` batches of 8."""
    g = torch.Generator().manual_seed(1)
    n = 8 * (a.steps + 2)
    return torch.randint(0, a.vocab, (n, 16), generator=g), torch.randn(n, a.width)


class Clock:
    """When each batch starts and ends (with the step it ended), from when the run began."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.starts: list[float] = []
        self.ends: list[tuple[int, float]] = []

    def begin(self) -> None:
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.starts.append(time.perf_counter())

    def end(self, step: int) -> None:
        self.ends.append((step, time.perf_counter()))

    def result(self, every: int) -> dict[str, Any]:
        """``blocked``: how much longer the gap after a saving step is than after another
        (medians); ``to_first_batch``: from the run's start to its first batch."""
        gaps = [(s, self.starts[i + 1] - t) for i, (s, t) in enumerate(self.ends[:-1])]
        saved = [g for s, g in gaps if s % every == 0]
        plain = [g for s, g in gaps if s % every != 0]
        return {
            "to_first_batch": self.starts[0] - self.t0,
            "blocked": statistics.median(saved) - statistics.median(plain) if saved else 0.0,
            "fit_s": time.perf_counter() - self.t0,
            "saves": len(saved),
        }


def _dir_mib(path: str) -> float:
    if os.path.isfile(path):
        return os.path.getsize(path) / 2**20
    files = [f for f in glob.glob(os.path.join(path, "**"), recursive=True) if os.path.isfile(f)]
    return sum(os.path.getsize(f) for f in files) / 2**20


def _child(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_integrations", *args],
        capture_output=True,
        text=True,
        env=env,
    )
    if r.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_cases(framework: str, child_of: str, cases: list[Case], a: argparse.Namespace) -> list[Row]:
    """Each case in a fresh directory: a saving run, then the same command, which resumes."""
    rows = []
    for case in cases:
        where = tempfile.mkdtemp(dir=a.dir)
        os.rmdir(where)  # a fresh run: the url does not exist yet
        child = ["--child", json.dumps(case.child), "--child-of", child_of, "--dir", where]
        child += ["--steps", str(a.steps), "--every", str(a.every)]
        child += ["--vocab", str(a.vocab), "--width", str(a.width)]
        fit = _child(child)
        saved = [f for pattern in case.saved for f in glob.glob(os.path.join(where, pattern))]
        size = _dir_mib(max(saved, key=os.path.getmtime)) if saved else 0.0
        again = _child(child)
        rows.append(
            Row(
                framework,
                case.name,
                case.offload,
                1e3 * fit["blocked"],
                1e3 * (again["to_first_batch"] - fit["to_first_batch"]),
                fit["fit_s"],
                size,
            )
        )
        shutil.rmtree(where, ignore_errors=True)
    return rows
