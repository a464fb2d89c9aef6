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


def adamw_step(params: list[Tensor], group: dict, state: dict) -> None:
    """One AdamW step for ``params`` (all have a grad and an initialised state)."""
    lr = float(group["lr"])
    wd = float(group["weight_decay"])
    b1, b2 = (float(b) for b in group["adamw_betas"])
    eps = float(group["adamw_eps"])
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
        g_l = [local(grad_like_param(p)) for p in ps]  # (a Partial grad: reduced first)
        m_l = [local(state[p]["moment1"]) for p in ps]
        v_l = [local(state[p]["moment2"]) for p in ps]
        bc1 = 1.0 - b1**step
        bc2 = 1.0 - b2**step
        if wd:
            torch._foreach_mul_(p_l, 1.0 - lr * wd)
        torch._foreach_mul_(m_l, b1)
        torch._foreach_add_(m_l, torch._foreach_mul(g_l, 1.0 - b1))
        # The second moment in float32 for half-precision params (as torch.optim.AdamW's
        # addcmul computes): a gradient of 256 squared overflows float16. Each step is still
        # one rounding per element, so a shard gives the bits of the whole tensor.
        g_w = [g.float() if g.dtype in _HALF else g for g in g_l]
        v_w = [v.float() if v.dtype in _HALF else v for v in v_l]
        g2 = torch._foreach_mul(g_w, g_w)
        torch._foreach_mul_(g2, 1.0 - b2)
        torch._foreach_mul_(v_w, b2)
        torch._foreach_add_(v_w, g2)
        for v, w in zip(v_l, v_w, strict=True):
            if w is not v:
                v.copy_(w)
        denom = torch._foreach_sqrt(v_l)
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, eps)
        upd = torch._foreach_div(m_l, denom)
        torch._foreach_mul_(upd, lr / bc1)
        torch._foreach_sub_(p_l, upd)
