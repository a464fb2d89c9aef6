"""Asynchronous saves (``async_save=True``): the checkpoint holds exactly the state at the
``save()`` call, whatever training does while the write runs (steps, zero_grad, lr changes,
in-place parameter updates, ``extra`` changes, CPU offload toggled); it loads bitwise like a
synchronous save of the same state; a write that fails on one rank is raised by the next call
on every rank and commits nothing.

Each case holds the background write back (``mgr._saves.gate``) until training has changed
everything, so the write certainly runs after the changes. Saves and loads run in separate
sets of processes (gloo on CPU, NCCL on GPUs when there are enough).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from muon_ckpt import CheckpointError, CheckpointManager
from muon_ckpt.state import FlatState
from muon_ckpt.store import Catalog, Storage
from tests._dist import run_on_ranks
from tests.manager.test_manager_fsdp import build, train

MODES = ("off", "on", "toggle")  # CPU offload during the save: off, on, toggled mid-write


class DataPosition:
    def __init__(self, pos: int) -> None:
        self.pos = pos
        self.seen = torch.arange(4) * pos  # a tensor in extra state, changed in place

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "seen": self.seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = int(sd["pos"])
        self.seen.copy_(sd["seen"])


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def state_of(model, opt, data: DataPosition) -> dict[str, Any]:
    """Every parameter, optimizer state, lr and the extra state, as full CPU tensors/values."""
    was_on = opt.cpu_offload
    if was_on:
        opt.turn_off_cpu_offload()  # the test's own reading of offloaded states
    out: dict[str, Any] = {"data.pos": data.pos, "data.seen": data.seen.clone()}
    for n, p in model.named_parameters():
        out[n] = _full(p)
        for k, v in opt.state.get(p, {}).items():
            out[f"{n}:{k}"] = _full(v)
    for i, g in enumerate(opt.param_groups):
        out[f"group{i}.lr"] = g["lr"]
    if was_on:
        opt.turn_on_cpu_offload()
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert sorted(a) == sorted(b), what
    for k in a:
        if isinstance(a[k], torch.Tensor):
            same = (
                a[k].dtype == b[k].dtype
                and a[k].shape == b[k].shape
                and torch.equal(_bits(a[k]), _bits(b[k]))
            )
        else:
            same = a[k] == b[k]
        assert same, f"{what}: {k} differs"


def save_then_change_everything(url, opts, world, mode, step=2):
    """Train, save ``step`` synchronously to ``url-sync`` and asynchronously to ``url``, then
    change the state in every way a training loop can while the async write is held back."""
    model, opt = build(world)
    if mode != "off":
        opt.turn_on_cpu_offload()
    train(model, range(1, step + 1), opt)
    data = DataPosition(step)
    with CheckpointManager(
        url + "-sync", model=model, optimizer=opt, extra={"data": data}, storage_options=opts
    ) as sync_mgr:
        assert sync_mgr.save(step)
    mgr = CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        extra={"data": data},
        storage_options=opts,
        async_save=True,
        keep_last=1,
    )
    mgr._saves.gate = gate = threading.Event()
    want = state_of(model, opt, data)
    assert opt.cpu_offload == (mode != "off")
    assert mgr.save(step)
    assert opt.cpu_offload == (mode != "off")  # the save left offload as it was
    assert mgr.steps() == []  # a pending step is never listed before its commit
    train(model, range(step + 1, step + 4), opt)  # three optimizer steps
    opt.zero_grad()
    for g in opt.param_groups:
        g["lr"] = g["lr"] * 0.5
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # in-place parameter updates
    data.pos = 99
    data.seen.add_(1000)
    if mode == "toggle":
        opt.turn_off_cpu_offload()
        train(model, range(step + 4, step + 5), opt)
        opt.turn_on_cpu_offload()
        train(model, range(step + 5, step + 6), opt)
    gate.set()
    assert mgr.wait() == step
    assert mgr.wait() is None  # nothing pending any more
    assert mgr.steps() == [step]
    assert mgr.last_save_timings["blocked"] <= mgr.last_save_timings["total"]
    mgr.close()
    return want


def load_fresh(url, opts, world, mode, step=2):
    model, opt = build(world)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    if mode != "off":
        opt.turn_on_cpu_offload()  # a fresh optimizer loaded with offload on
    data = DataPosition(0)
    mgr = CheckpointManager(
        url, model=model, optimizer=opt, extra={"data": data}, storage_options=opts
    )
    assert mgr.load() == step
    assert opt.cpu_offload == (mode != "off")
    got = state_of(model, opt, data)
    mgr.close()
    return got


def body_save(rank, world_size, base, opts, fsdp):
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    mesh_world = world_size if fsdp else None
    return {m: save_then_change_everything(f"{base}/{m}", opts, mesh_world, m) for m in MODES}


def body_load(rank, world_size, base, opts, fsdp):
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    mesh_world = world_size if fsdp else None
    return {
        (m, kind): load_fresh(f"{base}/{m}{suffix}", opts, mesh_world, m)
        for m in MODES
        for kind, suffix in (("async", ""), ("sync", "-sync"))
    }


def _check(saved: list[dict], loaded: list[dict]) -> None:
    for rank, (want, got) in enumerate(zip(saved, loaded, strict=True)):
        for m in MODES:
            assert_bitwise(want[m], got[(m, "async")], f"rank {rank}, offload {m}: async load")
            assert_bitwise(got[(m, "sync")], got[(m, "async")], f"rank {rank}, {m}: sync==async")


@pytest.mark.parametrize(
    "world,fsdp",
    [(2, True), (3, True), (2, False), (3, False)],
    ids=["fsdp2", "fsdp3", "plain2", "plain3"],
)
def test_async_save_holds_the_state_of_the_save_call(tmp_path, world, fsdp):
    base = str(tmp_path / "run")
    saved = run_on_ranks(body_save, world, base, {}, fsdp)
    _check(saved, run_on_ranks(body_load, world, base, {}, fsdp))


@pytest.mark.s3
def test_async_save_on_s3(s3_bucket):
    bucket, opts = s3_bucket
    base = f"s3://{bucket}/run"
    saved = run_on_ranks(body_save, 2, base, opts, True)
    _check(saved, run_on_ranks(body_load, 2, base, opts, True))


def test_async_save_in_one_process_on_memory_fs():
    """No process group: the background write needs no collectives."""
    import uuid

    base = f"memory:///async-{uuid.uuid4().hex[:8]}/run"
    for m in MODES:
        want = save_then_change_everything(f"{base}/{m}", {}, None, m)
        assert_bitwise(want, load_fresh(f"{base}/{m}", {}, None, m), f"offload {m}")
        assert_bitwise(
            load_fresh(f"{base}/{m}-sync", {}, None, m),
            load_fresh(f"{base}/{m}", {}, None, m),
            f"offload {m}: sync == async",
        )


# ---------------------------------------------------------------------------- failures
def body_fail_on_one_rank(rank, world_size, url):
    """Rank 1's writes fail (its file-size limit: EFBIG, a real OS storage failure) during
    background saves; every rank must see the failure from its next call."""
    import resource
    import signal

    model, opt = build(world_size)
    train(model, range(1, 2), opt)
    mgr = CheckpointManager(url, model=model, optimizer=opt, async_save=True, keep_last=2)
    assert mgr.save(1) and mgr.wait() == 1
    want = {n: _full(p) for n, p in model.named_parameters()}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def fail_writes(on: bool) -> None:
        if rank == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 if on else soft, hard))

    outcomes = []
    for step, next_call in ((2, "save"), (3, "load"), (4, "close")):
        train(model, range(step, step + 1), opt)
        fail_writes(True)
        assert mgr.save(step)  # returns: the failure happens in the background
        train(model, range(50, 51), opt)  # training goes on meanwhile
        try:
            if next_call == "save":
                mgr.save(step + 10)
            elif next_call == "load":
                mgr.load()
            else:
                mgr.close()
        except CheckpointError as e:
            outcomes.append(str(e))
        else:
            outcomes.append(None)
        fail_writes(False)
        assert Catalog(Storage(url)).committed_steps() == [1]
    return outcomes, want


def body_load_step_1(rank, world_size, url):
    model, opt = build(world_size)
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        assert mgr.steps() == [1] and mgr.load() == 1
    return {n: _full(p) for n, p in model.named_parameters()}


def test_background_failure_on_one_rank_is_raised_by_the_next_call_everywhere(tmp_path):
    url = str(tmp_path / "run")
    results = run_on_ranks(body_fail_on_one_rank, 2, url)
    for rank, (outcomes, _) in enumerate(results):
        for step, msg in zip((2, 3, 4), outcomes, strict=True):
            assert msg is not None, f"rank {rank}: the failed save of step {step} was lost"
            assert f"asynchronous save of step {step} failed" in msg, msg
            assert "not committed" in msg and "File too large" in msg, msg
    loaded = run_on_ranks(body_load_step_1, 2, url)
    for (_, want), got in zip(results, loaded, strict=True):
        assert_bitwise(want, got, "step 1 after three failed saves")


# ---------------------------------------------------------------------------- agreement
class _FailsOnRank1:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        if self.rank == 1:
            raise RuntimeError("data loader state unavailable on rank 1")
        return {"pos": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def body_snapshot_fails_on_one_rank(rank, world_size, url):
    """A snapshot that fails on one rank fails the save on every rank, with nothing written
    (the others would otherwise wait in the background write for the missing rank)."""
    model, opt = build(world_size)
    mgr = CheckpointManager(url, model=model, optimizer=opt, async_save=True)
    mgr._extra["data"] = _FailsOnRank1(rank)
    with pytest.raises(CheckpointError) as err:  # whatever the extra raised
        mgr.save(1)
    del mgr._extra["data"]
    assert mgr.save(2) and mgr.wait() == 2  # the manager is still usable
    mgr.close()
    return str(err.value)


def test_a_snapshot_failing_on_one_rank_fails_the_save_everywhere(tmp_path):
    msgs = run_on_ranks(body_snapshot_fails_on_one_rank, 2, str(tmp_path / "run"), timeout=90)
    assert "snapshot failed on rank(s) [1]" in msgs[0], msgs[0]
    assert "data loader state unavailable on rank 1" in msgs[1], msgs[1]
    assert Catalog(Storage(str(tmp_path / "run"))).committed_steps() == [2]


def body_budget_over_on_some_ranks(rank, world_size, url, limit):
    """Uneven shards: the staging bytes needed differ per rank; with a bound between them
    every rank must still take the same path (else their collectives never meet)."""
    model, opt = build(world_size)
    train(model, range(1, 2), opt)
    mgr = CheckpointManager(
        url, model=model, optimizer=opt, async_save=True, max_staging_bytes=limit
    )
    assert mgr.save(1)
    pending = mgr.wait()  # 1 if the save ran in the background, None if synchronously
    assert mgr.steps() == [1]
    mgr.close()
    need = mgr._staging.bytes_needed(FlatState.build(model, opt, {}).sd, copy_cpu=True, keep=set())
    return need, pending


def test_a_staging_bound_reached_on_one_rank_makes_every_rank_save_synchronously(tmp_path):
    # TinyTransformer's 10- and 14-row matrices shard 4/4/2 and 5/5/4 rows over 3 ranks.
    got = run_on_ranks(body_budget_over_on_some_ranks, 3, str(tmp_path / "a"), 1 << 40)
    needs = [need for need, _ in got]
    assert len(set(needs)) > 1 and [p for _, p in got] == [1, 1, 1], got
    limit = (max(needs) + min(needs)) // 2  # over on some ranks, under on others
    got = run_on_ranks(body_budget_over_on_some_ranks, 3, str(tmp_path / "b"), limit, timeout=90)
    assert [p for _, p in got] == [None, None, None], got


def test_an_interrupted_wait_keeps_the_save_pending(tmp_path):
    """Ctrl-C while wait() joins the background write: the save stays pending (its buffers
    held), and the next wait() finishes it."""
    import os
    import signal

    model, opt = build(None)
    opt.turn_on_cpu_offload()
    train(model, range(1, 2), opt)
    data = DataPosition(0)
    mgr = CheckpointManager(
        str(tmp_path / "run"), model=model, optimizer=opt, extra={"data": data}, async_save=True
    )
    mgr._saves.gate = gate = threading.Event()
    want = state_of(model, opt, data)
    mgr.save(1)
    # Python raises KeyboardInterrupt only where SIGINT was not ignored when it started (a
    # background job of a non-interactive shell inherits it ignored): install the handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            mgr.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert mgr._saves.pending is not None
    train(model, range(2, 3), opt)  # the pool is still frozen for the pending write
    gate.set()
    assert mgr.wait() == 1
    mgr.close()
    assert_bitwise(want, load_fresh(str(tmp_path / "run"), {}, None, "on", step=1), "step 1")


def test_a_second_async_manager_of_a_frozen_optimizer_fails_as_a_checkpoint_error(tmp_path):
    """Two asynchronous managers over one optimizer with offload on (a local and a remote
    one): while the first one's write holds the offloaded states frozen, the second save fails
    as a CheckpointError saying why (``except CheckpointError`` catches every failed save),
    and works once the first save is done."""
    model, opt = build(None)
    opt.turn_on_cpu_offload()
    train(model, range(1, 2), opt)
    a = CheckpointManager(str(tmp_path / "a"), model=model, optimizer=opt, async_save=True)
    b = CheckpointManager("memory:///two-managers", model=model, optimizer=opt, async_save=True)
    a._saves.gate = gate = threading.Event()
    a.save(1)
    with pytest.raises(CheckpointError, match="another asynchronous save of this optimizer"):
        b.save(1)
    gate.set()
    assert a.wait() == 1
    assert b.save(1) and b.wait() == 1
    a.close()
    b.close()
