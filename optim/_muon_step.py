"""The Muon update, pipelined in chunks: momentum on the shards, Newton-Schulz on owner ranks.

Per chunk:
1. every rank updates the momentum of its shards and forms the (Nesterov) update, cast to the
   item's Newton-Schulz dtype (``ns_dtype``: bf16 or fp32);
2. gather: one ``all_to_all_single`` sends the pieces of each matrix to its owner (async;
   ``_exchange.py``: the owner's own replica sends, so each matrix travels once);
3. the owner reassembles the FULL matrix and runs Newton-Schulz once, for the whole mesh;
4. scatter: one ``all_to_all_single`` returns every rank's piece of the result, replicas
   included (async);
5. every rank applies decoupled weight decay and the lr-scaled update to its shard.
With ``warmup_step = w``, the gathers of w chunks are in flight while a chunk computes, and a
chunk's scatter overlaps the next chunk's Newton-Schulz.

Bitwise reproducibility (N ranks == 1 process, same device type): every element of a shard
goes through the same arithmetic as in the full tensor, and Newton-Schulz always runs on the
same full matrix in the same dtype. A chunk whose items mix bf16 and fp32 travels as fp32,
which holds every bf16 value exactly; each item is cast back before Newton-Schulz or its
update, so it computes on the very values of a single process. On the CPU the elementwise
work uses only single-rounding ops (mul, add, sub): a fused lerp/addcmul/alpha= may round differently in a vectorised loop body and its
scalar tail, i.e. depending on where an element sits. On CUDA every element takes the same
kernel code wherever it sits, so the fused ``lerp`` and ``add(alpha=)`` of torch.optim.Muon
are shard-invariant and used there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor

from optim._exchange import Inflight, assemble, received, start_gather, start_scatter
from optim._plan import Item, Plan, grad_like_param, local
from optim.newton_schulz import newton_schulz


def adjusted_lr(lr: float, rows: int, cols: int, adjust_lr_fn: str) -> float:
    if adjust_lr_fn == "original":
        return lr * max(1.0, rows / cols) ** 0.5
    return lr * 0.2 * max(rows, cols) ** 0.5


def _momentum_updates(items: list[Item], state: dict) -> list[Tensor]:
    """Update momentum buffers in place; return each item's local update (in its ns_dtype),
    in order."""
    out: list[Tensor | None] = [None] * len(items)
    by_hp: dict[tuple, list[int]] = {}
    for i, it in enumerate(items):
        by_hp.setdefault((it.group["momentum"], it.group["nesterov"], it.ns_dtype), []).append(i)
    for (m, nesterov, ns_dtype), idx in by_hp.items():
        bufs = [local(state[items[i].param]["momentum_buffer"]) for i in idx]
        grads = [local(grad_like_param(items[i].param)) for i in idx]
        if bufs[0].device.type == "cuda":
            # CUDA: every element goes through the same kernel code wherever it sits in a
            # tensor, so the fused lerp is shard-invariant; it is also torch.optim.Muon's math.
            small = [k for k, i in enumerate(idx) if items[i].gnumel() < _FOREACH_MAX_NUMEL]
            for k, i in enumerate(idx):
                if items[i].gnumel() >= _FOREACH_MAX_NUMEL:
                    out[i] = _large_update(bufs[k], grads[k], m, nesterov, ns_dtype)
            if not small:
                continue
            idx = [idx[k] for k in small]
            bufs = [bufs[k] for k in small]
            grads = [grads[k] for k in small]
            torch._foreach_lerp_(bufs, grads, 1.0 - m)
            upd = torch._foreach_lerp(grads, bufs, m) if nesterov else bufs
        else:
            # CPU: vectorised body and scalar tail may round a fused op differently, so only
            # single-rounding ops here.
            scaled = torch._foreach_mul(grads, 1.0 - m)  # (1 - m) * g
            torch._foreach_mul_(bufs, m)
            torch._foreach_add_(bufs, scaled)  # buf = m * buf + (1 - m) * g
            if nesterov:
                upd = torch._foreach_mul(bufs, m)
                torch._foreach_add_(upd, scaled)  # (1 - m) * g + m * buf
            else:
                upd = bufs
        for i, u in zip(idx, upd):
            # copy=True: without Nesterov a buffer of ns_dtype would otherwise come back as
            # itself, and the offload pool frees buffers before Newton-Schulz reads the update.
            out[i] = u.to(ns_dtype, copy=True)
    return out  # type: ignore[return-value]


# Matrices with at least this many elements (globally, so that a matrix takes the same kernels
# on every world size) get their momentum one by one on CUDA, each matrix's ops back to back
# while its bytes are still in L2; smaller ones go through one foreach launch per chunk.
_FOREACH_MAX_NUMEL = 1 << 20


def _large_update(
    buf: Tensor, grad: Tensor, m: float, nesterov: bool, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Momentum of one large matrix (CUDA); the update (``dtype``) is written directly by the
    lerp, with no fp32 temporary (same bits as lerp-then-cast: the kernel computes in fp32)."""
    buf.lerp_(grad, 1.0 - m)
    upd = torch.empty_like(buf, dtype=dtype)
    if nesterov:
        torch.lerp(grad, buf, m, out=upd)
    else:
        upd.copy_(buf)
    return upd


def _apply(it: Item, update_local: Tensor, adjust_lr_fn: str) -> None:
    g = it.group
    p = local(it.param)
    if update_local.numel() == 0:
        return
    lr = float(g["lr"])
    if g["weight_decay"]:
        p.mul_(1.0 - lr * g["weight_decay"])
    rows, cols = it.matrix_dims()
    alr = adjusted_lr(lr, rows, cols, adjust_lr_fn)
    upd = update_local.reshape(p.shape)
    if p.device.type == "cuda":
        p.add_(upd, alpha=-alr)  # shard-invariant on CUDA (see _momentum_updates)
    else:
        p.sub_(upd.to(p.dtype).mul_(alr))


def _orthogonalise(
    items: list[Item], fulls: dict[int, Tensor], done: list[Item]
) -> dict[int, Tensor]:
    """Newton-Schulz on ``fulls`` (item index -> full matrix), one batched call per unit;
    the items orthogonalised are appended to ``done``."""
    by_unit: dict[int, list[int]] = {}
    for i in fulls:
        by_unit.setdefault(items[i].unit, []).append(i)
    out: dict[int, Tensor] = {}
    for idx in by_unit.values():
        first = items[idx[0]]
        steps, method = first.group["ns_steps"], first.method
        res = newton_schulz([fulls[i] for i in idx], steps, first.ns_dtype, method)
        out.update(zip(idx, res))
        done.extend(items[i] for i in idx)
    return out


def _orthogonalise_and_scatter(
    plan: Plan, fl: Inflight, adjust_lr_fn: str, done: list[Item]
) -> Inflight | None:
    """Run Newton-Schulz on the chunk's local matrices, wait for the gather, run it on the
    matrices this rank owns and start sending their results back."""
    items, updates = fl.items, fl.updates
    # Local (non-exchanged) matrices: whole on this rank, nothing to wait for.
    whole = {i: updates[i] for i, it in enumerate(items) if not it.exchanged}
    for i, res in _orthogonalise(items, whole, done).items():
        _apply(items[i], res, adjust_lr_fn)
    if fl.work is None:
        return None
    results = _orthogonalise(items, assemble(plan, fl), done)
    return start_scatter(plan, items, results)


def _finish_scatter(plan: Plan, fl: Inflight, adjust_lr_fn: str) -> None:
    for it, upd in received(plan, fl):
        _apply(it, upd, adjust_lr_fn)


def muon_step(
    plan: Plan,
    active: set[int],
    state: dict,
    adjust_lr_fn: str,
    warmup_step: int,
    before_chunk: Callable[[int], None] | None = None,
    after_momentum: Callable[[int], None] | None = None,
) -> list[Item]:
    """Run one Muon step over ``plan``; ``active`` holds ids of params that have a gradient.
    Returns the items this rank orthogonalised.

    ``before_chunk(ci)`` runs before chunk ``ci`` touches its momentum buffers and
    ``after_momentum(ci)`` right after (the offload pool reloads and parks them there).
    """
    if not any(it.exchanged for it in plan.items):
        # Nothing to communicate: holding a chunk's Newton-Schulz back behind the next chunk's
        # momentum would only make it wait for that chunk's states (a reload under offload).
        warmup_step = 0
    gathers: deque[Inflight] = deque()
    scatters: deque[Inflight] = deque()
    done: list[Item] = []

    def drain_one_gather():
        sc = _orthogonalise_and_scatter(plan, gathers.popleft(), adjust_lr_fn, done)
        if sc is not None:
            scatters.append(sc)
        # Apply the previous chunk's scatter only now, so it overlapped this Newton-Schulz.
        while len(scatters) > 1:
            _finish_scatter(plan, scatters.popleft(), adjust_lr_fn)

    for ci, chunk in enumerate(plan.chunks):
        items = [it for it in chunk if id(it.param) in active]
        if before_chunk is not None:
            before_chunk(ci)
        if items:
            updates = _momentum_updates(items, state)
        if after_momentum is not None:
            after_momentum(ci)
        if items:
            gathers.append(start_gather(plan, items, updates))
        while len(gathers) > warmup_step:
            drain_one_gather()
    while gathers:
        drain_one_gather()
    while scatters:
        _finish_scatter(plan, scatters.popleft(), adjust_lr_fn)
    return done
