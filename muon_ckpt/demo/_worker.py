"""One rank of the demo: ``python -m muon_ckpt.demo._worker CONFIG.json`` (env:// rendezvous).

Trains the FSDP2-sharded TinyLM with Muon + AdamW. Phase ``reference`` runs all steps without
checkpoints; ``train`` saves asynchronously every ``interval`` steps and, at ``kill_at``, rank 0
SIGKILLs every worker and itself (a crash: nothing is flushed or closed, a background write may
be in flight); ``resume`` loads the newest committed step and finishes. Rank 0 appends one JSON
line per event (each step's loss, each save's blocked time, the load) to ``events.jsonl`` as it
goes and, at the end, writes the full parameters and optimizer state to ``<phase>.pt``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from muon_ckpt._progress import human_bytes
from muon_ckpt.demo._model import DemoConfig, TinyLM, batch, loss_fn, param_groups


class DataPosition:
    """The data position, saved as ``extra.data``: resuming checks it matches the step."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])


def _kill_everyone(pid_file: str) -> None:
    for _ in range(600):  # the launcher writes the pids right after starting the workers
        if os.path.exists(pid_file):
            break
        time.sleep(0.05)
    with open(pid_file) as f:
        pids = [int(x) for x in f.read().split()]
    for pid in pids:
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


_LAST_WORK: list[Any] = []  # the last collective's Work, kept until the process exits


def main(cfg_path: str) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if use_cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from muon_ckpt import CheckpointManager
    from optim import Muon

    phase, steps, seed = cfg["phase"], cfg["steps"], cfg["seed"]
    c = DemoConfig()
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(seed)
    model = TinyLM(c).to(device)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(param_groups(model))
    if cfg["offload"]:
        opt.turn_on_cpu_offload()
    data = DataPosition()
    events = os.path.join(cfg["out"], "events.jsonl")

    def event(**kw: Any) -> None:  # rank 0: one JSON line per event, closed (survives SIGKILL)
        if rank == 0:
            with open(events, "a") as f:
                f.write(json.dumps({"phase": phase, **kw}) + "\n")

    mgr = None
    start = 0
    if phase != "reference":
        mgr = CheckpointManager(
            cfg["url"],
            model=model,
            optimizer=opt,
            extra={"data": data},
            keep_last=3,
            interval=cfg["interval"],
            storage_options=cfg["storage_options"],
            async_save=True,
        )
        dist.barrier()
        t0 = time.perf_counter()
        loaded = mgr.load()
        secs = time.perf_counter() - t0
        if loaded is not None:
            if data.step != loaded:
                raise RuntimeError(f"data position {data.step} != loaded step {loaded}")
            start = loaded
            nbytes = _step_bytes(cfg, loaded) if rank == 0 else 0
            event(kind="load", step=loaded, s=secs, bytes=nbytes)
            if rank == 0:
                size = human_bytes(nbytes)
                print(f"    loaded step {loaded} ({size}) in {secs * 1000:.0f} ms", flush=True)
    every = max(1, steps // 8)
    for step in range(start + 1, steps + 1):
        x = batch(c, seed, step, rank, device)
        loss = loss_fn(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        avg /= world
        data.step = step
        event(kind="loss", step=step, loss=avg.item().hex())
        if rank == 0 and (step % every == 0 or step == steps):
            print(f"    step {step:4d}/{steps}  loss {avg.item():.4f}", flush=True)
        if mgr is not None and (step % cfg["interval"] == 0):
            t0 = time.perf_counter()
            mgr.save(step)  # returns after the snapshot; the write runs while training goes on
            event(kind="save", step=step, s=time.perf_counter() - t0)
        if step == cfg.get("kill_at") and rank == 0:
            # The last save is committed first, so the step the run resumes from is known (a
            # kill during a background write is tests/manager/test_manager_kill.py's subject).
            mgr.wait()
            print(f"    step {step:4d}: SIGKILL to every worker", flush=True)
            _kill_everyone(cfg["pid_file"])
    if cfg["offload"]:
        opt.turn_off_cpu_offload()
    names = {id(p): n for n, p in model.named_parameters()}
    params = {n: _full(p) for n, p in model.named_parameters()}
    state = {f"{names[id(p)]}.{k}": _full(v) for p, st in opt.state.items() for k, v in st.items()}
    if mgr is not None:
        mgr.close()
    if rank == 0:
        torch.save({"params": params, "state": state}, os.path.join(cfg["out"], f"{phase}.pt"))
        event(kind="done")
    # Tear the group down together: a gloo rank destroying its group while a peer is still
    # busy (rank 0 writing the files above) aborted once in CI-like runs ("terminate called
    # without an active exception", SIGABRT). torch + gloo may also abort at exit when the
    # process ends right after a blocking collective while a device mesh lives
    # (pytorch#190489): the last one is asynchronous, and its Work lives until the exit.
    work = dist.barrier(async_op=True)
    work.wait()
    _LAST_WORK.append(work)
    dist.destroy_process_group()


def _step_bytes(cfg: dict[str, Any], step: int) -> int:
    from muon_ckpt.store import Catalog, Storage

    return Catalog(Storage(cfg["url"], cfg["storage_options"])).manifest(step).total_bytes


if __name__ == "__main__":
    main(sys.argv[1])
