"""Framework integrations: each framework's own save and resume against muon-ckpt's, on the
same run, side by side (not a test).

    python -m benchmarks.bench_integrations [--frameworks lightning] [--dir DIR] [--vocab N]

``FRAMEWORKS`` holds one function per framework; each runs its cases (one child process per
run: a fit that saves, then a restart that resumes) and returns ``Row``s. Measured per case:

- blocked: how much longer the loop stands between the end of a batch and the start of the
  next when it saves (median over the saves) than when it does not (median over the rest);
- resume: how much longer a restarted fit takes from ``fit()`` to its first batch than a
  fresh one (reading and applying the checkpoint);
- fit: the wall time of the whole saving fit (background writes share its cores);
- step size on disk.
"""

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Row:
    framework: str
    path: str
    offload: bool
    blocked_ms: float
    resume_ms: float
    fit_s: float
    step_mib: float


def _dir_mib(path: str) -> float:
    if os.path.isfile(path):
        return os.path.getsize(path) / 2**20
    files = [f for f in glob.glob(os.path.join(path, "**"), recursive=True) if os.path.isfile(f)]
    return sum(os.path.getsize(f) for f in files) / 2**20


def _child(args: list[str]) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_integrations", *args],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- PyTorch Lightning
LIGHTNING_CASES = {
    # name: (path, offload, MuonCheckpoint options)
    "ModelCheckpoint (torch.save)": ("lightning", False, {}),
    "MuonCheckpoint, sync": ("muon", True, {}),
    "MuonCheckpoint, async": ("muon", True, {"async_save": True}),
    "MuonCheckpoint, async, offload off": ("muon", False, {"async_save": True}),
}


def _lightning_fit(a: argparse.Namespace) -> dict[str, Any]:
    """One fit (``a.child``: path, offload, options as JSON) with a clock callback."""
    import pytorch_lightning as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from muon_ckpt.integrations.lightning import MuonCheckpoint
    from optim import Muon

    path, offload, options = json.loads(a.child)

    class Net(pl.LightningModule):
        def __init__(self, offload: bool) -> None:
            super().__init__()
            self.offload = offload
            self.embed = nn.Embedding(a.vocab, a.width)  # AdamW
            self.blocks = nn.Sequential(*[nn.Linear(a.width, a.width) for _ in range(4)])

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            tokens, y = batch
            return nn.functional.mse_loss(self.blocks(self.embed(tokens)).mean(1), y)

        def configure_optimizers(self) -> Any:
            mats = [p for p in self.blocks.parameters() if p.ndim == 2]
            rest = [p for p in self.parameters() if all(p is not m for m in mats)]
            opt = Muon([{"params": mats}, {"params": rest, "use_muon": False, "lr": 1e-3}])
            if self.offload:
                opt.turn_on_cpu_offload()
            return opt

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.fit_t = time.perf_counter()
            self.starts: list[float] = []
            self.ends: list[tuple[int, float]] = []

        def on_train_batch_start(self, *_: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            self.ends.append((trainer.global_step, time.perf_counter()))

    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    n = 8 * (a.steps + 2)
    data = TensorDataset(torch.randint(0, a.vocab, (n, 16), generator=g), torch.randn(n, a.width))

    def trainer(max_steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
        return pl.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            callbacks=callbacks,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=bool(callbacks),
        )

    # A first fit of one step warms this process up (lazy imports, first allocations), so the
    # timed fit's time to its first batch differs between a fresh and a resumed run by the
    # restore only.
    # (Offload off: Lightning's teardown needs it, and only MuonCheckpoint turns it off.)
    trainer(1, []).fit(Net(offload=False), DataLoader(data, batch_size=8))
    clock = Clock()
    if path == "lightning":
        saver: pl.Callback = pl.callbacks.ModelCheckpoint(a.dir, every_n_train_steps=a.every)
        found = sorted(glob.glob(os.path.join(a.dir, "*.ckpt")))
        ckpt_path = found[-1] if found else None
    else:
        saver = MuonCheckpoint(a.dir, every_n_train_steps=a.every, keep_last=1, **options)
        ckpt_path = None
    resume = ckpt_path is not None or (path == "muon" and os.path.isdir(a.dir))
    fit = trainer(a.steps + 2 if resume else a.steps + 1, [clock, saver])
    clock.fit_t = time.perf_counter()
    fit.fit(Net(offload), DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    fit_s = time.perf_counter() - clock.fit_t
    gaps = [(s, clock.starts[i + 1] - t) for i, (s, t) in enumerate(clock.ends[:-1])]
    saved = [g for s, g in gaps if s % a.every == 0]
    plain = [g for s, g in gaps if s % a.every != 0]
    return {
        "to_first_batch": clock.starts[0] - clock.fit_t,
        "blocked": statistics.median(saved) - statistics.median(plain) if saved else 0.0,
        "fit_s": fit_s,
        "saves": len(saved),
    }


def lightning_rows(a: argparse.Namespace) -> list[Row]:
    rows = []
    for name, (path, offload, options) in LIGHTNING_CASES.items():
        where = tempfile.mkdtemp(dir=a.dir)
        os.rmdir(where)  # a fresh run: the url does not exist yet
        child = ["--child", json.dumps([path, offload, options]), "--dir", where]
        child += ["--steps", str(a.steps), "--every", str(a.every)]
        child += ["--vocab", str(a.vocab), "--width", str(a.width)]
        fit = _child(child)
        saved = sorted(glob.glob(os.path.join(where, "step-*")) + glob.glob(f"{where}/*.ckpt"))
        size = _dir_mib(saved[-1]) if saved else 0.0
        again = _child(child)
        rows.append(
            Row(
                "Lightning",
                name,
                offload,
                1e3 * fit["blocked"],
                1e3 * (again["to_first_batch"] - fit["to_first_batch"]),
                fit["fit_s"],
                size,
            )
        )
        shutil.rmtree(where, ignore_errors=True)
    return rows


# One entry per framework: the other integrations add theirs.
FRAMEWORKS: dict[str, Callable[[argparse.Namespace], list[Row]]] = {
    "lightning": lightning_rows,
}
_CHILDREN: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "lightning": _lightning_fit,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    ap.add_argument("--dir", default=None, help="where the runs save (default: a temp dir)")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps of the saving fit")
    ap.add_argument("--every", type=int, default=4, help="save every N steps")
    ap.add_argument("--vocab", type=int, default=32768, help="AdamW embedding rows")
    ap.add_argument("--width", type=int, default=256, help="model width (Muon matrices)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-of", default="lightning", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(_CHILDREN[a.child_of](a)))
        return
    a.dir = a.dir or tempfile.mkdtemp(prefix="bench-integrations-")
    os.makedirs(a.dir, exist_ok=True)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores; steps {a.steps}, save every {a.every}"
    )
    print("| framework | save path | offload | blocked per save | resume | fit | step on disk |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for name in a.frameworks:
        for r in FRAMEWORKS[name](a):
            print(
                f"| {r.framework} | {r.path} | {'on' if r.offload else 'off'} | "
                f"{r.blocked_ms:.1f} ms | {r.resume_ms:.0f} ms | {r.fit_s:.2f} s | "
                f"{r.step_mib:.1f} MiB |"
            )


if __name__ == "__main__":
    main()
