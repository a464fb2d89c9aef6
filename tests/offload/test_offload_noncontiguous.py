"""A non-contiguous optimizer state (torch.optim.Muon's momentum of a transposed param, a
strided view loaded into a state dict) offloads with its values: the pool lays each state out
row-major and the state becomes a contiguous view of it, so offload on steps bitwise as off,
and no state reads or writes past its range of the pool."""

from __future__ import annotations

import copy

import torch

from optim import Muon


def _transposed() -> tuple[torch.nn.Parameter, Muon]:
    w = torch.nn.Parameter(torch.randn(20, 6, generator=torch.Generator().manual_seed(0)).t())
    return w, Muon([{"params": [w], "ns_dtype": "fp32", "ns_method": "standard"}])


def _steps(opt: Muon, p: torch.nn.Parameter, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return p.detach().clone()


def test_torch_muon_s_transposed_momentum_steps_the_same_with_offload_on_and_off():
    w0, _ = _transposed()
    torch_muon = torch.optim.Muon([w0], lr=0.02, adjust_lr_fn="match_rms_adamw")
    (w0 * torch.randn(6, 20)).sum().backward()  # autograd: the grad in the param's layout
    torch_muon.step()
    sd = copy.deepcopy(torch_muon.state_dict())
    assert sd["state"][0]["momentum_buffer"].stride() == (1, 6)
    sd["param_groups"] = _transposed()[1].state_dict()["param_groups"]
    stepped = []
    for offload in (False, True):
        w, opt = _transposed()
        opt.load_state_dict(copy.deepcopy(sd))
        if offload:
            opt.turn_on_cpu_offload()
            assert torch.equal(
                opt.cpu_state(w)["momentum_buffer"], sd["state"][0]["momentum_buffer"]
            )
        stepped.append(_steps(opt, w, seed=1))
    assert torch.equal(*stepped)


def test_a_strided_state_is_laid_out_in_its_own_range_of_the_pool():
    p = torch.nn.Parameter(torch.randn(20, 6, generator=torch.Generator().manual_seed(2)))
    opt = Muon([{"params": [p], "ns_dtype": "fp32"}])
    _steps(opt, p, seed=3)
    sd = opt.state_dict()
    wide = torch.randn(20, 12, generator=torch.Generator().manual_seed(4))
    sd["state"][0]["momentum_buffer"] = wide[:, ::2]  # strides (12, 2): gaps
    stepped = []
    for offload in (False, True):
        q = torch.nn.Parameter(p.detach().clone())
        fresh = Muon([{"params": [q], "ns_dtype": "fp32"}])
        fresh.load_state_dict(copy.deepcopy(sd))
        if offload:
            fresh.turn_on_cpu_offload()
            # Once offloaded the state spans its own 120 elements, not 240 of a 120-element range.
            assert torch.equal(fresh.cpu_state(q)["momentum_buffer"], wide[:, ::2])
            assert fresh.state[q]["momentum_buffer"].stride() == (6, 1)
        stepped.append(_steps(fresh, q, seed=5))
    assert torch.equal(*stepped)
