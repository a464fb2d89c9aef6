"""What Muon reports about itself: each param's update rule (``update_rule``), and the
Newton-Schulz work a rank did in its last step (``ns_work``)."""

from __future__ import annotations

import pytest
import torch

from optim import Muon, NSWork, UpdateRule
from optim.newton_schulz import ns_flops


def _p(*shape):
    return torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(0)))


def test_each_param_reports_the_rule_it_is_updated_by():
    square, wide, conv, bias = _p(8, 8), _p(4, 16), _p(4, 2, 3, 3), _p(8)
    opt = Muon(
        [
            {"params": [square, wide], "ns_dtype": "fp32", "ns_method": "gram"},
            {"params": [conv], "ns_dtype": "bf16", "ns_method": "standard"},
            {"params": [bias], "use_muon": False},
        ]
    )
    # The Gram iteration runs on the wide matrix only (aspect ratio 4 > 2).
    assert opt.update_rule(square) == UpdateRule("muon", "standard", "fp32")
    assert opt.update_rule(wide) == UpdateRule("muon", "gram", "fp32")
    assert opt.update_rule(conv) == UpdateRule("muon", "standard", "bf16")
    assert opt.update_rule(bias) == UpdateRule("adamw")
    assert str(opt.update_rule(wide)) == "muon(ns_method=gram, ns_dtype=fp32)"
    assert str(opt.update_rule(bias)) == "adamw"
    # A group set back to "auto" reports what "auto" means here (as the next step runs it).
    opt.param_groups[1]["ns_dtype"] = "auto"
    assert opt.update_rule(conv).ns_dtype in ("bf16", "fp32")
    with pytest.raises(ValueError, match=r"a param of shape \(3,\) is not in the optimizer's"):
        opt.update_rule(_p(3))


def test_ns_work_names_the_matrices_a_step_orthogonalised_and_their_flops():
    a, b, c = _p(8, 8), _p(4, 16), _p(8)
    opt = Muon(
        [
            {"params": [a, b], "names": ["a", "b"], "ns_dtype": "fp32", "ns_method": "gram"},
            {"params": [c], "names": ["c"], "use_muon": False},
        ]
    )
    assert opt.ns_work() == NSWork(0, 0, ())  # before any step
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt.step()
    work = opt.ns_work()
    assert sorted(work.params) == ["a", "b"] and work.matrices == 2
    assert work.flops == ns_flops(8, 8, 5, "gram") + ns_flops(4, 16, 5, "gram")
    b.grad = None  # a matrix without a grad is not orthogonalised
    opt.step()
    assert opt.ns_work().params == ("a",)


def test_ns_flops_counts_the_products_of_each_iteration():
    # Standard: 5 steps of (2 m^2 n + m^3) multiply-adds; Gram at aspect ratio r: 4r + 14
    # products of m^3 (docs/internals.md), against 10r + 5 for the standard iteration.
    m = 16
    for r in (1, 2, 3, 4, 8):
        assert ns_flops(m, r * m, 5, "standard") == 2 * m**3 * (10 * r + 5)
        want = 10 * r + 5 if r <= 2 else 4 * r + 14
        assert ns_flops(r * m, m, 5, "gram") == 2 * m**3 * want
