"""``muon-ckpt demo``: train, crash with SIGKILL, resume, and prove the resume exact.

Three launches of P worker processes (``muon_ckpt.demo._worker``, env:// rendezvous; gloo on
CPU, NCCL when P GPUs are present):

1. reference: the whole run, no checkpoints;
2. train: asynchronous checkpoints every K steps with the CheckpointManager; at a random step
   (from the seed) rank 0 SIGKILLs every worker, whatever write is in flight;
3. resume: fresh processes load the newest committed step and finish the run.

The verdict: the losses of every step and the final parameters and optimizer state of 2+3 are
bitwise equal to 1. Exit code 0 only on PASS.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from muon_ckpt._errors import CheckpointError
from muon_ckpt._progress import human_bytes
from muon_ckpt.store import Catalog, Status, Storage, parse_step_dirname

__all__ = ["DemoOptions", "Verdict", "compare_runs", "run_demo"]

MARKER = "muon-ckpt-demo.json"
_PHASE_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """What ``muon-ckpt demo`` runs (the CLI's flags of the same names)."""

    url: str = "./checkpoints"
    steps: int = 40
    nproc: int = 2
    offload: bool = False
    interval: int = 5
    seed: int = 0
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"--steps must be >= 2, got {self.steps}")
        if not 1 <= self.interval < self.steps:
            raise ValueError(f"--interval must be in [1, steps={self.steps}), got {self.interval}")
        if self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc}")


def _kill_step(steps: int, interval: int, seed: int) -> int:
    """A step after the first save, and not itself a save step when possible."""
    choices = [s for s in range(interval + 1, steps) if s % interval] or list(
        range(interval + 1, steps + 1)
    )
    return random.Random(seed).choice(choices)


def _prepare_dir(url: str, opts: dict[str, Any]) -> None:
    """Use ``url`` if it is empty or was made by an earlier demo (its steps are removed)."""
    st = Storage(url, opts)
    st.check_root()
    names = st.listdir()
    if names and MARKER not in names:
        raise CheckpointError(
            f"--url {url!r} is not empty and was not created by the demo; give a new or "
            "empty directory"
        )
    for n in names:
        if parse_step_dirname(n) is not None:
            st.rm(n)
    st.write_bytes(json.dumps({"created_by": "muon-ckpt demo"}).encode(), MARKER)


def _launch(phase: str, cfg: dict[str, Any], nproc: int, tmp: str) -> list[int]:
    cfg = {**cfg, "phase": phase, "pid_file": os.path.join(tmp, f"pids-{phase}")}
    path = os.path.join(tmp, f"cfg-{phase}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    port = _free_port()
    procs, logs = [], []
    for r in range(nproc):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            OMP_NUM_THREADS="1",
        )
        log_path = os.path.join(tmp, f"{phase}-rank{r}.log")
        logs.append(log_path)
        cmd = [sys.executable, "-m", "muon_ckpt.demo._worker", path]
        with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
            out = None if r == 0 else log
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=log))
    with open(cfg["pid_file"] + ".tmp", "w") as f:
        f.write(" ".join(str(p.pid) for p in procs))
    os.replace(cfg["pid_file"] + ".tmp", cfg["pid_file"])
    deadline = time.monotonic() + _PHASE_TIMEOUT_S
    expected = (-9,) if phase == "train" else (0,)
    while any(p.poll() is None for p in procs):
        bad = [i for i, p in enumerate(procs) if p.returncode not in (None, *expected)]
        if bad or time.monotonic() > deadline:
            time.sleep(1.0)  # let the failing rank finish writing its log
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.05)
    codes = [p.wait() for p in procs]
    bad = [i for i, c in enumerate(codes) if c not in expected]
    if bad:
        with open(logs[bad[0]]) as f:
            tail = [ln for ln in f.read().splitlines() if "Warning" not in ln][-12:]
        raise RuntimeError(
            f"demo phase {phase!r}: rank {bad[0]} exited with {codes[bad[0]]} (expected "
            f"{expected[0]}); last lines of its log {logs[bad[0]]}:\n  " + "\n  ".join(tail)
        )
    return codes


def _events(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass
class Verdict:
    ok: bool = True
    loss_steps: int = 0
    tensors: int = 0
    problems: list[str] = field(default_factory=list)


def _bits_equal(a: Any, b: Any) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a = a.contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(flat_a, b.contiguous().reshape(-1).view(torch.uint8)))


def compare_runs(
    ref: dict[str, Any], run: dict[str, Any], ref_losses: dict[int, str], losses: dict[int, str]
) -> Verdict:
    """Bitwise comparison of two runs: final tensors by name, and losses (float hex) by step."""
    v = Verdict()
    for step, val in sorted(losses.items()):
        v.loss_steps += 1
        if ref_losses.get(step) != val:
            want = ref_losses.get(step)
            v.problems.append(
                f"loss of step {step}: {float.fromhex(val)!r}, uninterrupted run: "
                f"{float.fromhex(want) if want else None!r}"
            )
    for part in ("params", "state"):
        a, b = ref[part], run[part]
        for name in sorted(set(a) | set(b)):
            v.tensors += 1
            if name not in a or name not in b:
                v.problems.append(f"{part} {name}: present in only one run")
            elif not _bits_equal(a[name], b[name]):
                diff = (a[name].double() - b[name].double()).abs().max().item()
                v.problems.append(f"{part} {name}: differs (max abs diff {diff:.3g})")
    v.ok = not v.problems
    return v


@dataclass
class _Outcome:
    kill_at: int
    resumed_from: int | None
    ref_losses: dict[int, str]
    losses: dict[int, str]
    events: list[dict[str, Any]]
    verdict: Verdict
    wall_s: float


def run_demo(o: DemoOptions) -> int:
    """The ``demo`` command; returns the exit code (0 only when the verdict is PASS)."""
    import torch

    from muon_ckpt.demo._model import DemoConfig, TinyLM

    opts = dict(o.storage_options)
    url = o.url if "://" in o.url else os.path.abspath(o.url)
    _prepare_dir(url, opts)
    kill_at = _kill_step(o.steps, o.interval, o.seed)
    c = DemoConfig()
    n_params = sum(p.numel() for p in TinyLM(c).parameters())
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= o.nproc
    print(
        f"muon-ckpt demo: TinyLM ({c.layers} layers, dim {c.dim}, {n_params:,} params) on "
        f"{o.nproc} process(es) ({'NCCL, GPUs' if gpus else 'gloo, CPU'}), {o.steps} "
        f"steps, asynchronous checkpoint every {o.interval} to {o.url}, seed {o.seed}, "
        f"offload {'on' if o.offload else 'off'}",
        flush=True,
    )
    cfg = {
        "steps": o.steps,
        "interval": o.interval,
        "seed": o.seed,
        "offload": o.offload,
        "url": url,
        "storage_options": opts,
    }
    t0 = time.perf_counter()
    catalog = Catalog(Storage(url, opts))
    with tempfile.TemporaryDirectory(prefix="muon-ckpt-demo-") as tmp:
        cfg["out"] = tmp
        print("[1/3] reference run, no interruption", flush=True)
        _launch("reference", cfg, o.nproc, tmp)
        print(f"[2/3] run with checkpoints; SIGKILL planned at step {kill_at}", flush=True)
        codes = _launch("train", {**cfg, "kill_at": kill_at}, o.nproc, tmp)
        scan = catalog.scan()
        print(
            f"    all workers died by SIGKILL (exit codes {codes}); committed steps: "
            f"{[s.step for s in scan if s.status == Status.COMMITTED]}"
            + "".join(f"; step {s.step}: {s.status}" for s in scan if s.status != Status.COMMITTED)
        )
        print("[3/3] restart in fresh processes, resume from the newest committed step")
        sys.stdout.flush()
        _launch("resume", cfg, o.nproc, tmp)
        ev = _events(os.path.join(tmp, "events.jsonl"))
        ref = torch.load(os.path.join(tmp, "reference.pt"), weights_only=True)
        run = torch.load(os.path.join(tmp, "resume.pt"), weights_only=True)
    by = {
        ph: {e["step"]: e["loss"] for e in ev if e["kind"] == "loss" and e["phase"] == ph}
        for ph in ("reference", "train", "resume")
    }
    loads = [e["step"] for e in ev if e["kind"] == "load" and e["phase"] == "resume"]
    resumed_from = loads[0] if loads else None
    v = compare_runs(ref, run, by["reference"], {**by["train"], **by["resume"]})
    if max(by["train"], default=0) != kill_at:
        v.problems.append(f"the killed run logged up to step {max(by['train'], default=0)}")
    want = list(range((resumed_from or 0) + 1, o.steps + 1))
    if resumed_from is None or sorted(by["resume"]) != want:
        v.problems.append(f"the restart did not resume from a committed step ({resumed_from})")
    v.ok = not v.problems
    out = _Outcome(
        kill_at, resumed_from, by["reference"], by["resume"], ev, v, time.perf_counter() - t0
    )
    _summary(o, catalog, out)
    return 0 if v.ok else 1


def _rate(nbytes: float, secs: float) -> str:
    return f"{human_bytes(nbytes / secs)}/s" if secs > 0 else "-"


def _summary(opts: DemoOptions, catalog: Catalog, o: _Outcome) -> None:
    steps = [s for s in catalog.scan() if s.committed]
    print("summary")
    print(
        f"  steps       {opts.steps}: killed after step {o.kill_at}, resumed from step "
        f"{o.resumed_from}; {o.wall_s:.1f} s for the three launches"
    )
    last, ref_last = o.losses.get(opts.steps), o.ref_losses.get(opts.steps)
    if last and ref_last:
        print(
            f"  final loss  {float.fromhex(last):.6f} (uninterrupted run: "
            f"{float.fromhex(ref_last):.6f})"
        )
    saves = [e for e in o.events if e["kind"] == "save"]
    if saves:
        blocked = sorted(e["s"] for e in saves)
        print(
            f"  save        {len(saves)} asynchronous saves: save() blocked training "
            f"{blocked[len(blocked) // 2] * 1000:.1f} ms (median); writes ran in the background"
        )
    for e in (e for e in o.events if e["kind"] == "load"):
        print(
            f"  load        step {e['step']}: {human_bytes(e['bytes'])} in "
            f"{e['s'] * 1000:.0f} ms, {_rate(e['bytes'], e['s'])}"
        )
    if steps:
        print(
            f"  checkpoint  {human_bytes(steps[-1].size or 0)} per step; committed steps "
            f"kept: {[s.step for s in steps]} (keep_last=3) at {opts.url}"
        )
    v = o.verdict
    if v.ok:
        print(
            f"  verdict     PASS: the losses of {v.loss_steps} steps and {v.tensors} final "
            "tensors (params + optimizer state) are bitwise equal to the uninterrupted run"
        )
    else:
        print(f"  verdict     FAIL: {len(v.problems)} difference(s)")
        for p in v.problems[:10]:
            print(f"    {p}")
