"""GPU: the CUDA code paths of Muon against torch.optim.Muon on the same device.

    python3 -m pytest tests/gpu/test_optim_gpu.py     (needs a CUDA device)

On CUDA the momentum update takes other kernels than on CPU: fused lerps, and for matrices of
at least ``_FOREACH_MAX_NUMEL`` elements a per-matrix lerp written straight into bfloat16.
The CPU suite cannot reach them, so this compares both against torch.optim.Muon here, with the
tolerance of tests/optim/test_optim_reference.py (one bf16 ulp of the update per step), and the fp32
Newton-Schulz (``ns_dtype="fp32"``) and the Gram iteration (``ns_method="gram"``) against a
float64 one on the GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# 1024 x 1024 and 2048 x 512 take the per-matrix path (>= 2^20 elements), the rest foreach.
SHAPES = [(1024, 1024), (2048, 512), (64, 128), (128, 64), (3, 5)]
STEPS = 5


def _adjusted(lr, shape, fn):
    a, b = shape
    return lr * (max(1.0, a / b) ** 0.5 if fn == "original" else 0.2 * max(a, b) ** 0.5)


@pytest.mark.parametrize("ns_method", ["standard", "gram"])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_cuda_muon_matches_torch_optim_muon(adjust_lr_fn, nesterov, ns_method):
    # (2048 x 512 takes the Gram iteration with "gram", in float16: on a CPU it stays within
    # 0.15 of this tolerance of torch's bf16 iteration.)
    import optim._muon_step as muon_step
    from optim import Muon, set_ns_compile

    assert any(a * b >= muon_step._FOREACH_MAX_NUMEL for a, b in SHAPES)
    assert any(a * b < muon_step._FOREACH_MAX_NUMEL for a, b in SHAPES)
    set_ns_compile(False)
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g).to(dev) for s in SHAPES]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    hp = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": nesterov}
    o1 = Muon(
        [{"params": ours, "ns_method": ns_method, **hp}],
        adjust_lr_fn=adjust_lr_fn,
        chunk_size=2,
        ns_dtype="bf16",
    )
    o2 = torch.optim.Muon(ref, adjust_lr_fn=adjust_lr_fn, **hp)
    for _ in range(STEPS):
        for a, b in zip(ours, ref):
            gr = torch.randn(a.shape, generator=g).to(dev)
            a.grad, b.grad = gr.clone(), gr.clone()
        o1.step()
        o2.step()
    for p0, a, b, shape in zip(init, ours, ref, SHAPES):
        atol = STEPS * _adjusted(0.02, shape, adjust_lr_fn) * 2**-7
        torch.testing.assert_close(a.data, b.data, atol=atol, rtol=0)
        assert not torch.equal(a.data, p0), "the step did not move the param"
    for a, b in zip(ours, ref):
        # Same kernels for the momentum as torch (fused lerp): the buffers agree to fp32 ulps.
        torch.testing.assert_close(
            o1.state[a]["momentum_buffer"], o2.state[b]["momentum_buffer"], atol=1e-6, rtol=1e-5
        )


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
def test_large_matrix_momentum_is_the_same_bits_on_any_row_shard(nesterov, dtype, ns_dtype):
    # The N-ranks == 1-process guarantee on CUDA for the per-matrix momentum path: uneven row
    # shards of a matrix, their state at odd element offsets of flat buffers (as the offload
    # pool and all_to_all receive buffers place them), give the bits of the full matrix. The
    # multi-rank suite reaches this path only with several GPUs; this checks it on one.
    from optim._muon_step import _large_update

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows, cols = 2048, 1024
    grad = torch.randn(rows, cols, device=dev, generator=g).to(dtype)
    buf0 = torch.randn(rows, cols, device=dev, generator=g).to(dtype)
    full_buf = buf0.clone()
    full_upd = _large_update(full_buf, grad, 0.95, nesterov, ns_dtype)
    assert full_upd.dtype == ns_dtype and full_upd.data_ptr() != full_buf.data_ptr()
    cuts = [0, 701, 1366, rows]
    for a, b in itertools.pairwise(cuts):
        n = (b - a) * cols
        sbuf = torch.empty(n + 3, device=dev, dtype=dtype)[3:].view(b - a, cols)
        sgrad = torch.empty(n + 1, device=dev, dtype=dtype)[1:].view(b - a, cols)
        sbuf.copy_(buf0[a:b])
        sgrad.copy_(grad[a:b])
        upd = _large_update(sbuf, sgrad, 0.95, nesterov, ns_dtype)
        assert torch.equal(sbuf, full_buf[a:b]), (a, b)
        assert torch.equal(upd, full_upd[a:b]), (a, b)


def test_auto_ns_dtype_is_bf16_on_a_gpu_with_bf16_tensor_cores():
    from optim import Muon

    want = "bf16" if torch.cuda.get_device_capability()[0] >= 8 else "fp32"
    w = torch.nn.Parameter(torch.zeros(4, 4, device="cuda"))
    assert Muon([w]).param_groups[0]["ns_dtype"] == want


@pytest.mark.parametrize("shape", [(1024, 1024), (512, 2048), (4, 256, 96)])
def test_cuda_fp32_newton_schulz_is_within_5e_5_of_float64(shape):
    # The bound of tests/optim/test_optim_ns_dtype.py. TF32 is off by default in torch (it would be
    # ~1e-3 off); the test keeps it off whatever the process set.
    from optim.newton_schulz import zeropower_via_newtonschulz

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        g = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        out = zeropower_via_newtonschulz(g, dtype=torch.float32)
        x = g.double()
        tall = x.size(-2) > x.size(-1)
        x = x.mT if tall else x
        x = x / x.norm(dim=(-2, -1), keepdim=True)
        for _ in range(5):
            gram = x @ x.mT
            x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
        ref = x.mT if tall else x
        assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-5
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _ns_float64(g: torch.Tensor) -> torch.Tensor:
    x = g.double()
    tall = x.size(-2) > x.size(-1)
    x = x.mT if tall else x
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    for _ in range(5):
        gram = x @ x.mT
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    return x.mT if tall else x


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("shape", [(1024, 3072), (4096, 1024), (8, 256, 1024)])
def test_cuda_gram_newton_schulz_is_as_close_to_float64_as_the_standard_iteration(shape):
    # The bound of tests/optim/test_optim_gram.py: the standard iteration's error in the same dtype
    # (bf16; the Gram one computes in float16), and 5e-5 in fp32 (TF32 kept off).
    from optim.newton_schulz import uses_gram, zeropower_via_newtonschulz

    assert uses_gram(*shape[-2:], "gram")
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        g = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        ref = _ns_float64(g)
        std = _rel(zeropower_via_newtonschulz(g, dtype=torch.bfloat16), ref)
        gram = zeropower_via_newtonschulz(g, dtype=torch.bfloat16, method="gram")
        assert gram.dtype == torch.bfloat16 and _rel(gram, ref) <= std, (_rel(gram, ref), std)
        gram32 = zeropower_via_newtonschulz(g, dtype=torch.float32, method="gram")
        assert _rel(gram32, ref) < 5e-5
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_auto_ns_method_on_a_gpu_is_standard_in_bf16_and_gram_in_fp32():
    """bf16's Gram iteration (in float16) was slower than the standard one on an H100's
    GPT-like set; fp32's stays Gram (docs/benchmarks.md)."""
    from optim import Muon

    w, v = (torch.nn.Parameter(torch.zeros(4, 4, device="cuda")) for _ in range(2))
    groups = [{"params": [w], "ns_dtype": "bf16"}, {"params": [v], "ns_dtype": "fp32"}]
    assert [g["ns_method"] for g in Muon(groups).param_groups] == ["standard", "gram"]
