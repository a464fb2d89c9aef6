"""The Muon update, pipelined in chunks: momentum on the shards, Newton-Schulz on owner ranks.

Per chunk:
1. every rank updates the momentum of its shards and forms the (Nesterov) update, cast to the
   item's Newton-Schulz dtype (``ns_dtype``: bf16 or fp32);
2. gather: one ``all_to_all_single`` sends each shard to the matrix's owner (async);
3. the owner reassembles the FULL matrix and runs Newton-Schulz once;
4. scatter: one ``all_to_all_single`` returns each rank's slice of the result (async);
5. every rank applies decoupled weight decay and the lr-scaled update to its shard.
With ``warmup_step = w``, the gathers of w chunks are in flight while a chunk computes, and a
chunk's scatter overlaps the next chunk's Newton-Schulz.

Bitwise reproducibility (N ranks == 1 process, same device type): every element of a shard
goes through the same arithmetic as in the full tensor, and Newton-Schulz always runs on the
same full matrix in the same dtype. A chunk whose items mix bf16 and fp32 travels as fp32,
which holds every bf16 value exactly; each item is cast back before Newton-Schulz or its
update, so it computes on the very values of a single process. On the CPU the elementwise work uses only single-rounding ops (mul, add,
sub): a fused lerp/addcmul/alpha= may round differently in a vectorised loop body and its
scalar tail, i.e. depending on where an element sits. On CUDA every element takes the same
kernel code wherever it sits, so the fused ``lerp`` and ``add(alpha=)`` of torch.optim.Muon
are shard-invariant and used there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

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


def _orthogonalise(items: list[Item], fulls: dict[int, Tensor]) -> dict[int, Tensor]:
    """Newton-Schulz on ``fulls`` (item index -> full matrix), one batched call per unit."""
    by_unit: dict[int, list[int]] = {}
    for i in fulls:
        by_unit.setdefault(items[i].unit, []).append(i)
    out: dict[int, Tensor] = {}
    for idx in by_unit.values():
        first = items[idx[0]]
        steps, method = first.group["ns_steps"], first.method
        res = newton_schulz([fulls[i] for i in idx], steps, first.ns_dtype, method)
        out.update(zip(idx, res))
    return out


class _Inflight:
    __slots__ = ("items", "local_updates", "recv", "work")

    def __init__(self, items, local_updates, recv, work):
        self.items = items
        self.local_updates = local_updates
        self.recv = recv
        self.work = work


def _split_by_owner(plan: Plan, items: list[Item]) -> list[list[int]]:
    by_owner: list[list[int]] = [[] for _ in range(plan.world)]
    for i, it in enumerate(items):
        by_owner[it.owner].append(i)
    return by_owner


def _wire_dtype(items: list[Item]) -> torch.dtype:
    """The dtype a chunk's exchanged updates and results travel in: the widest of their
    ns_dtypes (fp32 holds every bf16 value exactly). The same on every rank: every rank has
    the chunk's exchanged items."""
    out = items[0].ns_dtype
    for it in items[1:]:
        out = torch.promote_types(out, it.ns_dtype)
    return out


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _start_gather(plan: Plan, items: list[Item], updates: list[Tensor]) -> _Inflight:
    """Send every exchanged item's shard to its owner (async)."""
    ex = [i for i, it in enumerate(items) if it.exchanged]
    if not ex:
        return _Inflight(items, updates, None, None)
    wire = _wire_dtype([items[i] for i in ex])
    r = plan.rank
    send_parts, in_splits, out_splits = [], [], []
    by_owner = _split_by_owner(plan, [items[i] for i in ex])
    for d in range(plan.world):
        n = 0
        for j in by_owner[d]:
            it = items[ex[j]]
            if it.shard_dim is not None:
                send_parts.append(_as(updates[ex[j]].reshape(-1), wire))
                n += it.piece_numel(r)
        in_splits.append(n)
    for s in range(plan.world):
        out_splits.append(
            sum(
                items[ex[j]].piece_numel(s)
                for j in by_owner[r]
                if items[ex[j]].shard_dim is not None
            )
        )
    dev = updates[ex[0]].device
    send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=wire, device=dev)
    recv = torch.empty(sum(out_splits), dtype=wire, device=dev)
    work = dist.all_to_all_single(recv, send, out_splits, in_splits, group=plan.pg, async_op=True)
    return _Inflight(items, updates, (recv, out_splits), work)


def _orthogonalise_and_scatter(plan: Plan, fl: _Inflight, adjust_lr_fn: str) -> _Inflight | None:
    """Wait for the gather, run Newton-Schulz on owned/local matrices, start the scatter."""
    items, updates = fl.items, fl.local_updates
    r = plan.rank
    # Local (non-exchanged) matrices: whole on this rank, nothing to wait for.
    local = {i: updates[i] for i, it in enumerate(items) if not it.exchanged}
    for i, res in _orthogonalise(items, local).items():
        _apply(items[i], res, adjust_lr_fn)
    if fl.work is None:
        return None
    fl.work.wait()  # Sync: shards of owned matrices must have arrived before reassembly.
    recv, _ = fl.recv
    ex = [i for i, it in enumerate(items) if it.exchanged]
    by_owner = _split_by_owner(plan, [items[i] for i in ex])
    mine = [ex[j] for j in by_owner[r]]
    # recv layout: [from rank 0: owned items' pieces in order][from rank 1: ...]...
    pieces: dict[int, list[Tensor]] = {i: [] for i in mine}
    off = 0
    for s in range(plan.world):
        for i in mine:
            it = items[i]
            if it.shard_dim is None:
                continue
            n = it.piece_numel(s)
            pieces[i].append(recv[off : off + n].view(it.pieces[s]))
            off += n
    # (Pieces come in the wire dtype; Newton-Schulz casts them back to the item's, exactly.)
    fulls = {
        i: updates[i]
        if items[i].shard_dim is None
        else torch.cat(pieces[i], dim=items[i].shard_dim)
        for i in mine
    }
    results = _orthogonalise(items, fulls)
    # Scatter: to each rank d, its slice of every matrix this rank owns.
    send_parts, in_splits, out_splits2 = [], [], []
    for d in range(plan.world):
        n = 0
        for i in mine:
            it = items[i]
            res = results[i]
            if it.shard_dim is not None:
                start = sum(p[it.shard_dim] for p in it.pieces[:d])
                part = res.narrow(it.shard_dim, start, it.pieces[d][it.shard_dim])
            else:
                part = res
            send_parts.append(_as(part.reshape(-1), recv.dtype))
            n += part.numel()
        in_splits.append(n)
    for s in range(plan.world):
        out_splits2.append(sum(items[ex[j]].piece_numel(r) for j in by_owner[s]))
    dev, wire = recv.device, recv.dtype
    send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=wire, device=dev)
    back = torch.empty(sum(out_splits2), dtype=wire, device=dev)
    work = dist.all_to_all_single(back, send, out_splits2, in_splits, group=plan.pg, async_op=True)
    return _Inflight(items, None, (back, by_owner, ex), work)


def _finish_scatter(plan: Plan, fl: _Inflight, adjust_lr_fn: str) -> None:
    fl.work.wait()  # Sync: this rank's slices must have arrived before they are applied.
    back, by_owner, ex = fl.recv
    off = 0
    for s in range(plan.world):
        for j in by_owner[s]:
            it = fl.items[ex[j]]
            n = it.piece_numel(plan.rank)
            _apply(it, _as(back[off : off + n], it.ns_dtype), adjust_lr_fn)
            off += n


def muon_step(
    plan: Plan,
    active: set[int],
    state: dict,
    adjust_lr_fn: str,
    warmup_step: int,
    before_chunk: Callable[[int], None] | None = None,
    after_momentum: Callable[[int], None] | None = None,
) -> None:
    """Run one Muon step over ``plan``; ``active`` holds ids of params that have a gradient.

    ``before_chunk(ci)`` runs before chunk ``ci`` touches its momentum buffers and
    ``after_momentum(ci)`` right after (the offload pool reloads and parks them there).
    """
    if not any(it.exchanged for it in plan.items):
        # Nothing to communicate: holding a chunk's Newton-Schulz back behind the next chunk's
        # momentum would only make it wait for that chunk's states (a reload under offload).
        warmup_step = 0
    gathers: deque[_Inflight] = deque()
    scatters: deque[_Inflight] = deque()

    def drain_one_gather():
        sc = _orthogonalise_and_scatter(plan, gathers.popleft(), adjust_lr_fn)
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
            gathers.append(_start_gather(plan, items, updates))
        while len(gathers) > warmup_step:
            drain_one_gather()
    while gathers:
        drain_one_gather()
    while scatters:
        _finish_scatter(plan, scatters.popleft(), adjust_lr_fn)
