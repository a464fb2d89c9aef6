"""import_optimizer_state from each source kind, in one process; the report; dry run; offload."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from muon_ckpt import CheckpointManager, ImportReport, import_optimizer_state
from muon_ckpt.interop._safetensors import write_safetensors
from tests._ckpt import TinyNet, is_matrix, make_muon, train

MATRICES = ["fc1.weight", "fc2.weight"]
OTHERS = ["emb.weight", "fc1.bias", "norm.weight", "norm.bias"]


def _adamw_run(steps: int = 3) -> tuple[TinyNet, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, opt, steps)
    return model, opt


def _fresh() -> tuple[TinyNet, object]:
    torch.manual_seed(1)
    model = TinyNet()
    return model, make_muon(model)


def _state(model: torch.nn.Module, opt: object, fqn: str) -> dict[str, torch.Tensor]:
    return opt.state[dict(model.named_parameters())[fqn]]


def _assert_adamw_imported(model, opt, src_model, src_opt, fqns) -> None:
    for fqn in fqns:
        got = _state(model, opt, fqn)
        want = src_opt.state[dict(src_model.named_parameters())[fqn]]
        assert torch.equal(got["moment1"], want["exp_avg"]), fqn
        assert torch.equal(got["moment2"], want["exp_avg_sq"]), fqn
        assert got["step"].item() == want["step"].item() == 3.0
        assert got["step"].dtype == torch.float32


def test_import_from_torch_adamw_file_fills_adamw_groups_and_reports(tmp_path):
    src_model, src_opt = _adamw_run()
    path = tmp_path / "adamw.pt"
    torch.save(src_opt.state_dict(), path)
    model, opt = _fresh()
    report = import_optimizer_state(opt, path, model=model)
    assert isinstance(report, ImportReport)
    assert "torch.optim.AdamW" in report.source
    _assert_adamw_imported(model, opt, src_model, src_opt, OTHERS)
    assert sorted(report.imported) == sorted(OTHERS)
    assert report.imported["emb.weight"] == {
        "moment1": "state.emb.weight.exp_avg",
        "moment2": "state.emb.weight.exp_avg_sq",
        "step": "state.emb.weight.step",
    }
    # Matrices are Muon params: Adam's moments are not momentum unless asked for.
    assert sorted(report.fresh) == sorted(MATRICES)
    assert report.unused == sorted(
        f"state.{f}.{k}" for f in MATRICES for k in ("exp_avg", "exp_avg_sq", "step")
    )
    assert any("adam_into_muon=True" in h for h in report.hints)
    assert report.casts == {}
    for fqn in MATRICES:
        assert torch.count_nonzero(_state(model, opt, fqn)["momentum_buffer"]) == 0
    text = str(report)
    assert "4 params got state, 2 left fresh, 6 source keys unused" in text
    assert "left fresh  fc1.weight" in text


def test_adam_into_muon_uses_exp_avg_as_momentum(tmp_path):
    src_model, src_opt = _adamw_run()
    torch.save(src_opt.state_dict(), tmp_path / "adamw.pt")
    model, opt = _fresh()
    report = import_optimizer_state(opt, tmp_path / "adamw.pt", model=model, adam_into_muon=True)
    assert report.fresh == []
    for fqn in MATRICES:
        want = src_opt.state[dict(src_model.named_parameters())[fqn]]["exp_avg"]
        assert torch.equal(_state(model, opt, fqn)["momentum_buffer"], want)
        assert report.imported[fqn] == {"momentum_buffer": f"state.{fqn}.exp_avg"}
    assert report.unused == sorted(
        f"state.{f}.{k}" for f in MATRICES for k in ("exp_avg_sq", "step")
    )


def test_import_from_torch_muon_file_with_names_list(tmp_path):
    torch.manual_seed(0)
    src = TinyNet()
    mats = [(n, p) for n, p in src.named_parameters() if is_matrix(n, p)]
    src_opt = torch.optim.Muon([p for _, p in mats], lr=0.02)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        src(torch.randint(0, 11, (4, 5), generator=g)).square().mean().backward()
        src_opt.step()
        src_opt.zero_grad()
    torch.save(src_opt.state_dict(), tmp_path / "muon.pt")
    model, opt = _fresh()
    # Positional ids: without model=/names= they cannot be mapped.
    with pytest.raises(Exception, match=r"pass model= .* or names="):
        import_optimizer_state(opt, tmp_path / "muon.pt")
    with pytest.raises(Exception, match="has 2 params but the names list gives 1 names"):
        import_optimizer_state(opt, tmp_path / "muon.pt", names=["fc1.weight"])
    report = import_optimizer_state(opt, tmp_path / "muon.pt", names=[n for n, _ in mats])
    assert "torch.optim.Muon" in report.source
    assert sorted(report.imported) == sorted(MATRICES)
    assert sorted(report.fresh) == sorted(OTHERS)
    for n, p in mats:
        want = src_opt.state[p]["momentum_buffer"]
        assert torch.equal(_state(model, opt, n)["momentum_buffer"], want)


def test_import_from_sgd_state_dict_in_memory_with_dtype_cast():
    torch.manual_seed(0)
    src = TinyNet()
    sgd = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    train(src, sgd, 2)
    sd = sgd.state_dict()
    for st in sd["state"].values():
        st["momentum_buffer"] = st["momentum_buffer"].to(torch.bfloat16)
    model, opt = _fresh()
    report = import_optimizer_state(opt, sd, model=model)
    assert "torch.optim.SGD" in report.source
    assert sorted(report.imported) == sorted(MATRICES)
    assert sorted(report.fresh) == sorted(OTHERS)  # SGD momentum is not an AdamW moment
    assert report.casts == {
        f"state.{f}.momentum_buffer": ("torch.bfloat16", "torch.float32") for f in MATRICES
    }
    for fqn in MATRICES:
        want = sgd.state[dict(src.named_parameters())[fqn]]["momentum_buffer"]
        got = _state(model, opt, fqn)["momentum_buffer"]
        assert got.dtype == torch.float32
        assert torch.equal(got, want.to(torch.bfloat16).float())


def test_import_from_torch_flattened_dcp_checkpoint(tmp_path):
    src_model, src_opt = _adamw_run()
    flat = get_optimizer_state_dict(
        src_model, src_opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    assert "state.emb.weight.exp_avg" in flat  # torchtitan's layout
    dcp.save(flat, checkpoint_id=str(tmp_path / "titan"), no_dist=True)
    model, opt = _fresh()
    report = import_optimizer_state(opt, str(tmp_path / "titan"), adam_into_muon=True)
    assert report.source.startswith("DCP checkpoint at")
    assert report.fresh == []
    _assert_adamw_imported(model, opt, src_model, src_opt, OTHERS)
    for fqn in MATRICES:
        want = src_opt.state[dict(src_model.named_parameters())[fqn]]["exp_avg"]
        assert torch.equal(_state(model, opt, fqn)["momentum_buffer"], want)


def test_import_from_own_checkpoint_run_root_and_step_dir(tmp_path):
    torch.manual_seed(0)
    src = TinyNet()
    src_opt = make_muon(src)
    url = str(tmp_path / "run")
    with CheckpointManager(url, model=src, optimizer=src_opt) as mgr:
        train(src, src_opt, 2)
        mgr.save(2)
        snapshot = {id(p): {k: v.clone() for k, v in st.items()} for p, st in src_opt.state.items()}
        train(src, src_opt, 1, seed=5)
        mgr.save(3)
    for source, step, want_step in ((url, 2, 2), (url + "/step-00000002", None, 2), (url, None, 3)):
        model, opt = _fresh()
        report = import_optimizer_state(opt, source, step=step)
        assert report.source_step == want_step
        assert report.fresh == [] and report.unused == [] and report.casts == {}
        for (_, p), (_, q) in zip(src.named_parameters(), model.named_parameters(), strict=True):
            want = snapshot[id(p)] if want_step == 2 else src_opt.state[p]
            for k, v in want.items():
                assert torch.equal(opt.state[q][k], v), (source, k)


def test_import_from_safetensors_file(tmp_path):
    src_model, src_opt = _adamw_run()
    named = dict(src_model.named_parameters())
    tensors = {f"state.{n}.{k}": v for n, p in named.items() for k, v in src_opt.state[p].items()}
    tensors["model.fc1.weight"] = named["fc1.weight"].detach()  # not state: ignored
    layout = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    with open(tmp_path / "s.safetensors", "wb") as f:
        write_safetensors(f, layout, iter(tensors.items()), {"step": "3"})
    model, opt = _fresh()
    report = import_optimizer_state(opt, str(tmp_path / "s.safetensors"))
    assert report.source_step == 3
    assert "safetensors" in report.source
    _assert_adamw_imported(model, opt, src_model, src_opt, OTHERS)
    assert "model.fc1.weight" not in report.unused


def test_dry_run_changes_nothing(tmp_path):
    _, src_opt = _adamw_run()
    torch.save(src_opt.state_dict(), tmp_path / "adamw.pt")
    model, opt = _fresh()
    report = import_optimizer_state(opt, tmp_path / "adamw.pt", model=model, dry_run=True)
    assert report.dry_run and "dry run: nothing changed" in str(report)
    assert sorted(report.imported) == sorted(OTHERS)
    assert len(opt.state) == 0  # not even fresh state was created
    train(model, opt, 1)
    before = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    import_optimizer_state(opt, tmp_path / "adamw.pt", model=model, dry_run=True)
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, before[id(p)][k])


def test_import_with_offload_on_keeps_offload_and_loads_state(tmp_path):
    src_model, src_opt = _adamw_run()
    torch.save(src_opt.state_dict(), tmp_path / "adamw.pt")
    model, opt = _fresh()
    opt.turn_on_cpu_offload()
    import_optimizer_state(opt, tmp_path / "adamw.pt", model=model, adam_into_muon=True)
    assert opt.cpu_offload
    opt.turn_off_cpu_offload()
    _assert_adamw_imported(model, opt, src_model, src_opt, OTHERS)
    # And the imported state drives the same step as on an optimizer without offload.
    model2, opt2 = _fresh()
    import_optimizer_state(opt2, tmp_path / "adamw.pt", model=model2, adam_into_muon=True)
    opt.turn_on_cpu_offload()
    train(model, opt, 1, seed=9)
    train(model2, opt2, 1, seed=9)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_import_from_s3(s3_bucket, tmp_path):
    bucket, opts = s3_bucket
    src_model, src_opt = _adamw_run()
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    torch.save(src_opt.state_dict(), tmp_path / "adamw.pt")
    fs.put(str(tmp_path / "adamw.pt"), f"{bucket}/adamw.pt")
    flat = get_optimizer_state_dict(
        src_model, src_opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    dcp.save(flat, checkpoint_id=str(tmp_path / "titan"), no_dist=True)
    fs.put(str(tmp_path / "titan"), f"{bucket}/titan", recursive=True)
    for source in (f"s3://{bucket}/adamw.pt", f"s3://{bucket}/titan"):
        model, opt = _fresh()
        report = import_optimizer_state(opt, source, model=model, storage_options=opts)
        assert sorted(report.imported) == sorted(OTHERS), source
        _assert_adamw_imported(model, opt, src_model, src_opt, OTHERS)


def test_import_from_a_safetensors_file_written_by_another_tool(tmp_path):
    """A file laid out by hand from the format spec: unpadded header, data in another order
    than the header's, bf16 (cast to the fp32 state and reported)."""
    import json
    import struct

    m1 = torch.arange(12, dtype=torch.bfloat16) / 8
    step = torch.tensor(4.0)
    data = bytes(step.untyped_storage()) + bytes(m1.untyped_storage())
    header = json.dumps(
        {
            "state.fc1.bias.exp_avg": {"dtype": "BF16", "shape": [12], "data_offsets": [4, 28]},
            "state.fc1.bias.step": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
        }
    ).encode()
    (tmp_path / "h.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    model, opt = _fresh()
    report = import_optimizer_state(opt, str(tmp_path / "h.safetensors"))
    st = _state(model, opt, "fc1.bias")
    assert torch.equal(st["moment1"], m1.float()) and st["step"].item() == 4.0
    assert report.casts == {"state.fc1.bias.exp_avg": ("torch.bfloat16", "torch.float32")}
    assert report.missing == {"fc1.bias": ["moment2"]}
    assert "incomplete  fc1.bias: no source for moment2" in str(report)


def _saved_by_the_manager(model: torch.nn.Module, tmp_path) -> tuple[object, str]:
    """``model`` trained 2 steps with Muon and saved (step 2): (its optimizer, the run URL)."""
    opt = make_muon(model)
    url = str(tmp_path / "run")
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        train(model, opt, 2)
        mgr.save(2)
    return opt, url


def test_import_into_a_compiled_model_matches_canonical_names(tmp_path):
    """A checkpoint stores canonical FQNs (no ``_orig_mod.``); ``model=`` a compiled model
    imports every param's state, as the manager loads it, and the report names the params
    canonically. A torch file named by the compiled model's ``named_parameters()``
    (positional ids) imports too."""
    torch.manual_seed(0)
    src = TinyNet()
    src_opt, url = _saved_by_the_manager(src, tmp_path)
    model, _ = _fresh()
    wrapped = torch.compile(model)
    opt = make_muon(model)
    report = import_optimizer_state(opt, url, model=wrapped)
    names = [n for n, _ in model.named_parameters()]
    assert report.fresh == [] and sorted(report.imported) == sorted(names)
    for p, q in zip(src.parameters(), model.parameters(), strict=True):
        for k, v in src_opt.state[p].items():
            assert torch.equal(opt.state[q][k], v), k
    path = str(tmp_path / "opt.pt")
    torch.save(src_opt.state_dict(), path)  # params by position
    model2, _ = _fresh()
    wrapped2 = torch.compile(model2)
    opt2 = make_muon(model2)
    report = import_optimizer_state(opt2, path, model=wrapped2)
    assert report.fresh == [] and sorted(report.imported) == sorted(names)


class _Holder(torch.nn.Module):
    """The user's own top-level submodule called ``module`` (not DDP): its name stays."""

    def __init__(self) -> None:
        super().__init__()
        self.module = TinyNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_import_keeps_a_models_own_module_prefix(tmp_path):
    torch.manual_seed(0)
    _, url = _saved_by_the_manager(_Holder(), tmp_path)
    dst = _Holder()
    opt = make_muon(dst)
    report = import_optimizer_state(opt, url, model=dst)
    assert report.fresh == [] and report.unused == []
    assert sorted(report.imported) == sorted(n for n, _ in dst.named_parameters())
