"""Newton-Schulz orthogonalisation, the heart of Muon.

``zeropower_via_newtonschulz(G)`` returns an approximation of ``U V^T`` for ``G = U S V^T``
with the quintic iteration of torch.optim.Muon (coefficients 3.4445, -4.7750, 2.0315), run in
bfloat16. ``set_ns_compile(True)`` routes calls through ``torch.compile`` (off by default: on an
H200 it gained nothing on 16 x 4096^2 and lost on many small shapes, where each compiled call's
guards cost more than the kernels it fuses; compiled and eager agree within bf16 rounding).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "get_ns_compile",
    "newton_schulz",
    "set_ns_compile",
    "zeropower_via_newtonschulz",
]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_EPS = 1e-7

_use_compile = False
_compiled = None


def set_ns_compile(enabled: bool) -> None:
    """Turn ``torch.compile`` of the Newton-Schulz iteration on or off (process-wide)."""
    global _use_compile
    if not isinstance(enabled, bool):
        raise TypeError(f"set_ns_compile expects a bool, got {type(enabled).__name__}")
    _use_compile = enabled


def get_ns_compile() -> bool:
    return _use_compile


def _iterate(x: Tensor, ns_steps: int, coefficients: tuple[float, float, float], eps: float):
    """The quintic iteration on a bf16 matrix (rows <= cols) or a batch of them."""
    a, b, c = coefficients
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm
    norm = x.norm() if x.ndim == 2 else x.norm(dim=(-2, -1), keepdim=True)
    x = x / norm.clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.mT
        gram_update = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, gram_update, x, beta=a)
    return x


def zeropower_via_newtonschulz(
    grad: Tensor,
    ns_steps: int = 5,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = _EPS,
) -> Tensor:
    """Newton-Schulz on a 2-D matrix, or on a batch ``(B, rows, cols)`` of same-shape
    matrices; returns bfloat16 of the input's shape (torch.optim.Muon's iteration)."""
    x = grad.bfloat16()
    if grad.size(-2) > grad.size(-1):
        return _iterate(x.mT, ns_steps, coefficients, eps).mT
    return _iterate(x, ns_steps, coefficients, eps)


def newton_schulz(grads: list[Tensor], ns_steps: int = 5) -> list[Tensor]:
    """Orthogonalise same-shape tensors (>= 2-D, each viewed as ``(shape[0], -1)``), eager or
    compiled; returns bfloat16 tensors of the input shapes. One tensor runs the 2-D iteration
    (no stacking copy); several run one batched iteration."""
    global _compiled
    shape = grads[0].shape
    fn = zeropower_via_newtonschulz
    if _use_compile:
        if _compiled is None:
            _compiled = torch.compile(zeropower_via_newtonschulz, dynamic=False)
        fn = _compiled
    rows, cols = shape[0], math.prod(shape[1:])  # (not -1: a matrix may have no rows)
    if rows * cols == 0:  # nothing to orthogonalise (torch.optim.Muon steps these too)
        return [torch.zeros(shape, dtype=torch.bfloat16, device=g.device) for g in grads]
    if len(grads) == 1:
        return [fn(grads[0].reshape(rows, cols), ns_steps).reshape(shape)]
    batch = torch.stack([g.reshape(rows, cols) for g in grads])
    return [o.reshape(shape) for o in fn(batch, ns_steps).unbind(0)]
