"""Bad hyperparameters and bad groups: each a ValueError naming the field and the value."""

from __future__ import annotations

import pytest
import torch

from optim import Muon


def _w(*shape):
    return torch.nn.Parameter(torch.zeros(*shape))


@pytest.mark.parametrize(
    ("group_update", "match"),
    [
        ({"lr": -0.1}, r"lr must be a number >= 0, got -0\.1"),
        ({"lr": "fast"}, r"lr must be a number >= 0, got 'fast'"),
        ({"weight_decay": -1}, r"weight_decay must be a number >= 0, got -1"),
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\), got 1\.0"),
        ({"momentum": -0.5}, r"momentum must be in \[0, 1\), got -0\.5"),
        ({"nesterov": 1}, r"nesterov must be a bool, got 1"),
        ({"none_grad": "yes"}, r"none_grad must be a bool, got 'yes'"),
        ({"use_muon": None}, r"use_muon must be a bool, got None"),
        ({"ns_steps": 0}, r"ns_steps must be an int in \[1, 100\), got 0"),
        ({"ns_steps": 2.5}, r"ns_steps must be an int in \[1, 100\), got 2\.5"),
        (
            {"ns_dtype": "fp16"},
            r"ns_dtype must be one of \('auto', 'bf16', 'fp32'\) .*got 'fp16'",
        ),
        ({"ns_dtype": torch.bfloat16}, r"ns_dtype must be one of .*got torch\.bfloat16"),
        ({"ns_dtpye": "fp32"}, r"unknown hyperparameter 'ns_dtpye'; did you mean 'ns_dtype'"),
        ({"adamw_betas": (0.9,)}, r"adamw_betas must be two numbers in \[0, 1\), got \(0\.9,\)"),
        ({"adamw_betas": (0.9, 1.2)}, r"adamw_betas must be two numbers in \[0, 1\)"),
        ({"adamw_eps": -1e-8}, r"adamw_eps must be a number >= 0, got -1e-08"),
        ({"lr": float("nan")}, r"lr must be a number >= 0, got nan"),
        ({"weight_decay": float("nan")}, r"weight_decay must be a number >= 0, got nan"),
        ({"adamw_eps": float("nan")}, r"adamw_eps must be a number >= 0, got nan"),
        (
            {"betas": (0.5, 0.5)},
            r"'betas' is torch\.optim's name; Muon's groups take 'adamw_betas'",
        ),
        ({"eps": 1.0}, r"'eps' is torch\.optim's name; Muon's groups take 'adamw_eps'"),
        (
            {"weight_decy": 0.5},
            r"unknown hyperparameter 'weight_decy'; did you mean 'weight_decay'",
        ),
        ({"weight_decays": 0.5}, r"unknown hyperparameter 'weight_decays'; did you mean"),
        ({"momentumm": 0.5}, r"unknown hyperparameter 'momentumm'; did you mean 'momentum'"),
        ({"names": ["a"]}, r"names has 1 entries but the group has 2 params"),
        ({"names": ["a", "a"]}, r"names must be unique, got duplicates \['a'\]"),
        ({"names": "ab"}, r"names must be a list of str"),
    ],
)
def test_bad_group_hyperparameter_is_a_clear_value_error(group_update, match):
    with pytest.raises(ValueError, match=match):
        Muon([{"params": [_w(4, 4), _w(4, 4)], **group_update}])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk_size": 0}, r"chunk_size must be an int >= 1, got 0"),
        ({"warmup_step": -1}, r"warmup_step must be an int >= 0, got -1"),
        ({"adjust_lr_fn": "sqrt"}, r"adjust_lr_fn must be one of .*got 'sqrt'"),
        ({"learning_rate": 0.1}, r"unknown Muon argument\(s\) \['learning_rate'\]"),
    ],
)
def test_bad_constructor_argument_is_a_clear_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon([_w(4, 4)], **kwargs)


def test_vector_in_muon_group_is_an_error_that_names_it():
    with pytest.raises(ValueError, match=r"param 'ln.bias' has shape \(4,\) .*use_muon=False"):
        Muon([{"params": [_w(4, 4), _w(4)], "names": ["fc.weight", "ln.bias"]}])


def test_integer_param_is_an_error():
    p = torch.zeros(4, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"must be floating point, got torch.int64"):
        Muon([{"params": [p]}])


def test_bad_group_added_later_is_rejected_and_not_kept():
    opt = Muon([_w(4, 4)])
    with pytest.raises(ValueError, match=r"param group 1: momentum must be in \[0, 1\)"):
        opt.add_param_group({"params": [_w(2, 2)], "momentum": 2.0})
    assert len(opt.param_groups) == 1


def test_add_param_group_then_step_works():
    a, b = _w(4, 4), _w(3)
    opt = Muon([{"params": [a]}])
    opt.add_param_group({"params": [b], "use_muon": False, "lr": 1e-3})
    a.grad, b.grad = torch.ones(4, 4), torch.ones(3)
    opt.step()
    assert set(opt.state[b]) == {"moment1", "moment2", "step"}


def test_keys_a_scheduler_adds_are_kept():
    """Keys Muon does not use but other tools put in groups (a scheduler's ``initial_lr``,
    ``max_lr``; a user's own flag that contains a Muon key, ``no_weight_decay``) are accepted
    and kept."""
    opt = Muon([{"params": [_w(4, 4)], "initial_lr": 0.02, "max_lr": 0.1, "no_weight_decay": True}])
    assert opt.param_groups[0]["no_weight_decay"] is True
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.1, total_steps=10, cycle_momentum=False
    )
    sched.step()
    assert opt.param_groups[0]["initial_lr"] == pytest.approx(0.1 / 25)


@pytest.mark.parametrize("shape", [(0, 5), (0, 3, 3, 3), (5, 0), (4, 0, 3)])
def test_matrices_without_elements_step(shape):
    """A Muon matrix with no rows (or columns) steps, as torch.optim.Muon does for 2-D ones,
    next to a matrix that does move."""
    empty, full = _w(*shape), _w(4, 4)
    opt = Muon([{"params": [empty, full]}])
    empty.grad, full.grad = torch.zeros(shape), torch.ones(4, 4)
    opt.step()
    assert empty.shape == shape and not torch.equal(full.data, torch.zeros(4, 4))


def test_a_muon_group_without_params_is_passed_over_by_the_step_and_the_offload():
    # Its ns_dtype and ns_method stay "auto" (no device to resolve them by): the plan raised
    # KeyError 'auto' from every step and from turn_on_cpu_offload().
    def make():
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4, 12, generator=gen))
        b = torch.nn.Parameter(torch.randn(4, generator=gen))
        groups = [{"params": [p]}, {"params": [b], "use_muon": False}]
        return p, b, groups

    p, b, groups = make()
    ref = Muon(groups)
    p2, b2, groups2 = make()
    opt = Muon([{"params": []}, *groups2])
    assert opt.param_groups[0]["ns_dtype"] == "auto"
    opt.turn_on_cpu_offload()
    for q, r, s in ((p, b, 1), (p2, b2, 1)):
        gen = torch.Generator().manual_seed(s)
        q.grad, r.grad = torch.randn(4, 12, generator=gen), torch.randn(4, generator=gen)
    ref.step()
    opt.step()
    assert torch.equal(p, p2) and torch.equal(b, b2)
