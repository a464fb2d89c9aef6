"""AdamW for the ``use_muon=False`` groups: decoupled weight decay, bias-corrected moments.

Works on local shards (elementwise, so no communication). Like the Muon path it uses only
single-rounding ops so a shard gives the same bits as the full tensor.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from optim._plan import grad_like_param, local

_HALF = (torch.float16, torch.bfloat16)


def adamw_chunks(params: list[Tensor], chunk_size: int) -> list[list[Tensor]]:
    """A group's params cut into chunks of ``chunk_size``, in order: the units in which a step
    updates them and CPU offload moves their moments (one bucket each). Elementwise math, so
    the chunks give the bits of one update of them all."""
    return [params[i : i + chunk_size] for i in range(0, len(params), chunk_size)]


def adamw_step(params: list[Tensor], group: dict, state: dict) -> None:
    """One AdamW step for ``params`` (all have a grad and an initialised state)."""
    lr = float(group["lr"])
    wd = float(group["weight_decay"])
    b1, b2 = (float(b) for b in group["adamw_betas"])
    eps = float(group["adamw_eps"])
    # A Partial grad (a replicated param) is reduced first: a collective, so every rank makes
    # it for every param in the same order, its own shard empty or not.
    grads = {p: local(grad_like_param(p)) for p in params}
    # Params can be at different step counts (one skipped a step without a grad).
    by_step: dict[float, list[Tensor]] = {}
    for p in params:
        st = state[p]
        st["step"] += 1
        by_step.setdefault(float(st["step"]), []).append(p)
    for step, ps in by_step.items():
        ps = [p for p in ps if local(p).numel() > 0]
        if not ps:
            continue
        p_l = [local(p) for p in ps]
        g_l = [grads[p] for p in ps]
        m_l = [local(state[p]["moment1"]) for p in ps]
        v_l = [local(state[p]["moment2"]) for p in ps]
        bc1 = 1.0 - b1**step
        bc2 = 1.0 - b2**step
        if wd:
            torch._foreach_mul_(p_l, 1.0 - lr * wd)
        torch._foreach_mul_(m_l, b1)
        torch._foreach_add_(m_l, torch._foreach_mul(g_l, 1.0 - b1))
        full = [k for k, v in enumerate(v_l) if v.dtype not in _HALF]
        if full:
            g2 = torch._foreach_mul([g_l[k] for k in full], [g_l[k] for k in full])
            torch._foreach_mul_(g2, 1.0 - b2)
            v_full = [v_l[k] for k in full]
            torch._foreach_mul_(v_full, b2)
            torch._foreach_add_(v_full, g2)
            del g2
        for g, v in zip(g_l, v_l, strict=True):
            if v.dtype in _HALF:
                _half_second_moment(v, g, b2)
        denom = torch._foreach_sqrt(v_l)
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, eps)
        upd = torch._foreach_div(m_l, denom)
        torch._foreach_mul_(upd, lr / bc1)
        torch._foreach_sub_(p_l, upd)


def _half_second_moment(v: Tensor, g: Tensor, b2: float) -> None:
    """``v = b2 * v + (1 - b2) * g * g`` for a float16/bfloat16 moment, computed in float32
    and stored in ``v``'s dtype (as torch.optim.AdamW's addcmul computes it: the square of a
    float16 gradient of 256 or more would overflow), one tensor at a time so that the float32
    temporaries take at most three times its bytes. One rounding per operation and element,
    so a shard gives the bits of the whole tensor."""
    g32 = g.float()
    g32.mul_(g32).mul_(1.0 - b2)
    v32 = v.float()
    v32.mul_(b2).add_(g32)
    v.copy_(v32)
