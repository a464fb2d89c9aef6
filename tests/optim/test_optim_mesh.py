"""Muon on the meshes FSDP2 and tensor parallelism make: every layout gives bitwise the params and
states of one process, offload on, off or toggled, and each matrix is orthogonalised on
exactly one rank of the whole mesh (replicas share the work).

The layouts are made with torch's own APIs (``fully_shard``, ``parallelize_module``;
``tests/optim/_meshes.py``); gradients are set directly, each rank taking the local shard of the
same full gradient as torch lays it out, as the seed offload test does. All 4-rank cases run
in one set of processes (process start-up dominates on 2 cores)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests._dist import eight_ranks_reason, run_on_ranks, run_script
from tests.optim._meshes import Net, build, groups, shard_like

STEPS = 3
MODES = ("off", "on", "toggled")
LAYOUTS_4 = ("fsdp4", "hsdp2x2", "tp2xfsdp2", "tp2", "hsdp2x1xtp2")
KEYS = ("momentum_buffer", "moment1", "moment2")


def _muon(model):
    from optim import Muon

    return Muon(groups(model), chunk_size=2, warmup_step=1)


def _full_grads() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    shapes = [(n, p.shape) for n, p in Net().named_parameters()]
    return [{n: torch.randn(s, generator=g) for n, s in shapes} for _ in range(STEPS)]


def _reference(grads):
    """One process: the params and states after the steps."""
    model = build(None)
    opt = _muon(model)
    params = dict(model.named_parameters())
    for step in grads:
        for n, p in params.items():
            p.grad = step[n].clone()
        opt.step()
    states = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}, states


def _grad_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if isinstance(p, DTensor):
        return DTensor.from_local(
            local.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )
    return local.clone()


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _run(layout, mode, grads, ref):
    """The steps on ``layout`` with offload ``mode``; what differs from one process."""
    params_ref, states_ref = ref
    model = build(layout)
    opt = _muon(model)
    params = dict(model.named_parameters())
    local_grads = [shard_like(layout, step) for step in grads]
    if mode == "on":
        opt.turn_on_cpu_offload()
    for s, step in enumerate(local_grads):
        if mode == "toggled":
            (opt.turn_on_cpu_offload if s % 2 == 0 else opt.turn_off_cpu_offload)()
        for n, p in params.items():
            p.grad = _grad_like(p, step[n])
        opt.step()
    opt.turn_off_cpu_offload()
    bad = []
    want = shard_like(layout, params_ref)
    for n, p in params.items():
        if not torch.equal(_local(p.detach()), want[n]):
            bad.append(f"param {n}")
    for key in KEYS:
        full = {n: states_ref[n].get(key, torch.zeros_like(params_ref[n])) for n in params}
        want = shard_like(layout, full)
        for n, p in params.items():
            if key in states_ref[n] and not torch.equal(_local(opt.state[p][key]), want[n]):
                bad.append(f"state {n}.{key}")
    return bad


def body_layouts(rank, world_size, layouts, modes):
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    grads = _full_grads()
    ref = _reference(grads)
    out = {}
    for layout in layouts:
        for mode in modes:
            out[(layout, mode)] = _run(layout, mode, grads, ref)
    out["ns_work"] = _ns_work("hsdp2x2", grads) if "hsdp2x2" in layouts else None
    return out


def _ns_work(layout, grads):
    """This rank's Newton-Schulz work in one step on ``layout``."""
    model = build(layout)
    opt = _muon(model)
    for n, p in model.named_parameters():
        p.grad = _grad_like(p, shard_like(layout, grads[0])[n])
    opt.step()
    return opt.ns_work()


@pytest.fixture(scope="module")
def four_ranks():
    return run_on_ranks(body_layouts, 4, LAYOUTS_4, MODES, timeout=600)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"offload-{m}")
@pytest.mark.parametrize("layout", LAYOUTS_4)
def test_every_layout_gives_bitwise_the_params_and_states_of_one_process(four_ranks, layout, mode):
    got = [res[(layout, mode)] for res in four_ranks]
    assert got == [[]] * 4, got


def test_under_hsdp_each_matrix_is_orthogonalised_on_exactly_one_rank_of_the_whole_mesh(
    four_ranks,
):
    from tests.optim._meshes import build as _build

    matrices = [n for n, p in _build(None).named_parameters() if p.ndim >= 2]
    work = [res["ns_work"] for res in four_ranks]
    done = [n for w in work for n in w.params]
    assert sorted(done) == sorted(matrices), [w.params for w in work]
    assert sum(w.matrices for w in work) == len(matrices)
    # Spread over the 4 ranks, replicas included: not 2 shard groups that each do it all.
    assert all(w.matrices > 0 and w.flops > 0 for w in work), work
    total = sum(w.flops for w in work)
    assert max(w.flops for w in work) < total / 2, [w.flops for w in work]


@pytest.mark.skipif(eight_ranks_reason() is not None, reason=str(eight_ranks_reason()))
def test_eight_ranks_layouts_give_bitwise_the_params_of_one_process():
    # tp 2 x dp 4: the 9-row column-parallel weights are where torch's left-to-right reading of
    # _StridedShard would misplace rows; FSDP2's order is what Muon reads.
    layouts = ("tp2xfsdp4", "hsdp2x4")
    results = run_on_ranks(body_layouts, 8, layouts, ("off", "on"), timeout=900)
    for res in results:
        assert all(v == [] for k, v in res.items() if k != "ns_work"), res


@pytest.mark.parametrize("layout", ["hsdp2x2", "tp2xfsdp2"])
def test_a_training_script_with_torch_apis_steps_bitwise_as_one_process(tmp_path, layout):
    """torchrun, 4 ranks: forward and backward through fully_shard on a 2-D mesh (or
    parallelize_module then fully_shard), Muon with offload on. One process given the same
    full gradients ends with bitwise the params every rank holds (each rank's gather of its
    replica, so replicas are checked too)."""
    four = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    job = ["-m", "tests.optim._mesh_train_job", layout, str(tmp_path), str(STEPS)]
    r = run_script([*four, *job], timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    runs = [torch.load(tmp_path / f"rank{k}.pt") for k in range(4)]
    from tests.optim._mesh_train_job import DIMS

    model = build(None, DIMS)
    opt = _muon(model)
    params = dict(model.named_parameters())
    for n, p in params.items():
        assert torch.equal(runs[0]["init"][n], p.detach()), n  # (the same init)
    for step in runs[0]["grads"]:
        for n, p in params.items():
            p.grad = step[n].clone()
        opt.step()
    for k, run in enumerate(runs):
        for n, p in params.items():
            assert torch.equal(run["params"][n], p.detach()), (k, n)
        assert not torch.equal(run["params"]["head.weight"], runs[0]["init"]["head.weight"])


def _chunks(rows: list[int], k: int) -> list[list[int]]:
    """``torch.chunk``'s split into ``k`` (ceil-sized, the missing ones empty), as FSDP2 and
    DTensor's ``Shard`` split a dim."""
    step = -(-len(rows) // k) if rows else 1
    return [rows[i * step : (i + 1) * step] for i in range(k)]


@pytest.mark.parametrize(("dp", "tp"), [(2, 2), (3, 2), (4, 2), (3, 3), (2, 4)])
def test_each_rank_piece_is_where_tp_then_fully_shard_put_its_rows(dp, tp):
    """TP splits the rows first, FSDP2 then splits each TP shard: (_StridedShard(0, tp),
    Shard(0)) on (dp, tp), and under HSDP (Replicate(), _StridedShard(0, tp), Shard(0))."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from optim._mesh import piece

    two = (_StridedShard(0, split_factor=tp), Shard(0))
    three = (Replicate(), *two)
    for n in range(0, 30):
        for t, tp_rows in enumerate(_chunks(list(range(n)), tp)):
            for d, rows in enumerate(_chunks(tp_rows, dp)):
                for start, size in (
                    piece((n, 5), two, (dp, tp), (d, t)),
                    piece((n, 5), three, (2, dp, tp), (1, d, t)),
                ):
                    assert size == (len(rows), 5), (n, d, t, size, rows)
                    assert not rows or start == (rows[0], 0), (n, d, t, start, rows)


def body_refusals(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    from optim import Muon

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    out = {}
    w_a = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh["a"], [Shard(0)]))
    w_b = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh["b"], [Shard(0)]))
    try:
        Muon([w_a, w_b])
    except ValueError as e:
        out["two meshes"] = str(e)
    partial = DTensor.from_local(torch.ones(4, 4), mesh, [Shard(0), Partial()])
    try:
        Muon([{"params": [torch.nn.Parameter(partial)], "names": ["w"]}])
    except ValueError as e:
        out["partial"] = str(e)
    from torch.distributed.tensor.placement_types import _StridedShard

    odd = DTensor.from_local(torch.ones(2, 4), mesh, [_StridedShard(0, split_factor=3), Shard(0)])
    try:
        Muon([{"params": [torch.nn.Parameter(odd)], "names": ["v"]}])
    except ValueError as e:
        out["split factor"] = str(e)
    # 10 rows over 4 ranks are 3/3/3/1; a local shard of 3 rows on every rank is not that.
    flat = init_device_mesh("cpu", (4,))
    wrong = DTensor.from_local(torch.ones(3, 4), flat, [Shard(0)], shape=(10, 4), stride=(4, 1))
    w = torch.nn.Parameter(wrong)
    w.grad = torch.ones_like(w)
    try:
        Muon([w]).step()
    except RuntimeError as e:
        out["wrong shard"] = str(e)
    # Rank 0 was given one matrix more than the others.
    ws = [DTensor.from_local(torch.ones(1, 4), flat, [Shard(0)]) for _ in range(2 - (rank > 0))]
    ws = [torch.nn.Parameter(v) for v in ws]
    for v in ws:
        v.grad = torch.ones_like(v)
    try:
        Muon(ws).step()
    except RuntimeError as e:
        out["count"] = str(e)
    return out


def test_what_muon_cannot_read_is_refused_with_the_reason_on_every_rank():
    results = run_on_ranks(body_refusals, 4, timeout=120)
    for res in results:
        assert "is not a slice of the second" in res["two meshes"], res
        assert "put the params on one mesh" in res["two meshes"], res
        assert res["partial"].startswith(
            "param group 0: param 'w' has placement Partial(sum) on mesh dim 1; Muon takes "
            "Shard(dim), _StridedShard"
        ), res
        assert res["split factor"] == (
            "param group 0: param 'v' has placements (_StridedShard(dim=0, sf=3), "
            "Shard(dim=0)): _StridedShard(dim=0, sf=3) on mesh dim 0 has split_factor 3, but "
            "the shards of dim 0 applied before it (Shard dims, then strided ones right to "
            "left) number 2; Muon reads the layout fully_shard makes over tensor parallelism "
            "only"
        ), res
        assert (
            "a Muon param of shape (10, 4) with placements (Shard(dim=0),) on DeviceMesh"
        ) in res["wrong shard"], res
        assert (
            "rank 3 (mesh coordinate (3,)) holds a local shard of shape (3, 4), but its "
            "placements give (1, 4)"
        ) in res["wrong shard"], res
        assert res["count"] == (
            "the ranks of DeviceMesh((4,), 'cpu', stride=(1,)) hold different numbers of "
            "split Muon matrices: [2, 1, 1, 1] on ranks 0..3; every rank must build Muon "
            "with the same params, in the same order"
        ), res


def test_each_rank_piece_of_plain_shards_is_torchs_own():
    """Without strided shards torch's left-to-right reading holds: every combination of
    Shard(0), Shard(1) and Replicate() over 2-D and 3-D meshes gives torch's local shape and
    offset, uneven and empty shards included."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from optim._mesh import piece

    for mesh_shape in ((2, 2), (3, 2), (2, 1, 3)):
        for pls in itertools.product((Shard(0), Shard(1), Replicate()), repeat=len(mesh_shape)):
            for gshape in ((10, 7), (2, 5), (1, 1), (0, 3)):
                for coord in itertools.product(*(range(n) for n in mesh_shape)):
                    size, start = _compute_local_shape_and_global_offset(
                        gshape, mesh_shape, list(coord), pls
                    )
                    got_start, got_size = piece(gshape, pls, mesh_shape, coord)
                    assert got_size == tuple(size), (mesh_shape, pls, gshape, coord)
                    if all(size):
                        assert got_start == tuple(start), (mesh_shape, pls, gshape, coord)


def body_empty_tp_shard(rank, world_size):
    """One matrix with 1 column, row-parallel over tp 2 then fully_shard over dp 2: the ranks
    at tp 1 hold an empty local shard, (0, 0) where the placements give (rows, 0)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from optim import Muon

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def laid(values):
        m = nn.Sequential(nn.Linear(1, 6, bias=False))
        with torch.no_grad():
            m[0].weight.copy_(values)
        parallelize_module(m, mesh["tp"], {"0": RowwiseParallel()})
        fully_shard(m, mesh=mesh["dp"])
        return m[0].weight

    g = torch.Generator().manual_seed(3)
    w0, grads = torch.randn(6, 1, generator=g), [torch.randn(6, 1, generator=g) for _ in range(2)]
    ref = nn.Parameter(w0.clone())
    ref_opt = Muon([ref], lr=0.02)
    p = laid(w0)
    opt = Muon([p], lr=0.02)
    for grad in grads:
        ref.grad = grad.clone()
        ref_opt.step()
        p.grad = _grad_like(p, laid(grad).to_local())
        opt.step()
    return tuple(p.to_local().shape), torch.equal(p.to_local(), laid(ref.detach()).to_local())


def test_an_empty_tensor_parallel_shard_under_fully_shard_steps_bitwise_as_one_process():
    got = run_on_ranks(body_empty_tp_shard, 4, timeout=300)
    assert [shape for shape, _ in got] == [(3, 1), (0, 0), (3, 1), (0, 0)], got
    assert all(same for _, same in got), got
