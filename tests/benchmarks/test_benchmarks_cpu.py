"""The benchmarks behind docs/benchmarks.md run: each one's CPU mode at tiny sizes, in a process
of its own (forked from the ranks' forkserver: tests/_dist.py, run_module), ends with its
report (the figures themselves are measured on a GPU; see docs/gpu.md). Nothing here is
timed: a line of the report is what each waits for."""

from __future__ import annotations

import pytest

from tests import REPO
from tests._dist import run_module

# name -> (arguments of `python -m benchmarks.<module>`, a line of its report)
RUNS = {
    "muon": (
        [
            "bench_muon", "--device", "cpu", "--tiny", "--iters", "1", "--profile", "--variants",
            "torch", "ours", "other-method", "offload", "ns-batches", "ns-batches-other",
        ],
        "| case | ours / torch | offload on / off |",
    ),
    "mesh": (
        ["bench_muon_mesh", "--device", "cpu", "--tiny"],
        "| layout | mesh | NS matrices per rank |",
    ),
    "offload": (
        ["bench_offload", "--device", "cpu", "--tiny", "--iters", "1", "--profile"],
        "| set | off ms | on ms | on / off (target) |",
    ),
    "deferred": (
        [
            "bench_async_save", "--device", "cpu", "--case", "2x64", "--rounds", "1",
            "--snapshot", "deferred",
        ],
        "2x64:defer offload off: e2e",
    ),
    "every-step": (
        [
            "bench_memory_tier", "overhead", "--device", "cpu", "--case", "2x32", "--steps", "3",
            "--every", "1", "--snapshot", "deferred", "--offload", "on", "off",
        ],
        "deferred memory every   1 steps: median",
    ),
    "tier-restore": (
        [
            "bench_memory_tier", "restore", "--world", "1", "--node-size", "1", "--size-gib",
            "0.001", "0.002", "--rounds", "1",
        ],
        "memory vs storage hot",
    ),
    "planning": (
        ["bench_planning", "--tiny", "--gloo", "2"],
        "every one bitwise equal after the load",
    ),
    "resume": (
        [
            "bench_resume", "--device", "cpu", "--size-gib", "0.01", "--layouts", "one",
            "--methods", "physical", "load", "--processes", "fresh", "--caches", "hot",
            "--rounds", "1",
        ],
        "one     hot   fresh",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(RUNS))
def test_the_cpu_mode_of_the_benchmark_runs_to_its_report(name):
    args, line = RUNS[name]
    env = {"PYTHONPATH": REPO, "CUDA_VISIBLE_DEVICES": ""}
    done = run_module(  # (a hang stops the suite, never a slow machine)
        ["-m", f"benchmarks.{args[0]}", *args[1:]], timeout=1800, env=env, cwd=REPO
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert line in done.stdout, done.stdout[-4000:]
