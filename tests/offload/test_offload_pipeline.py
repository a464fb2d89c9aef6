"""The offload pipeline (``CPUOffloadPool.pipeline``): a step's states pass through the device
chunk by chunk, at most three chunks' worth held at once (the one in use, the next coming in,
the last going out), and the result is bitwise that of offload off. On the CPU the copies are
synchronous and the bookkeeping is the one CUDA runs, so these count it exactly."""

from __future__ import annotations

import pytest
import torch

from offload import CPUOffloadPool
from optim import Muon


def _held_by_storages(tensors: list[torch.Tensor]) -> int:
    """Bytes the tracked tensors' storages hold, read off the storages themselves."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()  # (allowed on a parked tensor: metadata)
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _pool_of_buckets(sizes: list[int]) -> tuple[CPUOffloadPool, list[list[torch.Tensor]]]:
    pool = CPUOffloadPool(pin_memory=False)
    g = torch.Generator().manual_seed(0)
    buckets = []
    for b, n in enumerate(sizes):
        ts = [torch.randn(n, generator=g), torch.randn(2, n, generator=g).to(torch.bfloat16)]
        for t in ts:
            pool.track(t, b)
        buckets.append(ts)
    pool.offload()
    return pool, buckets


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def test_a_pipeline_holds_the_bucket_in_use_the_next_and_the_last_at_each_boundary():
    sizes = [3, 50, 7, 400, 11, 90, 5]
    pool, buckets = _pool_of_buckets(sizes)
    tensors = [t for ts in buckets for t in ts]
    want = {id(t): pool.host_views()[id(t)].clone() + 1 for t in tensors}
    size = [_nbytes(ts) for ts in buckets]
    pool.reset_max_device_nbytes()  # (the tensors were resident until the first offload)
    pipe = pool.pipeline(range(len(sizes)))
    for i, ts in enumerate(buckets):
        pipe.enter(i)
        # In use: i; coming in: i + 1; going out: i - 1 (still held). Nothing else.
        held = sum(size[j] for j in range(max(0, i - 1), min(len(sizes), i + 2)))
        assert pool.device_nbytes() == held == _held_by_storages(tensors), i
        for t in ts:
            t.add_(1)
        pipe.leave(i)
        assert pool.device_nbytes() == _held_by_storages(tensors)
    pipe.close()
    assert pool.device_nbytes() == 0 == _held_by_storages(tensors)
    assert pool.max_device_nbytes() == max(sum(size[j : j + 3]) for j in range(len(sizes) - 2))
    views = pool.host_views()
    assert all(torch.equal(views[id(t)], want[id(t)]) for t in tensors)


@pytest.mark.parametrize(("ahead", "behind"), [(0, 0), (2, 1), (1, 3)])
def test_the_window_is_ahead_plus_one_plus_behind_buckets(ahead, behind):
    sizes = [10 * (k + 1) for k in range(8)]
    pool, buckets = _pool_of_buckets(sizes)
    size = [_nbytes(ts) for ts in buckets]
    pool.reset_max_device_nbytes()
    pipe = pool.pipeline(range(len(sizes)), ahead=ahead, behind=behind)
    for i in range(len(sizes)):
        pipe.enter(i)
        lo, hi = max(0, i - behind), min(len(sizes), i + ahead + 1)
        assert pool.device_nbytes() == sum(size[lo:hi]), i
        pipe.leave(i)
    pipe.close()
    assert pool.device_nbytes() == 0


def test_a_pipeline_cut_short_leaves_its_buckets_usable_and_the_rest_parked():
    pool, buckets = _pool_of_buckets([4, 5, 6, 7])
    pipe = pool.pipeline([0, 1, 2, 3])
    pipe.enter(0)
    pipe.leave(0)
    pipe.enter(1)  # ... and the step raises here
    pipe.close()
    for t in buckets[1]:
        t.add_(1)  # entered: an ordinary tensor
    pool.offload()
    assert pool.device_nbytes() == 0 == _held_by_storages([t for ts in buckets for t in ts])


def test_a_pipeline_refuses_an_order_that_names_a_bucket_twice():
    pool, _ = _pool_of_buckets([4, 5])
    with pytest.raises(ValueError, match="names each bucket once"):
        pool.pipeline([0, 1, 0])


def _muon(offload: bool, shapes, adamw_sizes, chunk_size=2):
    g = torch.Generator().manual_seed(3)
    mp = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    ap = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in adamw_sizes]
    ap[-1].data = ap[-1].data.to(torch.bfloat16)  # a second (dtype) group in the pool
    opt = Muon(
        [
            {"params": mp, "ns_dtype": "fp32"},
            {"params": ap, "use_muon": False, "lr": 1e-3, "weight_decay": 0.1},
        ],
        chunk_size=chunk_size,
    )
    if offload:
        opt.turn_on_cpu_offload()
    return opt, mp, ap


def _grads(ps, seed):
    g = torch.Generator().manual_seed(seed)
    for i, p in enumerate(ps):
        # (Every fourth param without a grad at odd steps: chunks with inactive params.)
        if seed % 2 and i % 4 == 3:
            p.grad = None
        else:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


SHAPES = [(16, 8), (8, 24), (12, 12), (4, 40), (30, 6), (10, 10), (6, 18)] * 2
ADAMW = [64, 8, 200, 3, 40, 120]


def test_a_muon_step_with_offload_holds_at_most_three_chunks_of_state():
    opt, mp, ap = _muon(True, SHAPES, ADAMW)
    _grads(mp + ap, 0)
    opt.step()  # creates the states (all of them on the device, once)
    pool = opt._cpu_offload_pool
    pool.reset_max_device_nbytes()
    _grads(mp + ap, 2)
    opt.step()
    # The pipeline's order: the Muon chunks, then the AdamW chunks; each chunk's state bytes.
    plan = opt._get_plan()
    size = [sum(it.param.numel() * 4 for it in chunk) for chunk in plan.chunks]
    size += [2 * sum(p.numel() * p.element_size() for p in c) for _, _, c in opt._adamw_chunks()]
    assert len(size) >= 7 and pool.device_nbytes() == 0
    state = sum(size)
    worst = max(sum(size[j : j + 3]) for j in range(len(size) - 2))
    assert 0 < pool.max_device_nbytes() <= worst < state / 2, (pool.max_device_nbytes(), size)


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_offload_on_off_and_toggled_are_bitwise_equal_with_pipelined_chunks(chunk_size):
    runs = {}
    for mode in ("off", "on", "toggled"):
        opt, mp, ap = _muon(mode == "on", SHAPES, ADAMW, chunk_size)
        for step in range(6):
            if mode == "toggled":
                (opt.turn_on_cpu_offload if step % 2 == 0 else opt.turn_off_cpu_offload)()
            _grads(mp + ap, step)
            opt.step()
        opt.turn_off_cpu_offload()
        runs[mode] = [p.detach().clone() for p in mp + ap] + [
            t.clone() for p in mp + ap for t in opt.state[p].values()
        ]
    for mode in ("on", "toggled"):
        assert len(runs[mode]) == len(runs["off"])
        for a, b in zip(runs["off"], runs[mode], strict=True):
            assert torch.equal(a, b), mode
