"""Checkpoints between layouts: a step saved under one device mesh (HSDP 2x2, FSDP 4, TP then
FSDP 2x2, TP 2) loads under another, or in one process, and training goes on bitwise as if
uninterrupted, Muon's momentum and AdamW's moments included, with CPU offload on and an
asynchronous save; replicated shards are written once; the manifest records the layout.

The layouts are torch's own (``fully_shard``, ``parallelize_module``: ``tests/_meshes.py``),
the model's dims odd, so shards are uneven and some empty; gradients are set directly (each
rank the local shard of the same full gradient), as the seed offload test does. All 4-rank
cases run in one set of processes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests._dist import eight_ranks_reason, run_on_ranks
from tests.optim._meshes import Net, build, groups, shard_like

STEPS, SAVED = 4, 2
# (saved on, loaded on): every layout saved once and loaded once, none onto itself
CASES = (
    ("hsdp2x2", "fsdp4"),
    ("tp2xfsdp2", "hsdp2x2"),
    ("fsdp4", "tp2xfsdp2"),
    ("tp2", "tp2xfsdp2"),
)
KEYS = ("momentum_buffer", "moment1", "moment2", "step")


def _muon(model):
    from optim import Muon

    opt = Muon(groups(model), chunk_size=2, warmup_step=1)
    opt.turn_on_cpu_offload()
    return opt


def _full_grads() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    shapes = [(n, p.shape) for n, p in Net().named_parameters()]
    return [{n: torch.randn(s, generator=g) for n, s in shapes} for _ in range(STEPS)]


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _train(model, opt, layout, grads):
    """``grads`` (full) applied on ``layout`` (None: one process), one step each."""
    params = dict(model.named_parameters())
    for full in grads:
        local = shard_like(layout, full) if layout else full
        for n, p in params.items():
            g = local[n].clone()
            if isinstance(p, DTensor):
                g = DTensor.from_local(
                    g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
            p.grad = g
        opt.step()


def _reference(grads):
    """One process, uninterrupted: params and states after every step."""
    model = build(None)
    opt = _muon(model)
    _train(model, opt, None, grads)
    opt.turn_off_cpu_offload()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = {
        n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()
    }
    return params, states


def _differences(layout, model, opt, ref) -> list[str]:
    """What ``layout``'s ``model``/``opt`` hold that differs from the reference (bitwise)."""
    params_ref, states_ref = ref
    opt.turn_off_cpu_offload()
    bad = []
    params = dict(model.named_parameters())
    want = shard_like(layout, params_ref) if layout else params_ref
    for n, p in params.items():
        if not torch.equal(_local(p.detach()), want[n]):
            bad.append(f"param {n}")
    for key in KEYS:
        full = {n: states_ref[n].get(key, torch.zeros_like(params_ref[n])) for n in params}
        if key != "step":
            full = shard_like(layout, full) if layout else full
        for n, p in params.items():
            if key in states_ref[n] and not torch.equal(_local(opt.state[p][key]), full[n]):
                bad.append(f"state {n}.{key}")
    return bad


def body_between_layouts(rank, world_size, root, cases):
    from muon_ckpt import CheckpointManager
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    grads = _full_grads()
    ref = _reference(grads)
    out = {}
    for a, b in cases:
        url = os.path.join(root, f"{a}-to-{b}")
        model = build(a)
        opt = _muon(model)
        _train(model, opt, a, grads[:SAVED])
        # (replicas certified: TP's Replicate() and HSDP's replicas agree, no false alarm)
        kw = {"async_save": True, "certify_replicas": True}
        with CheckpointManager(url, model=model, optimizer=opt, **kw) as mgr:
            mgr.save(SAVED)
            mgr.wait()
            info = mgr.step_info()
        model2 = build(b)  # fresh: another init, no optimizer state
        with torch.no_grad():
            for p in model2.parameters():
                p.add_(1.0)
        opt2 = _muon(model2)
        with CheckpointManager(url, model=model2, optimizer=opt2) as mgr:
            assert mgr.load() == SAVED
        _train(model2, opt2, b, grads[SAVED:])
        out[(a, b)] = {"diff": _differences(b, model2, opt2, ref), "layout": info.layout}
    return out


@pytest.fixture(scope="module")
def between(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("layouts"))
    return root, run_on_ranks(body_between_layouts, 4, root, CASES, timeout=900)


@pytest.mark.parametrize(("saved", "loaded"), CASES, ids=lambda x: x)
def test_a_step_saved_on_one_layout_goes_on_bitwise_on_another(between, saved, loaded):
    _, results = between
    assert [r[(saved, loaded)]["diff"] for r in results] == [[]] * 4


@pytest.mark.parametrize(("saved", "loaded"), CASES, ids=lambda x: x)
def test_a_step_saved_on_a_layout_goes_on_bitwise_in_one_process(between, saved, loaded):
    from muon_ckpt import CheckpointManager

    root, _ = between
    grads = _full_grads()
    ref = _reference(grads)
    model = build(None)
    opt = _muon(model)
    with CheckpointManager(
        os.path.join(root, f"{saved}-to-{loaded}"), model=model, optimizer=opt
    ) as mgr:
        assert mgr.load() == SAVED
    _train(model, opt, None, grads[SAVED:])
    assert _differences(None, model, opt, ref) == []


def test_the_manifest_records_the_layout_and_inspect_shows_it(between, capsys):
    from muon_ckpt.cli import main

    root, results = between
    hsdp = results[0][("hsdp2x2", "fsdp4")]["layout"]
    assert hsdp["meshes"] == [{"shape": [2, 2], "dims": ["rep", "shard"]}]
    assert hsdp["params"]["blocks.0.up.weight"] == {"mesh": 0, "placements": ["R", "S(0)"]}
    tp = results[0][("tp2xfsdp2", "hsdp2x2")]["layout"]
    meshes = tp["meshes"]
    up, proj = tp["params"]["blocks.0.up.weight"], tp["params"]["proj.weight"]
    assert meshes[up["mesh"]] == {"shape": [2, 2], "dims": ["dp", "tp"]}
    assert up["placements"] == ["_S(0, 2)", "S(0)"]  # fully_shard over TP's rows
    assert meshes[proj["mesh"]] == {"shape": [2], "dims": ["dp"]}  # TP left it alone
    assert tp["params"]["blocks.0.down.bias"]["placements"] == ["S(0)", "R"]
    # TP 2 alone: the params TP leaves alone are plain tensors, not in the record
    only_tp = results[0][("tp2", "tp2xfsdp2")]["layout"]
    assert only_tp["meshes"] == [{"shape": [2], "dims": ["tp"]}]
    assert "proj.weight" not in only_tp["params"]
    assert main(["inspect", os.path.join(root, "hsdp2x2-to-fsdp4")]) == 0
    out = capsys.readouterr().out
    assert "layout: mesh 2x2 (rep, shard), placements (R, S(0)): blocks.0.down.bias, " in out
    assert main(["inspect", "--json", os.path.join(root, "hsdp2x2-to-fsdp4")]) == 0
    assert json.loads(capsys.readouterr().out)["layout"] == hsdp


@pytest.mark.parametrize("layout", ["hsdp2x2", "tp2"])
def test_replicated_shards_are_written_once(between, layout):
    """HSDP's replicas, TP's Replicate() placements and the plain tensors TP leaves on every
    rank: each stored item is written by one rank, so the bytes the save wrote are exactly
    those of the items its metadata names (a replica written twice would add its bytes)."""
    from muon_ckpt.load import CheckpointReader
    from muon_ckpt.store import open_storage, resolve

    root, _ = between
    url = next(os.path.join(root, f"{a}-to-{b}") for a, b in CASES if a == layout)
    r = resolve(open_storage(url), SAVED)
    md = CheckpointReader(r).metadata
    items = sum(info.length for info in md.storage_data.values())
    data = sum(f.size for name, f in r.manifest.files.items() if name != ".metadata")
    assert r.manifest.written_bytes - r.manifest.files[".metadata"].size == data == items
    # Every element of every tensor is stored once: the chunks tile it (no replica twice).
    for key, m in md.state_dict_metadata.items():
        if hasattr(m, "chunks"):
            assert sum(c.sizes.numel() for c in m.chunks) == m.size.numel(), key


def test_shard_boxes_are_where_fsdp2_puts_the_rows_and_agree_with_muon():
    """muon_ckpt's reading of the placements (its planners' chunks) and optim's (Muon's
    pieces) are one rule in two packages: both give torch.chunk's split of each TP shard
    (TP splits the rows first, FSDP2 then each TP shard), uneven and empty shards too;
    without a strided shard, torch's own."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    from muon_ckpt._shards import box
    from optim._mesh import piece

    def chunks(rows, k):
        step = -(-len(rows) // k) if rows else 1
        return [rows[i * step : (i + 1) * step] for i in range(k)]

    for dp, tp in ((2, 2), (3, 2), (4, 2), (3, 3)):
        pls = (_StridedShard(0, split_factor=tp), Shard(0))
        for n in range(0, 20):
            for t, tp_rows in enumerate(chunks(list(range(n)), tp)):
                for d, rows in enumerate(chunks(tp_rows, dp)):
                    offsets, sizes = box((n, 5), pls, (dp, tp), (d, t))
                    start, size = piece((n, 5), pls, (dp, tp), (d, t))
                    assert sizes == size == (len(rows), 5), (dp, tp, n, d, t)
                    assert offsets == ((rows[0], 0) if rows else (n, 0)), (dp, tp, n, d, t)
    for pls in itertools.product((Shard(0), Shard(1), Replicate()), repeat=2):
        for coord in itertools.product(range(3), range(2)):
            size, start = _compute_local_shape_and_global_offset((7, 5), (3, 2), list(coord), pls)
            assert box((7, 5), pls, (3, 2), coord) == (tuple(start), tuple(size)), (pls, coord)


def body_six_ranks(rank, world_size, url, saved_alone):
    """On dp 3 x tp 2: save (13 rows over tp 2 then dp 3: DCP's own chunks overlapped and the
    save failed), and load the step one process saved."""
    from muon_ckpt import CheckpointManager

    grads = _full_grads()
    ref = _reference(grads)
    model = build("tp2xfsdp3")
    opt = _muon(model)
    _train(model, opt, "tp2xfsdp3", grads[:SAVED])
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        mgr.save(SAVED)
    model2 = build("tp2xfsdp3")
    opt2 = _muon(model2)
    with CheckpointManager(saved_alone, model=model2, optimizer=opt2) as mgr:
        assert mgr.load() == SAVED
    _train(model2, opt2, "tp2xfsdp3", grads[SAVED:])
    return _differences("tp2xfsdp3", model2, opt2, ref)


@pytest.mark.skipif(eight_ranks_reason() is not None, reason=str(eight_ranks_reason()))
def test_six_ranks_tp_then_fsdp_over_three_saves_and_loads_bitwise(tmp_path):
    from muon_ckpt import CheckpointManager

    grads = _full_grads()
    ref = _reference(grads)
    model = build(None)
    opt = _muon(model)
    _train(model, opt, None, grads[:SAVED])
    alone = str(tmp_path / "alone")
    with CheckpointManager(alone, model=model, optimizer=opt) as mgr:
        mgr.save(SAVED)
    url = str(tmp_path / "six")
    results = run_on_ranks(body_six_ranks, 6, url, alone, timeout=900)
    assert results == [[]] * 6
    model = build(None)
    opt = _muon(model)
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        assert mgr.load() == SAVED
    _train(model, opt, None, grads[SAVED:])
    assert _differences(None, model, opt, ref) == []
