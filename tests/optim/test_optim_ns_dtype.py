"""The dtype Newton-Schulz runs in (``ns_dtype``): chosen per device, forced, kept by a resume,
and the fp32 iteration held to a float64 reference."""

from __future__ import annotations

import math
import platform

import pytest
import torch

from muon_ckpt import CheckpointManager
from optim import Muon
from optim.newton_schulz import uses_gram, zeropower_via_newtonschulz

CPU = torch.device("cpu")
COEFFS = (3.4445, -4.7750, 2.0315)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split()[2:]}
    except OSError:
        return set()


def _w(*shape):
    return torch.nn.Parameter(torch.randn(*shape))


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not _cpu_flags(), reason="reads x86 flags of /proc/cpuinfo"
)
def test_auto_is_bf16_on_a_cpu_with_bf16_units_and_fp32_without(monkeypatch):
    # (Units torch reaches only through oneDNN: without it, bf16 matmul is a scalar loop.)
    has_units = bool({"avx512_bf16", "amx_bf16"} & _cpu_flags()) and torch.backends.mkldnn.enabled
    opt = Muon([{"params": [_w(4, 4)]}, {"params": [_w(4)], "use_muon": False}])
    want = "bf16" if has_units else "fp32"
    assert [g["ns_dtype"] for g in opt.param_groups] == [want, want]
    assert opt.defaults["ns_dtype"] == "auto"
    assert f"ns_dtype: {want}" in repr(opt)
    # Without oneDNN torch multiplies bf16 in a scalar loop (a CPU without bf16 units): fp32.
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert Muon([_w(4, 4)]).param_groups[0]["ns_dtype"] == "fp32"


def test_auto_is_logged_with_its_reason(caplog):
    import optim._ns_dtype as nsd

    nsd._logged.clear()
    with caplog.at_level("INFO", logger="optim.muon"):
        choice = Muon([_w(4, 4)]).param_groups[0]["ns_dtype"]
    assert f"ns_dtype='auto' runs Newton-Schulz in {choice} on cpu" in caplog.text


def test_a_forced_ns_dtype_is_kept_per_group():
    opt = Muon(
        [{"params": [_w(4, 4)], "ns_dtype": "fp32"}, {"params": [_w(4, 4)]}], ns_dtype="bf16"
    )
    assert [g["ns_dtype"] for g in opt.param_groups] == ["fp32", "bf16"]
    assert "ns_dtype: fp32" in repr(opt)


def test_ns_dtype_set_to_auto_between_steps_is_resolved_at_the_step():
    p = _w(8, 4)
    opt = Muon([{"params": [p], "ns_dtype": "fp32"}])
    opt.param_groups[0]["ns_dtype"] = "auto"
    p.grad = torch.randn(8, 4)
    opt.step()
    assert opt.param_groups[0]["ns_dtype"] in ("bf16", "fp32")
    opt.param_groups[0]["ns_dtype"] = "fp16"
    with pytest.raises(ValueError, match=r"param group 0: ns_dtype must be one of"):
        opt.step()


def _other_than_auto() -> str:
    return "fp32" if Muon([_w(2, 2)]).param_groups[0]["ns_dtype"] == "bf16" else "bf16"


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_a_resumed_run_keeps_the_ns_dtype_it_trained_with(tmp_path):
    # Saved with the dtype 'auto' does NOT pick here; the resumed optimizer asks for 'auto'.
    trained = _other_than_auto()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    opt = Muon([{"params": list(model.parameters())[::2], "ns_dtype": trained}])
    _train(model, opt, 2, seed=1)
    with CheckpointManager(str(tmp_path / "run"), model=model, optimizer=opt) as mgr:
        mgr.save(2)
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    opt2 = Muon([{"params": list(model2.parameters())[::2]}])
    assert opt2.param_groups[0]["ns_dtype"] != trained
    with CheckpointManager(str(tmp_path / "run"), model=model2, optimizer=opt2) as mgr:
        assert mgr.load() == 2
    assert opt2.param_groups[0]["ns_dtype"] == trained
    # ... and computes in it: the next step is bitwise the uninterrupted run's.
    _train(model, opt, 1, seed=2)
    _train(model2, opt2, 1, seed=2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_state_dict_keeps_ns_dtype_and_an_old_state_dict_means_bf16():
    p = _w(8, 4)
    opt = Muon([{"params": [p], "ns_dtype": _other_than_auto()}])
    sd = opt.state_dict()
    fresh = Muon([{"params": [p]}])
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["ns_dtype"] == opt.param_groups[0]["ns_dtype"]
    del sd["param_groups"][0]["ns_dtype"]  # saved before the option existed: it ran in bf16
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["ns_dtype"] == "bf16"


def _ns_float64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """torch.optim.Muon's iteration, written out in float64: the reference."""
    x = g.double()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    a, b, c = COEFFS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def _gradient_like(rows, cols, gen):
    """A matrix whose singular values fall from 1 to 1e-4, as a gradient's do."""
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    return (u * torch.logspace(0, -4, k, dtype=torch.float64)) @ v.T


# Square, wide and tall (past GRAM_ASPECT, method "gram" takes the Gram iteration), a batch.
NS_SHAPES = [(96, 96), (48, 100), (200, 40), (3, 64, 256)]


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("shape", NS_SHAPES)
@pytest.mark.parametrize("spectrum", ["gaussian", "gradient-like"])
def test_fp32_newton_schulz_is_within_5e_5_of_float64(shape, spectrum, method):
    # Tolerance: the relative Frobenius error of the fp32 iteration against float64 is ~2e-6 on
    # Gaussian and ~5e-6 on gradient-like spectra (measured on these and larger shapes); 5e-5
    # leaves 10x. The bf16 iteration is ~1e-2 off: the bound tells the two apart.
    gen = torch.Generator().manual_seed(sum(shape))
    *batch, rows, cols = shape
    if spectrum == "gaussian":
        g = torch.randn(shape, generator=gen)
    else:
        g = torch.stack([_gradient_like(rows, cols, gen) for _ in range(batch[0] if batch else 1)])
        g = g.reshape(shape).float()
    ref = _ns_float64(g)
    out = zeropower_via_newtonschulz(g, dtype=torch.float32, method=method)
    assert out.dtype == torch.float32 and out.shape == g.shape
    assert _rel(out, ref) < 5e-5, _rel(out, ref)
    assert _rel(zeropower_via_newtonschulz(g, dtype=torch.bfloat16), ref) > 5e-5


def test_the_shapes_reach_both_fp32_iterations():
    wide = [uses_gram(*s[-2:], "gram") for s in NS_SHAPES]
    assert any(wide) and not all(wide)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def test_an_fp32_muon_step_is_the_float64_step_within_5e_5():
    gen = torch.Generator().manual_seed(7)
    shapes = [(64, 64), (32, 96), (96, 32)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    grads = [_gradient_like(*s, gen) for s in shapes]
    p0 = [p.detach().double().clone() for p in params]
    # A large lr: the update dwarfs the fp32 rounding of the param it is applied to.
    lr, wd, m = 0.5, 0.1, 0.95
    opt = Muon([{"params": params, "ns_dtype": "fp32", "lr": lr, "weight_decay": wd}])
    for p, gr in zip(params, grads):
        p.grad = gr.float()
    opt.step()
    for p, w0, gr in zip(params, p0, grads):
        upd = (1 - m) * gr + m * ((1 - m) * gr)  # Nesterov, from a zero momentum
        want = lr * 0.2 * math.sqrt(max(p.shape)) * _ns_float64(upd)
        assert _rel(w0 * (1 - lr * wd) - p.double(), want) < 5e-5


def test_autocast_leaves_newton_schulz_in_the_dtype_asked_for():
    # Under autocast the matmuls of an ns_dtype="fp32" iteration ran in bf16 (2e4x farther from
    # float64), and the standard one returned bf16.
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(16, 64, generator=gen)
    for method in ("standard", "gram"):
        plain = zeropower_via_newtonschulz(g, dtype=torch.float32, method=method)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = zeropower_via_newtonschulz(g, dtype=torch.float32, method=method)
        assert auto.dtype == torch.float32 and torch.equal(auto, plain), method
    stepped = []
    for autocast in (False, True):
        p = torch.nn.Parameter(torch.zeros(16, 64))
        opt = Muon([{"params": [p], "ns_dtype": "fp32"}])
        p.grad = g.clone()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            opt.step()
        stepped.append(p.detach().clone())
    assert torch.equal(*stepped)
