"""Newton-Schulz orthogonalisation, the heart of Muon.

``zeropower_via_newtonschulz(G)`` returns an approximation of ``U V^T`` for ``G = U S V^T``
with the quintic iteration of torch.optim.Muon (coefficients 3.4445, -4.7750, 2.0315), run in
bfloat16 (torch's choice) or float32 (``dtype=``; Muon's ``ns_dtype``). In float32, a matrix at
least twice as wide as tall iterates on its small Gram matrix instead (same polynomial, fewer
flops; see ``_iterate_gram``). ``set_ns_compile(True)`` routes calls through ``torch.compile`` (off by default: on an
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
    """The quintic iteration on a matrix (rows <= cols) or a batch of them, in x's dtype."""
    a, b, c = coefficients
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm
    norm = x.norm() if x.ndim == 2 else x.norm(dim=(-2, -1), keepdim=True)
    x = x / norm.clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.mT
        gram_update = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, gram_update, x, beta=a)
    return x


# Aspect ratio (long side / short side) from which float32 takes the Gram iteration: for an
# aspect ratio r it costs 4r + 14 products of short-side cubes against 10r + 5 (1.14x fewer
# flops at r = 2, 1.5x at r = 4; measured on a CPU: 1.13x and 1.5x faster).
GRAM_MIN_ASPECT = 2


def _iterate_gram(
    x: Tensor, ns_steps: int, coefficients: tuple[float, float, float], eps: float
) -> Tensor:
    """The same quintic iteration as ``_iterate`` (rows <= cols), carried out on the rows x rows
    Gram matrix R = X X^T: each step X <- Z X with Z = aI + bR + cR^2, so the steps collect
    into Q = Z_k ... Z_0 and R <- Z R Z, and X is multiplied once at the end.

    Half-way the product is folded into X and R formed afresh from it (a restart): R and QX
    otherwise drift apart by rounding, which the iteration amplifies. In float32 this keeps
    the result as close to a float64 iteration as ``_iterate``'s (rel. error ~5e-6 on
    gradient-like spectra); in bfloat16 it is 2-3x less accurate than ``_iterate``, so bf16
    never takes this path."""
    a, b, c = coefficients
    mm = torch.mm if x.ndim == 2 else torch.bmm
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm
    norm = x.norm() if x.ndim == 2 else x.norm(dim=(-2, -1), keepdim=True)
    x = x / norm.clamp(min=eps)
    restart = (ns_steps + 1) // 2
    r = mm(x, x.mT)
    q: Tensor | None = None
    for k in range(ns_steps):
        if k == restart and q is not None:
            x, q = mm(q, x), None
            r = mm(x, x.mT)
        z = addmm(r, r, r, beta=b, alpha=c)
        z.diagonal(dim1=-2, dim2=-1).add_(a)
        q = z if q is None else mm(z, q)
        if k + 1 < ns_steps and k + 1 != restart:  # (the next R is needed)
            r = mm(z, mm(r, z))
    return x if q is None else mm(q, x)


def zeropower_via_newtonschulz(
    grad: Tensor,
    ns_steps: int = 5,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = _EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Newton-Schulz on a 2-D matrix, or on a batch ``(B, rows, cols)`` of same-shape
    matrices, computed in ``dtype`` (bfloat16: torch.optim.Muon's iteration); returns
    ``dtype`` of the input's shape."""
    x = grad.to(dtype)
    short, long = sorted(grad.shape[-2:])
    iterate = (
        _iterate_gram if dtype == torch.float32 and long >= GRAM_MIN_ASPECT * short else _iterate
    )
    if grad.size(-2) > grad.size(-1):
        return iterate(x.mT, ns_steps, coefficients, eps).mT
    return iterate(x, ns_steps, coefficients, eps)


def newton_schulz(
    grads: list[Tensor], ns_steps: int = 5, dtype: torch.dtype = torch.bfloat16
) -> list[Tensor]:
    """Orthogonalise same-shape tensors (>= 2-D, each viewed as ``(shape[0], -1)``) in
    ``dtype``, eager or compiled; returns ``dtype`` tensors of the input shapes. One tensor
    runs the 2-D iteration (no stacking copy); several run one batched iteration."""
    global _compiled
    shape = grads[0].shape
    fn = zeropower_via_newtonschulz
    if _use_compile:
        if _compiled is None:
            _compiled = torch.compile(zeropower_via_newtonschulz, dynamic=False)
        fn = _compiled
    rows, cols = shape[0], math.prod(shape[1:])  # (not -1: a matrix may have no rows)
    if rows * cols == 0:  # nothing to orthogonalise (torch.optim.Muon steps these too)
        return [torch.zeros(shape, dtype=dtype, device=g.device) for g in grads]
    if len(grads) == 1:
        return [fn(grads[0].reshape(rows, cols), ns_steps, dtype=dtype).reshape(shape)]
    batch = torch.stack([g.reshape(rows, cols) for g in grads])
    return [o.reshape(shape) for o in fn(batch, ns_steps, dtype=dtype).unbind(0)]
