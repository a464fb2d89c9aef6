"""The Gram Newton-Schulz iteration (``ns_method="gram"``): as close to a float64 iteration as
the standard one, chosen per matrix by its aspect ratio, recorded in the param group like
``ns_dtype`` and kept by a resume."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from muon_ckpt import CheckpointManager
from optim import Muon
from optim.newton_schulz import (
    _iterate,
    _iterate_gram,
    ns_flops,
    uses_gram,
    zeropower_via_newtonschulz,
)
from tests.optim.test_optim_ns_dtype import COEFFS, _gradient_like, _ns_float64, _rel

EPS = 1e-7
# The standard fp32 iteration's bound (tests/optim/test_optim_ns_dtype.py: ~5e-6 measured,
# 10x kept).
FP32_TOL = 5e-5


def _matrix(rows: int, cols: int, spectrum: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if spectrum == "gaussian":
        return torch.randn(rows, cols, generator=gen)
    return _gradient_like(rows, cols, gen).float()


def _standard(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    out = _iterate(x.mT if tall else x, 5, COEFFS, EPS)
    return out.mT if tall else out


def _gram(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The Gram iteration forced, whatever the aspect ratio."""
    tall = g.size(-2) > g.size(-1)
    out = _iterate_gram(g.mT if tall else g, 5, COEFFS, EPS, dtype)
    return out.mT if tall else out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("spectrum", ["gaussian", "gradient-like"])
@pytest.mark.parametrize("orientation", ["wide", "tall"])
@pytest.mark.parametrize("aspect", [1, 2, 3, 8])
def test_gram_newton_schulz_is_as_close_to_float64_as_the_standard_iteration(
    aspect, orientation, spectrum, dtype
):
    # Tolerance: the standard iteration's own error on the same matrix in the same dtype (bf16:
    # 1e-2 to 1.4e-1; the Gram one computes in float16 and is 3-10x closer), and for fp32 the
    # standard iteration's bound of 5e-5.
    rows, cols = 48, 48 * aspect
    if orientation == "tall":
        rows, cols = cols, rows
    g = _matrix(rows, cols, spectrum, seed=aspect * 10 + len(orientation))
    ref = _ns_float64(g)
    out = _gram(g, dtype)
    assert out.dtype == dtype and out.shape == g.shape
    standard = _rel(_standard(g, dtype), ref)
    tol = FP32_TOL if dtype == torch.float32 else standard
    assert _rel(out, ref) <= tol, (_rel(out, ref), standard)


def _low_rank_plus_noise(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    low = torch.randn(rows, 4, generator=gen, dtype=torch.float64)
    low = low @ torch.randn(4, cols, generator=gen, dtype=torch.float64)
    return (low + 1e-3 * torch.randn(rows, cols, generator=gen, dtype=torch.float64)).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("ns_steps", [5, 9, 11, 15])
def test_gram_newton_schulz_stays_as_close_to_float64_as_the_standard_one_at_more_steps(
    ns_steps, dtype
):
    # Restarting every 3 steps keeps R and QX from drifting apart: with one restart half-way
    # the error grew to 4x the standard iteration's at 9 steps and to NaN from 11.
    gen = torch.Generator().manual_seed(ns_steps)
    for g in (_low_rank_plus_noise(16, 256, ns_steps), _gradient_like(24, 192, gen).float()):
        ref = _ns_float64(g, ns_steps)
        out = zeropower_via_newtonschulz(g, ns_steps, dtype=dtype, method="gram")
        standard = _rel(zeropower_via_newtonschulz(g, ns_steps, dtype=dtype), ref)
        assert _rel(out, ref) <= 2 * standard, (_rel(out, ref), standard)


def test_gram_newton_schulz_of_a_zero_matrix_is_zero_at_any_number_of_steps():
    # Q collects at most 3 factors of Z = aI between restarts (a^3 = 41; a^9 overflowed fp16).
    for ns_steps in (5, 11, 17, 25):
        for dtype in (torch.bfloat16, torch.float32):
            out = zeropower_via_newtonschulz(
                torch.zeros(8, 64), ns_steps, dtype=dtype, method="gram"
            )
            assert torch.equal(out, torch.zeros(8, 64, dtype=dtype)), (ns_steps, dtype)


@pytest.mark.parametrize("shape", [(8, 40), (40, 8), (8, 16)])
def test_ns_flops_are_the_flops_the_iteration_runs(shape):
    for ns_steps in range(1, 10):
        for method in ("gram", "standard"):
            g = torch.randn(shape)
            with FlopCounterMode(display=False) as counter:
                zeropower_via_newtonschulz(g, ns_steps, dtype=torch.float32, method=method)
            want = ns_flops(*shape, ns_steps, method)
            assert counter.get_total_flops() == want, (ns_steps, method)


def test_gram_newton_schulz_of_a_batch_is_each_matrix_s():
    gen = torch.Generator().manual_seed(1)
    batch = torch.randn(3, 16, 64, generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        out = zeropower_via_newtonschulz(batch, dtype=dtype, method="gram")
        for i in range(3):
            one = zeropower_via_newtonschulz(batch[i], dtype=dtype, method="gram")
            torch.testing.assert_close(out[i], one, rtol=0, atol=2e-3)


@pytest.mark.parametrize(
    ("rows", "cols", "gram"),
    [(8, 8, False), (8, 16, False), (16, 8, False), (8, 17, True), (17, 8, True), (3, 64, True)],
)
def test_the_gram_iteration_runs_only_where_the_aspect_ratio_exceeds_2(rows, cols, gram):
    assert uses_gram(rows, cols, "gram") is gram
    assert not uses_gram(rows, cols, "standard")
    g = _matrix(rows, cols, "gaussian", seed=rows * cols)
    out = zeropower_via_newtonschulz(g, dtype=torch.float32, method="gram")
    assert torch.equal(out, (_gram if gram else _standard)(g, torch.float32))


def _w(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape))


def test_auto_is_gram_in_fp32_and_standard_in_bf16_on_a_cpu_and_is_recorded():
    opt = Muon(
        [
            {"params": [_w(4, 4)], "ns_dtype": "fp32"},
            {"params": [_w(4, 4)], "ns_dtype": "bf16"},
            {"params": [_w(4, 4)], "ns_dtype": "bf16", "ns_method": "gram"},
        ]
    )
    assert [g["ns_method"] for g in opt.param_groups] == ["gram", "standard", "gram"]
    assert opt.defaults["ns_method"] == "auto"
    assert "ns_method: gram" in repr(opt)
    with pytest.raises(ValueError, match=r"param group 0: ns_method must be one of .*'newton'"):
        Muon([{"params": [_w(4, 4)], "ns_method": "newton"}])


def test_each_matrix_of_a_group_takes_the_iteration_its_aspect_ratio_calls_for():
    shapes = [(8, 8), (8, 16), (8, 17), (24, 8), (8, 4, 4), (2, 3, 3, 3)]
    params = [_w(*s) for s in shapes]
    opt = Muon([{"params": params, "ns_dtype": "fp32", "ns_method": "gram"}], chunk_size=2)
    plan = opt._get_plan()
    by_param = {id(it.param): it.gram for it in plan.items}
    assert [by_param[id(p)] for p in params] == [False, False, True, True, False, True]
    # ... and the step runs it: Gram and standard give other bits on a wide matrix, the same
    # bits on a square one.
    ref = Muon([{"params": [_w(1, 1)], "ns_dtype": "fp32", "ns_method": "standard"}])
    for p in params:
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    before = [p.detach().clone() for p in params]
    twins = [torch.nn.Parameter(b.clone()) for b in before]
    for t, p in zip(twins, params):
        t.grad = p.grad.clone()
    ref.add_param_group({"params": twins, "ns_dtype": "fp32", "ns_method": "standard"})
    opt.step()
    ref.step()
    same = [torch.equal(p, t) for p, t in zip(params, twins)]
    assert same == [not by_param[id(p)] for p in params]


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_a_resumed_run_keeps_the_ns_method_it_trained_with(tmp_path):
    # fp32 'auto' is 'gram' here; the run trained with 'standard', the resumed one asks 'auto'.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.Linear(8, 32))
    opt = Muon([{"params": list(model.parameters())[::2], "ns_dtype": "fp32"}])
    opt.param_groups[0]["ns_method"] = "standard"
    _train(model, opt, 2, seed=1)
    with CheckpointManager(str(tmp_path / "run"), model=model, optimizer=opt) as mgr:
        mgr.save(2)
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.Linear(8, 32))
    opt2 = Muon([{"params": list(model2.parameters())[::2], "ns_dtype": "fp32"}])
    assert opt2.param_groups[0]["ns_method"] == "gram"
    with CheckpointManager(str(tmp_path / "run"), model=model2, optimizer=opt2) as mgr:
        assert mgr.load() == 2
    assert opt2.param_groups[0]["ns_method"] == "standard"
    _train(model, opt, 1, seed=2)
    _train(model2, opt2, 1, seed=2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_state_dict_from_before_ns_method_means_what_those_versions_ran():
    for ns_dtype, want in (("fp32", "gram"), ("bf16", "standard")):
        p = _w(8, 4)
        sd = Muon([{"params": [p], "ns_dtype": ns_dtype}]).state_dict()
        del sd["param_groups"][0]["ns_method"]
        fresh = Muon([{"params": [p], "ns_dtype": ns_dtype, "ns_method": "standard"}])
        fresh.load_state_dict(sd)
        assert fresh.param_groups[0]["ns_method"] == want
