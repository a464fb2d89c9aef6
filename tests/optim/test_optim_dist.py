"""N ranks give bitwise the parameters and states of a single-process Muon on the full tensors."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from optim import Muon
from tests._dist import dist_device, eight_ranks_reason, run_on_ranks

# (name, shape, placement) — a mix of shapes: wide, tall, tiny, 4-D conv-like, uneven shards
# (10 rows on 3 ranks: 4/4/2; 2 rows on 4 ranks: 1/1/0/0), a Shard(1) and a Replicate matrix.
MUON_SPECS = [
    ("w_wide", (64, 128), Shard(0)),
    ("w_tall", (128, 64), Shard(0)),
    ("w_tiny", (3, 5), Shard(0)),
    ("conv", (8, 3, 3, 3), Shard(0)),
    ("w_uneven", (10, 7), Shard(0)),
    ("w_two_rows", (2, 6), Shard(0)),
    ("w_cols", (12, 10), Shard(1)),
    ("w_repl", (16, 8), Replicate()),
]
ADAMW_SPECS = [("bias", (128,), Shard(0)), ("norm", (5,), Shard(0)), ("scale", (3,), Replicate())]


def _make(
    params_full,
    mesh,
    placements,
    names,
    adamw_full,
    adamw_pl,
    adamw_names,
    nesterov=True,
    ns_dtypes=("auto",),
    ns_method="auto",
    **kw,
):
    from optim.muon import Muon

    if mesh is None:
        mp = [torch.nn.Parameter(t.clone()) for t in params_full]
        ap = [torch.nn.Parameter(t.clone()) for t in adamw_full]
    else:
        mp = [
            torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [pl]))
            for t, pl in zip(params_full, placements)
        ]
        ap = [
            torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [pl]))
            for t, pl in zip(adamw_full, adamw_pl)
        ]
    hp = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95, "nesterov": nesterov}
    # One Muon group per ns_dtype, matrix i taking ns_dtypes[i % len(ns_dtypes)].
    groups = []
    for dt in dict.fromkeys(ns_dtypes):
        idx = [i for i in range(len(mp)) if ns_dtypes[i % len(ns_dtypes)] == dt]
        names_dt = [names[i] for i in idx]
        groups.append(
            {
                "params": [mp[i] for i in idx],
                "names": names_dt,
                "ns_dtype": dt,
                "ns_method": ns_method,
                **hp,
            }
        )
    groups.append(
        {"params": ap, "names": adamw_names, "use_muon": False, "lr": 1e-3, "weight_decay": 0.1}
    )
    return Muon(groups, **kw), mp, ap


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def body_n_ranks_equal_single_process(
    rank,
    world_size,
    chunk_size,
    warmup_step,
    offload,
    foreach_max=None,
    nesterov=True,
    ns_dtypes=("auto",),
    ns_method="auto",
):
    from torch.distributed.device_mesh import init_device_mesh

    import optim._muon_step as muon_step
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    if foreach_max is not None:
        # On CUDA, matrices of at least this many elements take the one-by-one momentum path
        # (lerp straight into bf16); smaller ones the foreach path. CPU has one path only.
        muon_step._FOREACH_MAX_NUMEL = foreach_max
    dev = dist_device()
    mesh = init_device_mesh(dev.type, (world_size,))
    g = torch.Generator().manual_seed(1234)
    mfull = [torch.randn(s, generator=g).to(dev) for _, s, _ in MUON_SPECS]
    afull = [torch.randn(s, generator=g).to(dev) for _, s, _ in ADAMW_SPECS]
    grads = [
        (
            [torch.randn(s, generator=g).to(dev) for _, s, _ in MUON_SPECS],
            [torch.randn(s, generator=g).to(dev) for _, s, _ in ADAMW_SPECS],
        )
        for _ in range(5)
    ]
    mnames = [n for n, _, _ in MUON_SPECS]
    anames = [n for n, _, _ in ADAMW_SPECS]
    mpl = [p for _, _, p in MUON_SPECS]
    apl = [p for _, _, p in ADAMW_SPECS]
    kw = {
        "chunk_size": chunk_size,
        "warmup_step": warmup_step,
        "nesterov": nesterov,
        "ns_dtypes": ns_dtypes,
        "ns_method": ns_method,
    }
    ref, rmp, rap = _make(mfull, None, None, mnames, afull, None, anames, **kw)
    opt, dmp, dap = _make(mfull, mesh, mpl, mnames, afull, apl, anames, **kw)
    if len(set(ns_dtypes)) > 1:  # some chunk carries bf16 and fp32 matrices: it travels as fp32
        chunks = opt._get_plan().chunks
        assert any(len({it.ns_dtype for it in c if it.exchanged}) > 1 for c in chunks)
    if ns_method == "gram":  # some matrices take the Gram iteration, some not
        assert len({it.gram for it in opt._get_plan().items}) == 2
    if offload:
        opt.turn_on_cpu_offload()
    for gm, ga in grads:
        for p, gr in zip(rmp, gm):
            p.grad = gr.clone()
        for p, gr in zip(rap, ga):
            p.grad = gr.clone()
        for p, gr, pl in zip(dmp, gm, mpl):
            p.grad = distribute_tensor(gr.clone(), mesh, [pl])
        for p, gr, pl in zip(dap, ga, apl):
            p.grad = distribute_tensor(gr.clone(), mesh, [pl])
        ref.step()
        opt.step()
    if offload:
        opt.turn_off_cpu_offload()
    mismatches = []
    for name, a, b in zip(mnames + anames, rmp + rap, dmp + dap):
        if not torch.equal(_full(b.data), a.data):
            mismatches.append(f"param {name}: max diff {(_full(b.data) - a.data).abs().max()}")
        for key, val in ref.state[a].items():
            other = _full(opt.state[b][key])
            if not torch.equal(other, val):
                mismatches.append(f"state {name}.{key}")
    return mismatches


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_n_ranks_bitwise_equal_single_process(world_size):
    results = run_on_ranks(body_n_ranks_equal_single_process, world_size, 2, 1, False)
    assert results == [[]] * world_size, results


@pytest.mark.skipif(eight_ranks_reason() is not None, reason=str(eight_ranks_reason()))
@pytest.mark.parametrize("offload", [False, True])
def test_eight_ranks_bitwise_equal_single_process(offload):
    # Shards of 5 rows on 8 ranks: three ranks hold empty shards of some matrices.
    results = run_on_ranks(body_n_ranks_equal_single_process, 8, 2, 1, offload, timeout=600)
    assert results == [[]] * 8, results


def test_more_ranks_than_params_and_no_pipelining():
    # chunk_size=1, warmup_step=0 on 4 ranks: most chunks leave ranks without work.
    results = run_on_ranks(body_n_ranks_equal_single_process, 4, 1, 0, False)
    assert results == [[]] * 4, results


def test_n_ranks_with_offload_bitwise_equal_single_process():
    results = run_on_ranks(body_n_ranks_equal_single_process, 3, 3, 2, True)
    assert results == [[]] * 3, results


def test_n_ranks_with_offload_pipelined_one_param_a_chunk_bitwise_equal_single_process():
    # chunk_size=1: every Muon matrix and every AdamW param is a bucket of its own, so the
    # offload pipeline moves states in and out around every chunk, the AdamW ones included.
    results = run_on_ranks(body_n_ranks_equal_single_process, 2, 1, 1, True)
    assert results == [[]] * 2, results


@pytest.mark.parametrize(
    ("world_size", "offload", "ns_dtypes"),
    [(2, False, ("fp32",)), (3, True, ("fp32", "bf16"))],
    ids=["fp32", "fp32-and-bf16-with-offload"],
)
def test_n_ranks_bitwise_equal_single_process_in_each_ns_dtype(world_size, offload, ns_dtypes):
    # (The cases above run 'auto': bf16 on a CPU with bf16 units, fp32 without.)
    results = run_on_ranks(
        body_n_ranks_equal_single_process, world_size, 3, 2, offload, None, True, ns_dtypes
    )
    assert results == [[]] * world_size, results


@pytest.mark.parametrize("offload", [False, True], ids=["offload-off", "offload-on"])
def test_n_ranks_bitwise_equal_single_process_with_the_gram_iteration_forced(offload):
    # bf16 and fp32 groups both forced to 'gram' (bf16 computes it in float16), on the CPU.
    results = run_on_ranks(
        body_n_ranks_equal_single_process, 3, 2, 1, offload, None, True, ("bf16", "fp32"), "gram"
    )
    assert results == [[]] * 3, results


def body_ranks_disagree_on_ns_dtype(rank, world_size, key="ns_dtype", values=("bf16", "fp32")):
    from torch.distributed.device_mesh import init_device_mesh

    dev = dist_device()
    mesh = init_device_mesh(dev.type, (world_size,))
    w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4).to(dev), mesh, [Shard(0)]))
    w.grad = distribute_tensor(torch.randn(8, 4).to(dev), mesh, [Shard(0)])
    try:
        Muon([{"params": [w], "ns_dtype": "fp32", key: values[rank]}]).step()
    except RuntimeError as e:
        return str(e)
    return None


def test_ranks_that_disagree_on_ns_dtype_are_refused_on_every_rank():
    msgs = run_on_ranks(body_ranks_disagree_on_ns_dtype, 2, timeout=60)
    want = (
        "the ranks disagree on the Newton-Schulz dtype of a param of shape (8, 4): ns_dtype "
        "['bf16', 'fp32'] on ranks 0..1 ('auto' picks per host: bf16 where it has fast bf16 "
        "matrix units); pass the same ns_dtype='bf16' or 'fp32' on every rank"
    )
    assert msgs == [want, want]


def test_ranks_that_disagree_on_ns_method_are_refused_on_every_rank():
    msgs = run_on_ranks(
        body_ranks_disagree_on_ns_dtype, 2, "ns_method", ("gram", "standard"), timeout=60
    )
    want = (
        "the ranks disagree on the Newton-Schulz method of a param of shape (8, 4): ns_method "
        "['gram', 'standard'] on ranks 0..1 ('auto' picks per device and ns_dtype); pass the "
        "same ns_method='gram' or 'standard' on every rank"
    )
    assert msgs == [want, want]


@pytest.mark.parametrize("nesterov", [True, False])
def test_large_matrix_momentum_path_bitwise_equal_single_process(nesterov):
    # 64 x 128 and 128 x 64 (8192 elements) above the threshold, the rest below: both momentum
    # paths in one step, each matrix on the same path on 3 ranks as in one process.
    results = run_on_ranks(body_n_ranks_equal_single_process, 3, 2, 1, False, 4096, nesterov)
    assert results == [[]] * 3, results


def body_owner_balance(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    import optim._plan as plan_mod
    from optim._plan import _ns_cost
    from optim.muon import Muon

    plan_mod.BATCH_COST_LIMIT = 0.0  # one matrix per unit: test the owner assignment alone
    dev = dist_device()
    mesh = init_device_mesh(dev.type, (world_size,))
    shapes = [(128, 128)] * 8 + [(256, 256)] * 4
    ps = [
        torch.nn.Parameter(distribute_tensor(torch.zeros(s, device=dev), mesh, [Shard(0)]))
        for s in shapes
    ]
    opt = Muon([{"params": ps}], chunk_size=4)
    plan = opt._get_plan()
    loads = [0.0] * world_size
    for it in plan.items:
        loads[it.owner] += _ns_cost(it.gshape)
    chunks = [(len(c), len({it.owner for it in c})) for c in plan.chunks]
    return loads, chunks


def test_owner_assignment_balances_newton_schulz_cost():
    loads, chunks = run_on_ranks(body_owner_balance, 4)[0]
    # A perfect split exists (one 256^2 and two 128^2 per rank) and LPT must find it.
    assert max(loads) == min(loads), loads
    # Chunk sizes ramp 1, 2, 4, 4 (chunk_size=4), and interleaving spreads each chunk over as
    # many owners as it has matrices.
    assert [n for n, _ in chunks] == [1, 2, 4, 4, 1], chunks
    assert all(owners == n for n, owners in chunks), chunks


def test_small_same_shape_matrices_batch_and_large_ones_stay_alone():
    from optim._plan import build_plan
    from optim.muon import Muon

    def meta(*shape, dtype=torch.float32):
        return torch.nn.Parameter(torch.empty(*shape, device="meta", dtype=dtype))

    small = [meta(64, 64) for _ in range(40)]
    big = [meta(2048, 2048) for _ in range(3)]
    half = [meta(64, 64, dtype=torch.bfloat16) for _ in range(2)]
    opt = Muon([{"params": small + big + half}], chunk_size=4)
    plan = build_plan(opt.param_groups, opt.chunk_size)
    units: dict[int, list] = {}
    for it in plan.items:
        units.setdefault(it.unit, []).append(it)
    sizes = sorted(len(u) for u in units.values())
    # 40 small fp32 -> 32 (MAX_BATCH) + 8; each 2048^2 alone (its cost reaches the limit);
    # bf16 matrices never share a batch with fp32 ones.
    assert sizes == [1, 1, 1, 2, 8, 32], sizes
    for u in units.values():
        assert len({(it.param.shape, it.param.dtype) for it in u}) == 1
    # A chunk never splits a unit, so a 32-matrix unit makes a chunk larger than chunk_size.
    for it in plan.items:
        assert all(o.chunk == it.chunk for o in units[it.unit])


def body_replicated_params_with_partial_grads(rank, world_size):
    """Replicated DTensor params under data parallelism through DTensor: their grads are
    ``Partial(sum)``; the Muon and the AdamW groups both reduce them before the update."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = dist_device()
    mesh = init_device_mesh(dev.type, (world_size,))
    torch.manual_seed(0)
    w0, b0, x0 = torch.randn(4, 4), torch.randn(4), torch.randn(6, 4)
    w = torch.nn.Parameter(distribute_tensor(w0.clone().to(dev), mesh, [Replicate()]))
    b = torch.nn.Parameter(distribute_tensor(b0.clone().to(dev), mesh, [Replicate()]))
    x = distribute_tensor(x0.to(dev), mesh, [Shard(0)])
    (x @ w + b).pow(2).sum().backward()
    partial = [type(p.grad.placements[0]).__name__ for p in (w, b)]
    grads = [p.grad.to_local().cpu().clone() for p in (w, b)]  # this rank's partial sums
    opt = Muon([{"params": [w], "lr": 0.02}, {"params": [b], "use_muon": False, "lr": 0.1}])
    opt.step()
    return partial, grads, w.to_local().cpu(), b.to_local().cpu(), w0, b0


def test_replicated_params_with_partial_grads_match_one_process():
    """The promise: N ranks give the one-process result for the same gradient. The one
    process takes the sum of the ranks' partial gradients (on 2 ranks a + b, which is the
    all-reduce's sum whatever its order: addition is commutative), not a backward over the
    whole batch, whose summation order depends on the host's threads and vector width."""
    results = run_on_ranks(body_replicated_params_with_partial_grads, 2)
    partial, _, _, _, w0, b0 = results[0]
    assert partial == ["Partial", "Partial"]
    w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    (gw0, gb0), (gw1, gb1) = results[0][1], results[1][1]
    w.grad, b.grad = gw0 + gw1, gb0 + gb1
    Muon([{"params": [w], "lr": 0.02}, {"params": [b], "use_muon": False, "lr": 0.1}]).step()
    for _, _, w_local, b_local, *_ in results:  # every rank's replica: the one-process result
        assert torch.equal(w_local, w.data) and torch.equal(b_local, b.data)


def body_partial_grad_of_a_shard_empty_on_one_rank(rank, world_size):
    """A 2-element bias sharded over 3 ranks (the last one's shard empty) with a Partial grad
    (a data-parallel batch through DTensor): the reduction is a collective every rank makes,
    empty shard or not (a rank that skipped it left the others waiting)."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = dist_device()
    mesh = init_device_mesh(dev.type, (world_size,))
    torch.manual_seed(0)
    b0, x0 = torch.randn(2), torch.randn(6, 2)
    b = torch.nn.Parameter(distribute_tensor(b0.clone().to(dev), mesh, [Shard(0)]))
    x = distribute_tensor(x0.to(dev), mesh, [Shard(0)])
    (x + b).pow(2).sum().backward()
    partial = type(b.grad.placements[0]).__name__
    Muon([{"params": [b], "use_muon": False, "lr": 0.1}]).step()
    return partial, b.full_tensor().cpu(), b0, x0


def test_partial_grad_of_a_shard_empty_on_one_rank_steps_on_every_rank():
    results = run_on_ranks(body_partial_grad_of_a_shard_empty_on_one_rank, 3, timeout=60)
    partial, _, b0, x0 = results[0]
    assert partial == "Partial"
    b = torch.nn.Parameter(b0.clone())
    (x0 + b).pow(2).sum().backward()
    Muon([{"params": [b], "use_muon": False, "lr": 0.1}]).step()
    assert all(torch.equal(full, b.data) for _, full, *_ in results)


def body_grad_on_some_ranks_only(rank, world_size, use_muon):
    """A replicated param that only rank 0's data reaches (a data-dependent branch): it has a
    grad there and none on rank 1. Its reduction would pair with another param's on the other
    rank, so the step refuses it on every rank, naming it."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = dist_device()
    mesh = init_device_mesh(dev.type, (world_size,))
    torch.manual_seed(0)
    shape = (4, 4) if use_muon else (4,)
    a, b = (
        torch.nn.Parameter(distribute_tensor(torch.randn(shape).to(dev), mesh, [Replicate()]))
        for _ in range(2)
    )
    x = distribute_tensor(torch.randn(6, 4).to(dev), mesh, [Shard(0)])
    out = ((x @ b) if use_muon else (x * b)).sum()
    if rank == 0:
        out = out + ((x @ a) if use_muon else (x * a)).sum()
    out.backward()
    try:
        Muon([{"params": [a, b], "use_muon": use_muon, "lr": 0.1}]).step()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("use_muon", [True, False], ids=["muon", "adamw"])
def test_a_grad_on_some_ranks_only_is_refused_on_every_rank(use_muon):
    msgs = run_on_ranks(body_grad_on_some_ranks_only, 2, use_muon, timeout=60)
    kind = "a Muon param of shape (4, 4)" if use_muon else "an AdamW param of shape (4,)"
    for m in msgs:
        assert (
            m == f"{kind} has a grad on 1 of 2 ranks; every rank must have a grad for it, or none"
        )
