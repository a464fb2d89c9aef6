"""``set_ns_compile(True)``: each shape of Newton-Schulz is compiled once, whatever the grad mode
of the caller, and past dynamo's recompile limit (8 graphs per function) no shape falls back to
eager. Counted with dynamo's own counters, on the CPU (inductor compiles C++ there)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from optim import Muon
from optim.newton_schulz import (
    _compiled,
    newton_schulz,
    set_ns_compile,
    zeropower_via_newtonschulz,
)


def _why_no_compile() -> str | None:
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        return "torch.compile's CPU backend (inductor) needs a C++ compiler; none is on PATH"
    return None


pytestmark = pytest.mark.skipif(_why_no_compile() is not None, reason=str(_why_no_compile()))


@pytest.fixture
def compiled():
    from torch._dynamo.utils import counters

    counters.clear()
    _compiled.clear()  # (each test counts its own compiled entries)
    set_ns_compile(True)
    try:
        yield counters
    finally:
        set_ns_compile(False)


def _graphs(counters) -> int:
    return counters["stats"]["unique_graphs"]


def test_each_shape_compiles_once_whatever_the_grad_mode_and_past_the_recompile_limit(
    compiled, caplog
):
    # Ten shapes (the limit is 8 per function), both methods, each called in both grad modes.
    shapes = [(4, 4 + k) for k in range(8)] + [(2, 3, 12), (12, 3)]
    caplog.set_level("WARNING", logger="torch._dynamo")
    gen = torch.Generator().manual_seed(0)
    mats = {s: torch.randn(s, generator=gen) for s in shapes}
    for grad in (True, False, True):
        with torch.set_grad_enabled(grad):
            for s, m in mats.items():
                method = "gram" if s[-1] > 2 * s[-2] else "standard"
                grads = list(m) if m.ndim == 3 else [m]
                out = newton_schulz(grads, 5, torch.float32, method)
                eager = [
                    zeropower_via_newtonschulz(g, dtype=torch.float32, method=method) for g in grads
                ]
                for o, e in zip(out, eager, strict=True):
                    torch.testing.assert_close(o, e, rtol=1e-4, atol=1e-5)
    assert _graphs(compiled) == len(shapes)
    # Dynamo says when it recompiles past its limit and leaves a function eager: it did not.
    assert "recompile_limit" not in caplog.text


def test_a_muon_step_compiles_each_batch_shape_once(compiled):
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(8, 8)] * 3 + [(4, 16)]]
    opt = Muon([{"params": params, "ns_dtype": "fp32"}], chunk_size=8)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    # One batch of three 8 x 8, one 4 x 16: two graphs for three steps.
    assert _graphs(compiled) == 2
    # The same batch from outside a step (grad mode on): the same graph.
    newton_schulz([torch.randn(8, 8)] * 3, 5, torch.float32, "gram")
    assert _graphs(compiled) == 2


def _entries() -> int:
    return sum(len(v) for v in _compiled.values())


def test_inference_mode_autocast_and_the_input_s_layout_never_recompile_a_shape(compiled):
    # Dynamo guards an input's dispatch keys (inference or not, inference mode or not),
    # requires_grad and strides, and the global autocast state: each of these used to compile
    # the one shape again.
    gen = torch.Generator().manual_seed(2)
    m = torch.randn(12, 4, generator=gen).t()  # non-contiguous
    with torch.inference_mode():
        inference_tensor = m.clone()
    inputs = {
        "plain": m.contiguous(),
        "non-contiguous": m,
        "requires_grad": m.contiguous().requires_grad_(),
        "inference tensor": inference_tensor,
    }
    outs = []
    for _ in range(2):
        for x in inputs.values():
            outs.append(newton_schulz([x], 5, torch.float32, "gram")[0])
            with torch.inference_mode():
                outs.append(newton_schulz([x], 5, torch.float32, "gram")[0])
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(newton_schulz([x], 5, torch.float32, "gram")[0])
    # One graph for the one shape, and the same bits from every call (autocast off inside: the
    # fp32 iteration runs in fp32).
    assert (_entries(), _graphs(compiled)) == (1, 1)
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_a_muon_step_under_inference_mode_compiles_no_other_graph(compiled):
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(4, 16, generator=gen))
    opt = Muon([{"params": [p], "ns_dtype": "fp32"}])
    for inference in (False, True, False, True):
        p.grad = torch.randn(4, 16, generator=gen)
        with torch.inference_mode(inference):
            opt.step()
    assert _graphs(compiled) == 1 == _entries()
