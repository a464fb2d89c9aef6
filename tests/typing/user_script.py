"""A user's training script, type-checked by ``.ci/typecheck`` against the INSTALLED package.

Never run: mypy only reads it. It must pass ``mypy --strict`` with no "missing library stubs or
py.typed marker" error, so every public name used here must be importable and annotated.
"""

from __future__ import annotations

import torch

import muon_ckpt
from muon_ckpt import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    ExportSummary,
    HFExportSummary,
    HFLoadReport,
    ImportReport,
    MemoryOptions,
    export_hf,
    export_safetensors,
    import_optimizer_state,
    load_hf_model,
)
from optim import Muon


def train(model: torch.nn.Module, url: str) -> int:
    opt = Muon([{"params": list(model.parameters()), "lr": 0.02}])
    opt.turn_on_cpu_offload()
    with CheckpointManager(url, model=model, optimizer=opt, keep_last=3, async_save=True) as mgr:
        start: int | None = mgr.load()
        for step in range((start or 0) + 1, 11):
            saved: bool = mgr.save(step)
            if saved:
                print(f"saved {step}")
        committed: list[int] = mgr.steps()
    return committed[-1]


def with_memory_tier(model: torch.nn.Module, opt: Muon, url: str) -> bool | str:
    memory = MemoryOptions(interval=10, dir="/dev/shm/tier", node_size=8, keep=2, flush=False)
    mgr = CheckpointManager(url, model=model, optimizer=opt, async_save="deferred", memory=memory)
    interval: int = mgr.config.memory.interval if mgr.config.memory is not None else 0
    print(interval, mgr.last_load_tier)
    # A misspelt option is an error here too (strict mode flags an unused ignore).
    CheckpointManager(url, keep_lats=3)  # type: ignore[call-arg]
    # The keywords of before 0.3 still type-check until 0.4, as they were typed; a wrong type
    # of one is an error.
    CheckpointManager(url, memory_interval=10, memory_keep=2, snapshot="blocking")
    CheckpointManager(url, memory_keep="2")  # type: ignore[arg-type]
    return mgr.config.async_save


def interop(opt: Muon, url: str) -> None:
    report: ImportReport = import_optimizer_state(opt, "adamw.pt", dry_run=True)
    print(report.fresh, report.unused)
    summary: ExportSummary = export_safetensors(url, "state.safetensors", include=("model",))
    n: int = summary.tensors
    print(n, muon_ckpt.__version__)


def hugging_face(model: torch.nn.Module, url: str) -> None:
    out: HFExportSummary = export_hf(
        url,
        "hf",
        dtype="bf16",
        max_shard_size="2GB",
        rename={r"layers\.(\d+)\.(.*)": r"model.layers.\1.\2"},
        tied={"lm_head.weight": "model.embed_tokens.weight"},
    )
    shards: list[str] = out.files["model"]
    report: HFLoadReport = load_hf_model(model, "hf", strict=False, rename=str.lower)
    missing: list[str] = report.missing
    print(shards, missing)


def newest(url: str) -> int | None:
    try:
        return CheckpointManager(url).latest_step()
    except CheckpointNotFoundError:
        return None
    except CheckpointError as e:
        raise SystemExit(str(e)) from e
