"""The demo end to end (train, SIGKILL, resume, bitwise verdict), and its verdict's teeth."""

from __future__ import annotations

import subprocess
import sys

import torch

from muon_ckpt.cli import main
from muon_ckpt.demo import compare_runs


def test_demo_kills_resumes_and_passes_bitwise(tmp_path):
    url = str(tmp_path / "ckpt")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "muon_ckpt.cli",
            "demo",
            "--url",
            url,
            "--steps",
            "10",
            "--interval",
            "3",
            "--nproc",
            "2",
            "--seed",
            "1",
            "--offload",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "offload on" in out
    assert "all workers died by SIGKILL (exit codes [-9, -9])" in out
    kill_line = next(ln for ln in out.splitlines() if "SIGKILL planned at step" in ln)
    kill_at = int(kill_line.rsplit(" ", 1)[1])
    assert 3 < kill_at < 10 and kill_at % 3
    resumed = (kill_at // 3) * 3  # the newest committed step before the kill
    assert f"killed after step {kill_at}, resumed from step {resumed}" in out
    assert "verdict     PASS: the losses of 10 steps and " in out
    assert "bitwise equal to the uninterrupted run" in out
    # The checkpoints are left for the CLI to look at; keep_last=3 after the final saves.
    assert main(["ls", url]) == 0
    assert main(["verify", url]) == 0


def test_verdict_fails_on_a_single_bit_or_loss_difference():
    a = torch.randn(4, 3)
    b = a.clone()
    b[1, 2] = torch.nextafter(b[1, 2], torch.tensor(float("inf")))
    ref = {"params": {"w": a, "x": torch.zeros(2)}, "state": {"w.step": torch.tensor(3.0)}}
    same = {"params": {"w": a.clone(), "x": torch.zeros(2)}, "state": {"w.step": torch.tensor(3.0)}}
    losses = {1: (1.5).hex(), 2: (1.25).hex()}
    v = compare_runs(ref, same, losses, dict(losses))
    assert v.ok and v.loss_steps == 2 and v.tensors == 3
    v = compare_runs(ref, {**same, "params": {"w": b, "x": torch.zeros(2)}}, losses, losses)
    assert not v.ok and len(v.problems) == 1
    assert v.problems[0].startswith("params w: differs (max abs diff ")
    v = compare_runs(ref, same, losses, {1: (1.5).hex(), 2: (1.2500001).hex()})
    assert not v.ok and v.problems[0].startswith("loss of step 2: 1.2500001")
    v = compare_runs(ref, {**same, "state": {}}, losses, losses)
    assert v.problems == ["state w.step: present in only one run"]
    negzero = {**same, "params": {"w": a.clone(), "x": torch.tensor([0.0, -0.0])}}
    assert not compare_runs(ref, negzero, losses, losses).ok  # bits, not ==


def test_demo_refuses_foreign_directories_and_bad_arguments(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("user data")
    assert main(["demo", "--url", str(tmp_path)]) == 1
    assert "not created by the demo" in capsys.readouterr().err
    assert (tmp_path / "mine.txt").read_text() == "user data"
    assert main(["demo", "--url", str(tmp_path / "new"), "--steps", "5", "--interval", "5"]) == 1
    assert "--interval must be in [1, steps=5), got 5" in capsys.readouterr().err
