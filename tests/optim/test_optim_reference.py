"""Single-process Muon/AdamW against torch.optim.Muon and torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch

from optim import Muon, set_ns_compile
from optim.newton_schulz import get_ns_compile

SHAPES = [(64, 128), (128, 64), (3, 5), (96, 96)]
STEPS = 5


@pytest.fixture(autouse=True)
def _eager_ns():
    before = get_ns_compile()
    set_ns_compile(False)
    yield
    set_ns_compile(before)


def _adjusted(lr, shape, fn):
    a, b = shape
    return lr * (max(1.0, a / b) ** 0.5 if fn == "original" else 0.2 * max(a, b) ** 0.5)


def _run_pair(make_ours, make_ref, shapes, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    o1, o2 = make_ours(ours), make_ref(ref)
    for _ in range(steps):
        for a, b in zip(ours, ref):
            gr = torch.randn(a.shape, generator=g)
            a.grad, b.grad = gr.clone(), gr.clone()
        o1.step()
        o2.step()
    return init, ours, ref, o1, o2


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_torch_optim_muon_within_bf16_rounding(adjust_lr_fn, nesterov):
    hp = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": nesterov}
    init, ours, ref, _, _ = _run_pair(
        # bf16 forced: torch's dtype (on a CPU without bf16 units, 'auto' is fp32)
        lambda ps: Muon([{"params": ps, **hp}], adjust_lr_fn=adjust_lr_fn, ns_dtype="bf16"),
        lambda ps: torch.optim.Muon(ps, adjust_lr_fn=adjust_lr_fn, **hp),
        SHAPES,
        STEPS,
    )
    for p0, a, b, shape in zip(init, ours, ref, SHAPES):
        # Tolerance: both run Newton-Schulz in bfloat16 on momenta that agree to fp32 rounding
        # (torch uses lerp, we use mul+add), so an entry of the orthogonalised update (|x| <~ 1)
        # may land one bf16 ulp (2^-7 at 1.0) apart. Each step moves a param by adjusted_lr * x,
        # hence at most STEPS * adjusted_lr * 2^-7 apart after STEPS steps. A wrong algorithm
        # (no Nesterov, wrong scaling or decay) is off by O(adjusted_lr) per step.
        atol = STEPS * _adjusted(0.02, shape, adjust_lr_fn) * 2**-7
        torch.testing.assert_close(a.data, b.data, atol=atol, rtol=0)
        assert not torch.equal(a.data, p0), "the step did not move the param"


def test_muon_tolerance_is_tight_enough_to_catch_a_wrong_adjust_lr_fn():
    _, ours, ref, _, _ = _run_pair(
        lambda ps: Muon([{"params": ps, "lr": 0.02, "ns_dtype": "bf16"}], adjust_lr_fn="original"),
        lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"),
        [(64, 128)],
        STEPS,
    )
    atol = STEPS * _adjusted(0.02, (64, 128), "match_rms_adamw") * 2**-7
    assert (ours[0].data - ref[0].data).abs().max() > atol


def test_adamw_group_matches_torch_adamw_after_10_steps():
    shapes = [(128,), (7,), (16, 4)]
    hp = {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
    _, ours, ref, o1, o2 = _run_pair(
        lambda ps: Muon(
            [
                {
                    "params": ps,
                    "use_muon": False,
                    "lr": hp["lr"],
                    "weight_decay": hp["weight_decay"],
                    "adamw_betas": hp["betas"],
                    "adamw_eps": hp["eps"],
                }
            ]
        ),
        lambda ps: torch.optim.AdamW(ps, foreach=False, **hp),
        shapes,
        10,
    )
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.data, b.data, rtol=1e-6, atol=0)
        sa, sb = o1.state[a], o2.state[b]
        # Moments: torch uses lerp/addcmul, we use mul+add; an EMA entry that passes near 0
        # loses its relative precision to cancellation, so its error is bounded relative to
        # the moment's scale, not to the entry itself.
        for ours_key, ref_key in (("moment1", "exp_avg"), ("moment2", "exp_avg_sq")):
            scale = sb[ref_key].abs().max().item()
            torch.testing.assert_close(sa[ours_key], sb[ref_key], rtol=1e-6, atol=1e-6 * scale)
        assert float(sa["step"]) == float(sb["step"]) == 10.0
        assert sa["step"].device.type == "cpu"


def test_higher_dim_weights_are_orthogonalised_as_rows_by_rest():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 3, 3, 3, generator=g)
    conv = torch.nn.Parameter(w.clone())
    flat = torch.nn.Parameter(w.reshape(8, -1).clone())
    o1 = Muon([{"params": [conv], "lr": 0.02, "weight_decay": 0.01}])
    o2 = Muon([{"params": [flat], "lr": 0.02, "weight_decay": 0.01}])
    for _ in range(3):
        gr = torch.randn(w.shape, generator=g)
        conv.grad, flat.grad = gr.clone(), gr.reshape(8, -1).clone()
        o1.step()
        o2.step()
    assert torch.equal(conv.data.reshape(8, -1), flat.data)


def test_ns_compile_on_and_off_agree_within_bf16_rounding():
    shape = (32, 48)
    results = []
    for compiled in (False, True):
        set_ns_compile(compiled)
        _, ours, _, _, _ = _run_pair(
            lambda ps: Muon([{"params": ps, "lr": 0.02}], adjust_lr_fn="original"),
            lambda ps: torch.optim.SGD(ps, lr=0.0),
            [shape],
            3,
        )
        results.append(ours[0].data)
    # Same bound as against torch.optim.Muon: a fused (compiled) kernel may round a bf16 entry
    # of the update one ulp differently from eager.
    torch.testing.assert_close(
        results[0], results[1], atol=3 * _adjusted(0.02, shape, "original") * 2**-7, rtol=0
    )


def test_lr_scheduler_and_zero_grad_work():
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = Muon([{"params": [p], "lr": 0.1}])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        p.grad = torch.randn(8, 8)
        opt.step()
        sched.step()
        opt.zero_grad()
        assert p.grad is None
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_none_grad_frees_grads_after_step():
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = Muon([{"params": [p], "none_grad": True}])
    p.grad = torch.randn(8, 8)
    opt.step()
    assert p.grad is None


def test_init_state_creates_every_state_without_moving_params():
    w = torch.nn.Parameter(torch.randn(8, 4))
    b = torch.nn.Parameter(torch.randn(4))
    before = (w.detach().clone(), b.detach().clone())
    opt = Muon([{"params": [w]}, {"params": [b], "use_muon": False}])
    opt.init_state()
    assert set(opt.state[w]) == {"momentum_buffer"}
    assert set(opt.state[b]) == {"moment1", "moment2", "step"}
    assert float(opt.state[b]["step"]) == 0.0
    assert torch.equal(w, before[0]) and torch.equal(b, before[1])
    sd = opt.state_dict()
    fresh = Muon([{"params": [w]}, {"params": [b], "use_muon": False}])
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.state[w]["momentum_buffer"], torch.zeros(8, 4))


def test_params_without_grad_are_skipped():
    w1, w2 = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8, 4))
    before = w2.detach().clone()
    opt = Muon([{"params": [w1, w2]}])
    w1.grad = torch.randn(8, 4)
    opt.step()
    assert torch.equal(w2, before)
    assert w2 not in opt.state


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_matches_no_offload_for_every_momentum_dtype(nesterov, dtype):
    # Without Nesterov the update IS the momentum buffer; a bf16 buffer must still be copied
    # before the pool parks (frees) it.
    g = torch.Generator().manual_seed(5)
    init = [torch.randn(8, 4, generator=g).to(dtype) for _ in range(3)]
    grads = [[torch.randn(8, 4, generator=g).to(dtype) for _ in range(3)] for _ in range(3)]
    runs = []
    for offload in (False, True):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        opt = Muon([{"params": ps, "nesterov": nesterov}], chunk_size=1)
        if offload:
            opt.turn_on_cpu_offload()
        for step in grads:
            for p, gr in zip(ps, step):
                p.grad = gr.clone()
            opt.step()
        runs.append([p.detach().clone() for p in ps])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_hyperparameters_set_after_load_state_dict_reach_muon_groups():
    p = torch.nn.Parameter(torch.randn(8, 4))
    opt = Muon([{"params": [p], "lr": 0.02}])
    p.grad = torch.randn(8, 4)
    opt.step()
    opt.load_state_dict(opt.state_dict())  # replaces the param-group dicts
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = p.detach().clone()
    p.grad = torch.randn(8, 4)
    opt.step()
    assert torch.equal(p, before), "lr=0 after load_state_dict was ignored"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_adamw_second_moment_of_half_params_does_not_overflow(dtype):
    """Half-precision params with gradients whose square overflows float16 (>= 256): the
    second moment is computed in float32, as torch.optim.AdamW's addcmul does."""
    ours, ref = (torch.nn.Parameter(torch.zeros(3, dtype=dtype)) for _ in range(2))
    opt = Muon([{"params": [ours], "use_muon": False, "lr": 0.03, "adamw_betas": (0.9, 0.95)}])
    torch_opt = torch.optim.AdamW(
        [ref], lr=0.03, betas=(0.9, 0.95), weight_decay=0.0, foreach=False
    )
    for g in ([300.0, -1.0, 500.0], [1.0, 2.0, -3.0]):
        ours.grad = torch.tensor(g, dtype=dtype)
        ref.grad = ours.grad.clone()
        opt.step()
        torch_opt.step()
    v = opt.state[ours]["moment2"]
    assert torch.isfinite(v).all(), v
    torch.testing.assert_close(v, torch_opt.state[ref]["exp_avg_sq"], rtol=1e-2, atol=0)
    torch.testing.assert_close(ours.data, ref.data, rtol=2e-2, atol=1e-3)
