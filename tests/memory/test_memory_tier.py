"""The memory tier: a run recovers from its last step, not its last interval.

4 ranks as 2 nodes on one machine (``node_size=2``, each node's ranks with a tier ``dir``
of their own), the tier's ``interval=1``, the url's ``interval=5``, asynchronous saves, FSDP2, Muon with
offload on and off: after step 7's ``save()`` and ``wait()``, every process is SIGKILLed and
node 1's memory directory deleted; a restart on 4 ranks loads step 7 (ranks 0-1 from their own
memory, ranks 2-3 from the replicas on node 0), bitwise the state of the run at step 7,
reading no step data from storage. With both nodes' memory gone, step 5 from storage; on 3
ranks, the url's step, without error. A flipped byte in a memory-tier file: that rank's part
comes from its replica; flipped in both copies: the url's step. Never a wrong value. Saves
that outrun the tier (each due while the one before still runs) keep the newest step.
"""

from __future__ import annotations

import glob
import os
import shutil
import threading

import pytest
import torch

from muon_ckpt import CheckpointManager, MemoryOptions
from tests._ckpt import flip_byte, offload_off
from tests._dist import run_on_ranks, run_then_kill
from tests.manager.test_manager_fsdp import build, snapshot, train

NODE = 2  # ranks per node


def _mem(root: str, rank: int, node_size: int = NODE) -> str:
    return os.path.join(root, f"node{rank // node_size}")


def _manager(url, model, opt, root, rank, node_size=NODE, flush=True):
    mem = _mem(root, rank, node_size)
    return CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        interval=5,
        memory=MemoryOptions(interval=1, dir=mem, node_size=node_size, flush=flush),
        async_save=True,
    )


def body_train(rank, world_size, url, root, offload, node_size=NODE):
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    model, opt = build(world_size)
    if offload:
        opt.turn_on_cpu_offload()
    mgr = _manager(url, model, opt, root, rank, node_size)
    assert mgr.load() is None
    states = {}
    for s in range(1, 8):
        train(model, range(s, s + 1), opt)
        assert mgr.save(s)
        assert mgr.wait() == s  # complete in every tier (a faster loop skips: tested apart)
        if s in (5, 7):  # (the steps the tests load; a snapshot gathers every DTensor)
            states[s] = _state(model, opt)
    assert mgr.durable_step == 5
    return states


def body_train_past_a_slow_tier(rank, world_size, url, root):
    """Steps 1-7 to the tier only (step 0 to the url too), step 1's memory job held until
    step 7's save() returned: every later step comes while a memory save runs."""
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    model, opt = build(world_size)
    mgr = CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        interval=100,
        memory=MemoryOptions(interval=1, dir=_mem(root, rank), node_size=NODE),
        async_save=True,
    )
    assert mgr.load() is None
    assert mgr.save(0) and mgr.wait() == 0  # (memory steps load on a line the url holds)
    gate = mgr._saves.gate = threading.Event()
    try:
        for s in range(1, 8):
            train(model, range(s, s + 1), opt)
            assert mgr.save(s)
        want = _state(model, opt)
        train(model, range(8, 9), opt)  # the queued step's bytes are step 7's
    finally:
        gate.set()
    assert mgr.wait() == 7
    return want


def body_restore(rank, world_size, url, root, offload, node_size=NODE):
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    model, opt = build(world_size)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # everything must come from the checkpoint
    if offload:
        opt.turn_on_cpu_offload()
    mgr = _manager(url, model, opt, root, rank, node_size)
    step = mgr.load()
    out = (step, mgr.last_load_tier, mgr.last_load_bytes_read, _state(model, opt))
    mgr.close()
    return out


def _state(model, opt):
    return offload_off(opt, lambda: snapshot(model, opt))


@pytest.fixture(scope="module")
def trained():
    """body_train's run (offload off) on ``world_size`` ranks of ``node_size`` per node, trained
    once per module and handed to each test as a fresh copy at the same paths (the tier knows
    its run by its url): the tests differ in what they damage and restore, not in the run."""
    import tempfile

    runs: dict[tuple[int, int], tuple[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="trained-") as base:

        def get(world_size: int, node_size: int) -> tuple[str, str, dict]:
            work = os.path.join(base, f"{world_size}x{node_size}")
            url, root = os.path.join(work, "run"), os.path.join(work, "mem")
            if (world_size, node_size) not in runs:
                want = run_then_kill(body_train, world_size, url, root, False, node_size)[0]
                runs[world_size, node_size] = (work + ".trained", want)
                shutil.copytree(work, work + ".trained", symlinks=True)
            template, want = runs[world_size, node_size]
            shutil.rmtree(work)
            shutil.copytree(template, work, symlinks=True)
            return url, root, want

        yield get


def _assert_state(want, got, what):
    assert sorted(want) == sorted(got), what
    bad = [k for k in want if not torch.equal(want[k].view(-1), got[k].view(-1))]
    assert not bad, f"{what}: differ from the uninterrupted run: {bad}"


@pytest.mark.parametrize("offload", [False, True], ids=["offload-off", "offload-on"])
def test_restart_loads_the_last_step_from_memory_and_peers(tmp_path, trained, offload):
    if offload:
        url, root = str(tmp_path / "run"), str(tmp_path / "mem")
        want = run_then_kill(body_train, 4, url, root, offload)[0]  # every rank: the full state
    else:
        url, root, want = trained(4, NODE)
    shutil.rmtree(os.path.join(root, "node1"))  # node 1 lost its memory

    got = run_on_ranks(body_restore, 4, url, root, offload)
    assert [g[0] for g in got] == [7] * 4
    assert [g[1] for g in got] == ["memory", "memory", "peer", "peer"]
    assert [g[2] for g in got] == [0] * 4  # no step data from storage
    for r, g in enumerate(got):
        _assert_state(want[7], g[3], f"rank {r}, step 7 from memory")

    shutil.rmtree(os.path.join(root, "node0"))
    shutil.rmtree(os.path.join(root, "node1"))
    got = run_on_ranks(body_restore, 4, url, root, offload)
    assert [g[0] for g in got] == [5] * 4
    assert [g[1] for g in got] == ["storage"] * 4
    for r, g in enumerate(got):
        _assert_state(want[5], g[3], f"rank {r}, step 5 from storage")


def test_restart_on_another_world_size_loads_from_storage(trained):
    url, root, want = trained(4, NODE)
    got = run_on_ranks(body_restore, 3, url, root, False)
    assert [g[0] for g in got] == [5] * 3
    assert [g[1] for g in got] == ["storage"] * 3
    for r, g in enumerate(got):
        _assert_state(want[5], g[3], f"rank {r} of 3, step 5")


def _part_files(root: str, node: int, kind: str, rank: int) -> list[str]:
    return sorted(
        glob.glob(
            os.path.join(
                root, f"node{node}", "run-*", "step-00000007", f"{kind}-{rank:05d}", "*.distcp"
            )
        )
    )


def test_a_damaged_part_comes_from_its_replica_then_from_storage(trained):
    # 2 ranks, one per node: rank 0's replica is on rank 1 and the other way round.
    url, root, want = trained(2, 1)
    own = _part_files(root, 0, "rank", 0)
    held = _part_files(root, 1, "copy", 0)
    assert own and held
    flip_byte(own[0], os.path.getsize(own[0]) // 2)
    got = run_on_ranks(body_restore, 2, url, root, False, 1)
    assert [g[0] for g in got] == [7, 7]
    assert [g[1] for g in got] == ["peer", "memory"]
    for r, g in enumerate(got):
        _assert_state(want[7], g[3], f"rank {r}, step 7")

    # The fetch put a good copy back in rank 0's memory; now damage it and the replica.
    own = _part_files(root, 0, "rank", 0)
    flip_byte(own[0], os.path.getsize(own[0]) // 2)
    flip_byte(held[0], os.path.getsize(held[0]) // 2)
    got = run_on_ranks(body_restore, 2, url, root, False, 1)
    assert [g[0] for g in got] == [5, 5]
    assert [g[1] for g in got] == ["storage", "storage"]
    for r, g in enumerate(got):
        _assert_state(want[5], g[3], f"rank {r}, step 5")


def body_save_again(rank, world_size, url, root):
    """Step 7 loaded, trained on, and kept in memory again as step 7 (another save)."""
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    model, opt = build(world_size)
    mgr = _manager(url, model, opt, root, rank, 1, flush=False)
    assert mgr.load() == 7
    train(model, range(100, 101), opt)
    assert mgr.save(7) and mgr.wait() == 7
    mgr.close()


def _step_dir(root: str, node: int) -> str:
    (path,) = glob.glob(os.path.join(root, f"node{node}", "run-*", "step-00000007"))
    return path


def test_parts_of_two_saves_of_a_step_never_load_together(tmp_path, trained):
    url, root, want = trained(2, 1)
    node1, first = _step_dir(root, 1), str(tmp_path / "first-save")
    shutil.copytree(node1, first)
    run_on_ranks(body_save_again, 2, url, root)
    # Node 1 still holds the first save's parts (its second save was lost), node 0 the
    # second save's, whose replica of rank 1 is gone: only the first save is whole.
    shutil.rmtree(node1)
    shutil.copytree(first, node1)
    shutil.rmtree(os.path.join(_step_dir(root, 0), "copy-00001"))
    got = run_on_ranks(body_restore, 2, url, root, False, 1)
    assert [g[0] for g in got] == [7, 7]
    assert [g[1] for g in got] == ["peer", "memory"]
    for r, g in enumerate(got):
        _assert_state(want[7], g[3], f"rank {r}, the first save of step 7")


def test_nodes_numbered_otherwise_load_the_replicas_they_hold(trained):
    url, root, want = trained(2, 1)
    # The restart gives node 0's ranks to the other machine: each rank finds the replica of
    # its own part, and no part of its own.
    os.rename(os.path.join(root, "node0"), os.path.join(root, "swap"))
    os.rename(os.path.join(root, "node1"), os.path.join(root, "node0"))
    os.rename(os.path.join(root, "swap"), os.path.join(root, "node1"))
    got = run_on_ranks(body_restore, 2, url, root, False, 1)
    assert [g[0] for g in got] == [7, 7]
    assert [g[1] for g in got] == ["memory", "memory"]
    assert [g[2] for g in got] == [0, 0]
    for r, g in enumerate(got):
        _assert_state(want[7], g[3], f"rank {r}, step 7 from the replica it holds")


def test_the_newest_step_is_kept_when_saves_outrun_the_tier(tmp_path):
    """interval=1 on 4 ranks as 2 nodes, each memory save arriving while the one before still
    runs: after wait(), the tier holds step 7 (not an older one), which a restart loads
    bitwise, ranks 2-3 from the replicas on node 0."""
    url, root = str(tmp_path / "run"), str(tmp_path / "mem")
    want = run_then_kill(body_train_past_a_slow_tier, 4, url, root)[0]
    shutil.rmtree(os.path.join(root, "node1"))
    got = run_on_ranks(body_restore, 4, url, root, False)
    assert [g[0] for g in got] == [7] * 4
    assert [g[1] for g in got] == ["memory", "memory", "peer", "peer"]
    for r, g in enumerate(got):
        _assert_state(want, g[3], f"rank {r}, step 7 from memory")
