"""Newton-Schulz orthogonalisation, the heart of Muon.

``zeropower_via_newtonschulz(G)`` returns an approximation of ``U V^T`` for ``G = U S V^T``
with the quintic iteration of torch.optim.Muon (coefficients 3.4445, -4.7750, 2.0315), run in
bfloat16 (torch's choice) or float32 (``dtype=``; Muon's ``ns_dtype``). With ``method="gram"``
a matrix whose aspect ratio exceeds ``GRAM_ASPECT`` iterates on its small Gram matrix instead
(same polynomial, fewer flops; see ``_iterate_gram``), in float32 for float32 and in float16
for bfloat16. ``set_ns_compile(True)`` routes calls through ``torch.compile``: one graph per
input shape and arguments, compiled once (``_compiled_for``); off by default, as on an H200 it
gained nothing on 16 x 4096^2 and lost on many small shapes.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "GRAM_ASPECT",
    "GRAM_RESTART",
    "get_ns_compile",
    "newton_schulz",
    "ns_flops",
    "set_ns_compile",
    "uses_gram",
    "zeropower_via_newtonschulz",
]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_EPS = 1e-7

_use_compile = False


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


# The Gram iteration runs where the aspect ratio (long side / short side) exceeds this: for a
# ratio r it costs 4r + 14 products of short-side cubes against 10r + 5 (1.14x fewer flops at
# r = 2, 1.5x at r = 4; fp32 on a CPU: 1.13x and 1.5x faster), and at r <= 2 the gain is
# within what its extra launches cost on a GPU.
GRAM_ASPECT = 2

# What the Gram iteration computes in, per Newton-Schulz dtype: float16 for bfloat16 (the same
# tensor-core speed, 8x finer rounding; its range holds every value the normalised iteration
# makes, see ``_iterate_gram``).
_GRAM_COMPUTE = {torch.bfloat16: torch.float16}

# The Gram iteration restarts (X <- QX, R <- XX^T) before every step k with k % GRAM_RESTART
# == 0 (k > 0): at the default 5 steps once, before step 3; see ``_iterate_gram``.
GRAM_RESTART = 3


def uses_gram(rows: int, cols: int, method: str) -> bool:
    """Whether ``method`` ("standard" or "gram") runs the Gram iteration on a rows x cols
    matrix: "gram" where its aspect ratio exceeds ``GRAM_ASPECT``."""
    return method == "gram" and max(rows, cols) > GRAM_ASPECT * min(rows, cols)


def ns_flops(rows: int, cols: int, ns_steps: int, method: str) -> int:
    """Floating-point operations (2 per multiply-add) of the matrix products Newton-Schulz
    runs on a rows x cols matrix by ``method``, as ``_iterate`` and ``_iterate_gram`` run
    them (the normalisation and the elementwise terms left out)."""
    m, n = min(rows, cols), max(rows, cols)
    if not uses_gram(rows, cols, method):
        return 2 * ns_steps * (2 * m * m * n + m**3)
    macs = m * m * n  # R = X X^T
    q = False
    for k in range(ns_steps):
        if k % GRAM_RESTART == 0 and q:
            macs, q = macs + 2 * m * m * n, False  # X <- Q X, R <- X X^T
        macs += m**3 * (2 if q else 1)  # Z, and Q <- Z Q
        q = True
        if k + 1 < ns_steps and (k + 1) % GRAM_RESTART:
            macs += 2 * m**3  # R <- Z R Z
    return 2 * (macs + m * m * n)  # (Q X at the end)


def _iterate_gram(
    x: Tensor,
    ns_steps: int,
    coefficients: tuple[float, float, float],
    eps: float,
    dtype: torch.dtype,
) -> Tensor:
    """The same quintic iteration as ``_iterate`` (rows <= cols), carried out on the rows x rows
    Gram matrix R = X X^T: each step X <- Z X with Z = aI + bR + cR^2, so the steps collect
    into Q = Z_k ... Z_0 and R <- Z R Z, and X is multiplied once at the end. Returns ``dtype``.

    X is normalised in float32 (so an input beyond float16's range is fine), then the iteration
    runs in ``_GRAM_COMPUTE[dtype]`` (else ``dtype``). Normalised, every singular value of X
    starts in [0, 1] and the polynomial keeps it in [0, 1.21], so every eigenvalue of R lies in
    [0, 1.45], of Z in [0.64, 3.44], and of Q (at most ``GRAM_RESTART`` factors) below
    3.44^3 = 41: float16's 65504 holds them all, a zero matrix's Q = a^3 I included.

    Every ``GRAM_RESTART`` steps the product is folded into X and R formed afresh from it (a
    restart, as the published Gram iterations do): R and QX otherwise drift apart by rounding,
    which the iteration amplifies (at ns_steps >= 9 with one restart half-way: 4x to NaN off
    float64). With it, float32 stays as close to a float64 iteration as ``_iterate`` (rel.
    error ~5e-6 on gradient-like spectra at 5 steps, ~1e-4 at 9 to 15, as ``_iterate``), and
    float16 is 3-10x closer to it than ``_iterate`` in bfloat16 (measured from 64 x 64 to
    256 x 2048, gaussian, gradient-like and heavy-tailed)."""
    a, b, c = coefficients
    mm = torch.mm if x.ndim == 2 else torch.bmm
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm
    x = x.float()
    norm = x.norm() if x.ndim == 2 else x.norm(dim=(-2, -1), keepdim=True)
    x = (x / norm.clamp(min=eps)).to(_GRAM_COMPUTE.get(dtype, dtype))
    r = mm(x, x.mT)
    q: Tensor | None = None
    for k in range(ns_steps):
        if k % GRAM_RESTART == 0 and q is not None:
            x, q = mm(q, x), None
            r = mm(x, x.mT)
        z = addmm(r, r, r, beta=b, alpha=c)
        z.diagonal(dim1=-2, dim2=-1).add_(a)
        q = z if q is None else mm(z, q)
        if k + 1 < ns_steps and (k + 1) % GRAM_RESTART:  # (the next R is needed)
            r = mm(z, mm(r, z))
    return (x if q is None else mm(q, x)).to(dtype)


def _no_autocast(device: torch.device):
    """A context without autocast on ``device``: under it matmuls would run in the autocast
    dtype, not in the ``dtype`` asked for (an fp32 group silently in bf16)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def zeropower_via_newtonschulz(
    grad: Tensor,
    ns_steps: int = 5,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = _EPS,
    dtype: torch.dtype = torch.bfloat16,
    method: str = "standard",
) -> Tensor:
    """Newton-Schulz on a 2-D matrix, or on a batch ``(B, rows, cols)`` of same-shape
    matrices, computed in ``dtype`` (bfloat16: torch.optim.Muon's iteration) by ``method``
    (``uses_gram``), autocast or not; returns ``dtype`` of the input's shape."""
    with _no_autocast(grad.device):
        return _zeropower(grad, ns_steps, coefficients, eps, dtype, method)


def _zeropower(
    grad: Tensor,
    ns_steps: int,
    coefficients: tuple[float, float, float],
    eps: float,
    dtype: torch.dtype,
    method: str,
) -> Tensor:
    """``zeropower_via_newtonschulz`` under the caller's autocast state (what is compiled)."""
    tall = grad.size(-2) > grad.size(-1)
    if uses_gram(grad.size(-2), grad.size(-1), method):
        x = grad.mT if tall else grad
        out = _iterate_gram(x, ns_steps, coefficients, eps, dtype)
    else:
        x = grad.to(dtype)
        out = _iterate(x.mT if tall else x, ns_steps, coefficients, eps)
    return out.mT if tall else out


# Compiled Newton-Schulz, one entry per (shape, dtype, device, ns_steps, method), dispatch
# keys and global state (grad mode and autocast are always off inside; TF32, threads, ... as
# the caller set them): each a function of its own code object, so dynamo keeps one cache per
# entry and never meets its recompile limit (8 per code object), which would leave every
# further shape eager. The input is a detached, contiguous normal tensor outside inference
# mode, so dynamo's guards on its requires_grad, strides and dispatch keys always hold.
_compiled: dict[tuple, list[tuple[object, Callable[..., Tensor]]]] = {}


def _global_state() -> object | None:
    """Dynamo's guard on the global state (grad mode, autocast, TF32, threads, ...) as it is
    now; its ``check()`` tells whether the state is still the same. None where torch lacks it."""
    guards = getattr(torch._C, "_dynamo", None)
    cls = getattr(getattr(guards, "guards", None), "GlobalStateGuard", None)
    return cls() if cls is not None else None


def _compiled_for(x: Tensor, ns_steps: int, dtype: torch.dtype, method: str):
    key = (tuple(x.shape), x.dtype, x.device, ns_steps, dtype, method)
    entries = _compiled.setdefault(key, [])
    for state, fn in entries:
        if state is None or state.check():  # type: ignore[attr-defined]
            return fn
    f = _zeropower
    fresh = types.FunctionType(
        f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__
    )
    fn = torch.compile(fresh, dynamic=False, fullgraph=True)
    entries.append((_global_state(), fn))
    return fn


def newton_schulz(
    grads: list[Tensor],
    ns_steps: int = 5,
    dtype: torch.dtype = torch.bfloat16,
    method: str = "standard",
) -> list[Tensor]:
    """Orthogonalise same-shape tensors (>= 2-D, each viewed as ``(shape[0], -1)``) in
    ``dtype`` by ``method``, eager or compiled, always without autograd; returns ``dtype``
    tensors of the input shapes. One tensor runs the 2-D iteration (no stacking copy); several
    run one batched iteration."""
    shape = grads[0].shape
    rows, cols = shape[0], math.prod(shape[1:])  # (not -1: a matrix may have no rows)
    if rows * cols == 0:  # nothing to orthogonalise (torch.optim.Muon steps these too)
        return [torch.zeros(shape, dtype=dtype, device=g.device) for g in grads]
    # No autograd, no autocast, no inference mode (all three are part of what a compiled graph
    # is specialised for, so a call under any would otherwise compile again; autocast would
    # also change the dtype the iteration computes in). (inference_mode(False) turns grad mode
    # on: no_grad comes after it.)
    with torch.inference_mode(False), torch.no_grad(), _no_autocast(grads[0].device):
        if len(grads) == 1:
            x = grads[0].detach().reshape(rows, cols)
        else:
            x = torch.stack([g.reshape(rows, cols) for g in grads])
        # Contiguous: the matmuls' bits depend on the layout (a state's layout is not part of
        # its value: offload on and off would differ), and dynamo guards strides.
        x = x.contiguous()
        if _use_compile:
            # An inference tensor (made under inference mode) lacks the autograd dispatch keys
            # dynamo guards: its copy out here has them, like every other input.
            if x.is_inference():
                x = x.clone()
            fn = _compiled_for(x, ns_steps, dtype, method)
        else:
            fn = _zeropower
        out = fn(x, ns_steps, DEFAULT_NS_COEFFICIENTS, _EPS, dtype, method)
    if len(grads) == 1:
        return [out.reshape(shape)]
    return [o.reshape(shape) for o in out.unbind(0)]
