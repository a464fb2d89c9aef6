"""GPU: a Muon step with CPU offload on holds at most three pipeline chunks of state in GPU memory
(``torch.cuda.max_memory_allocated``, the allocator's own count), and gives the bits of the
step with offload off, AdamW chunks included.

    python3 -m pytest tests/gpu/test_offload_gpu.py     (needs a CUDA device)

On the CPU the same bookkeeping is counted by tests/offload/test_offload_pipeline.py; on CUDA
the host runs ahead of the GPU, so only the allocator shows that blocks are reused rather than
allocated anew while earlier copies are still in flight.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MiB = 1 << 20


def _make(offload: bool):
    from optim import Muon, set_ns_compile

    set_ns_compile(False)
    g = torch.Generator().manual_seed(0)
    mats = [torch.nn.Parameter(torch.randn(1024, 1024, generator=g).cuda()) for _ in range(24)]
    vecs = [torch.nn.Parameter(torch.randn(1 << 20, generator=g).cuda()) for _ in range(6)]
    opt = Muon(
        [{"params": mats}, {"params": vecs, "use_muon": False, "lr": 1e-3}],
        chunk_size=4,
    )
    grads = [[torch.randn(p.shape, generator=g).cuda() for p in mats + vecs] for _ in range(3)]
    if offload:
        opt.turn_on_cpu_offload()
    return opt, mats + vecs, grads


def _step(opt, params, grads) -> int:
    """One step; the peak GPU memory allocated during it (params, grads and states included:
    between steps the states are on the GPU with offload off, in CPU memory with it on)."""
    for p, gr in zip(params, grads, strict=True):
        p.grad = gr
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _bounds(opt) -> tuple[int, int]:
    """The offloaded state's bytes, and the most any three consecutive pipeline chunks hold
    (its own function: the plan and pool it reads hold the params and states, and a local
    left holding them kept them allocated past the run)."""
    pool = opt._cpu_offload_pool
    chunk = [sum(it.param.numel() * 4 for it in c) for c in opt._get_plan().chunks]
    chunk += [8 * sum(p.numel() for p in c) for _, _, c in opt._adamw_chunks()]
    three = max(sum(chunk[j : j + 3]) for j in range(len(chunk) - 2))
    return sum(pool._storage_nbytes.values()), three


def test_a_step_with_offload_on_holds_at_most_three_chunks_of_state_on_the_gpu():
    # What earlier tests of this process left allocated is not this test's to count; and a
    # process's first optimizer imports parts of torch whose traceback holds it in a cycle.
    _make(False)
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    peaks, finals = {}, {}
    for offload in (False, True):
        opt, params, grads = _make(offload)
        _step(opt, params, grads[0])  # creates the states (all on the GPU, once)
        opt._cpu_offload_pool.reset_max_device_nbytes()
        peaks[offload] = max(_step(opt, params, g) for g in grads[1:])
        if offload:
            state, three = _bounds(opt)
            assert opt._cpu_offload_pool.max_device_nbytes() <= three
            opt.turn_off_cpu_offload()
        finals[offload] = [p.detach().cpu() for p in params] + [
            t.cpu() for p in params for t in opt.state[p].values() if t.is_cuda
        ]
        del opt, params, grads
        torch.cuda.empty_cache()
        # (the next run starts from nothing: freed when dropped, no collection needed)
        assert torch.cuda.memory_allocated() - base < MiB
    for a, b in zip(finals[False], finals[True], strict=True):
        assert torch.equal(a, b)
    # Off: the whole state is there throughout; on: three chunks at most (2 MiB of rounding).
    saved = peaks[False] - peaks[True]
    assert saved >= state - three - 2 * MiB, (peaks, state / MiB, three / MiB)
