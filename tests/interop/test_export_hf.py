"""export_hf / `muon-ckpt export --hf` and load_hf_model: the Hugging Face layout as
huggingface_hub writes and reads it (its own loader and splitter are the reference), FSDP2 saves
and loads, shards, wrapper prefixes, renames, tied weights, the optimizer set, and errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from huggingface_hub import load_torch_model, split_torch_state_dict_into_shards
from safetensors import safe_open
from torch import nn

from muon_ckpt import (
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    export_hf,
    import_optimizer_state,
    load_hf_model,
)
from muon_ckpt.cli import main
from tests._ckpt import TinyNet, make_muon, train, write_step
from tests._dist import dist_device, run_on_ranks
from tests.interop.test_export import body_save_sharded


def body_save_export_load(rank, world_size, url, full_file, hf_dir):
    """Save on N ranks (FSDP2); rank 0 exports with `muon-ckpt export --hf`; every rank loads
    the export into a fresh FSDP2 model (its rows only) and checks it against the saved one."""
    import contextlib
    import io

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    body_save_sharded(rank, world_size, url, full_file)
    dist.barrier()
    doc = None
    if rank == 0:
        argv = ["export", url, "--hf", hf_dir, "--max-shard-size", "300", "--json"]
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(argv) == 0
        doc = json.loads(out.getvalue())
    dist.barrier()
    want = torch.load(full_file, weights_only=True)
    mesh = init_device_mesh(dist_device().type, (world_size,))
    torch.manual_seed(1)  # other values than the saved ones
    model = TinyNet().to(dist_device())
    fully_shard(model, mesh=mesh)
    report = load_hf_model(model, hf_dir)
    assert report.missing == [] and report.unexpected == [] and report.casts == {}, str(report)
    for fqn, p in model.named_parameters():
        full = p.full_tensor().cpu()
        assert full.dtype == want[f"model.{fqn}"].dtype and torch.equal(full, want[f"model.{fqn}"])
    return doc, len(report.loaded)


def test_fsdp2_checkpoint_exported_with_hf_loads_bitwise_with_huggingface_hub(tmp_path):
    url, full_file, out = str(tmp_path / "run"), str(tmp_path / "full.pt"), str(tmp_path / "hf")
    (doc, n0), (_, n1) = run_on_ranks(body_save_export_load, 2, url, full_file, out)
    want = torch.load(full_file, weights_only=True)
    model_keys = [k.removeprefix("model.") for k in want if k.startswith("model.")]
    assert doc["step"] == 3 and doc["tensors"] == len(model_keys) == n0 == n1
    shards = [f for f in doc["files"]["model"] if not f.endswith(".json")]
    assert len(shards) > 1 and doc["files"]["model"][-1] == "model.safetensors.index.json"
    assert sorted(os.listdir(out)) == sorted(doc["files"]["model"])  # no optimizer by default
    model = TinyNet()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    result = load_torch_model(model, out, strict=True)  # huggingface_hub's own loader
    assert not result.missing_keys and not result.unexpected_keys
    for fqn, t in model.state_dict().items():
        ref = want[f"model.{fqn}"]
        assert t.dtype == ref.dtype and torch.equal(t, ref), fqn


def _saved_run(url: str, model: nn.Module, *, optimizer: bool = True) -> tuple[nn.Module, object]:
    """``model`` (and a Muon, trained 2 steps) saved at step 2 by the CheckpointManager."""
    opt = make_muon(model) if optimizer else None
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        if opt is not None:
            train(model, opt, 2)
        mgr.save(2)
    return model, opt


def test_a_model_larger_than_max_shard_size_is_split_as_huggingface_hub_splits(tmp_path):
    url, out = str(tmp_path / "run"), tmp_path / "hf"
    model, _ = _saved_run(url, TinyNet())
    out.mkdir()
    (out / "config.json").write_text("{}")  # a file of the user's: left alone
    s = export_hf(url, str(out), max_shard_size="1KB")
    ref = split_torch_state_dict_into_shards(model.state_dict(), max_shard_size="1KB")
    assert ref.is_sharded and len(ref.filename_to_tensors) >= 2
    assert s.files["model"] == [*ref.filename_to_tensors, "model.safetensors.index.json"]
    raw = (out / "model.safetensors.index.json").read_text()
    index = json.loads(raw)
    assert index == {"metadata": ref.metadata, "weight_map": ref.tensor_to_filename}
    assert list(index["weight_map"]) == list(ref.tensor_to_filename)  # same order too
    assert raw == json.dumps(index, indent=2)  # formatted as huggingface_hub writes it
    for fname, names in ref.filename_to_tensors.items():
        with safe_open(str(out / fname), "pt") as f:
            assert list(f.keys()) == sorted(names) and f.metadata() == {"format": "pt"}
            for n in names:
                assert torch.equal(f.get_tensor(n), model.state_dict()[n])
    assert sum(os.path.getsize(out / f) for f in ref.filename_to_tensors) == s.bytes
    # A second export that fits in one file replaces the shards and the index.
    s = export_hf(url, str(out), dtype="bf16")
    assert s.files == {"model": ["model.safetensors"]}
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc1.weight").dtype == torch.bfloat16


class _Tied(nn.Module):
    """An LM head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight


def test_wrapper_prefixes_rename_and_tied_weights_written_once(tmp_path):
    url, out = str(tmp_path / "run"), str(tmp_path / "hf")
    torch.manual_seed(0)
    saved = _Tied()
    # Written before the manager removed wrapper names: DDP's "module." around torch.compile's
    # "_orig_mod."; the tied weight under both names (DCP stores it twice).
    sd = {f"model.module._orig_mod.{k}": v for k, v in saved.state_dict().items()}
    write_step(url, 2, sd)
    rename = {r"fc(\d)\.(.*)": r"mlp.fc\1.\2"}
    s = export_hf(url, out, rename=rename, tied={"head.weight": "emb.weight"})
    assert s.tied == {"head.weight": "emb.weight"} and s.tensors == 5
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == [
            "emb.weight",
            "mlp.fc1.bias",
            "mlp.fc1.weight",
            "mlp.fc2.bias",
            "mlp.fc2.weight",
        ]
        assert f.metadata() == {"format": "pt", "head.weight": "emb.weight"}
    fresh = _Tied()
    report = load_hf_model(fresh, out, rename=rename)
    assert report.tied == {"head.weight": "emb.weight"} and report.missing == []
    assert report.loaded["fc1.weight"] == "mlp.fc1.weight" and report.unexpected == []
    assert fresh.head.weight is fresh.emb.weight
    for k, v in saved.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    # Tied names must hold the same bytes; names must stay distinct.
    with pytest.raises(ValueError, match="not tied weights"):
        export_hf(url, out, tied={"fc2.weight": "fc1.weight"})
    with pytest.raises(ValueError, match="both become 'x'"):
        export_hf(url, out, rename=lambda n: "x")


def test_optimizer_state_goes_to_its_own_file_set_and_imports_back(tmp_path):
    url, out = str(tmp_path / "run"), str(tmp_path / "hf")
    model, opt = _saved_run(url, TinyNet())
    s = export_hf(url, out, include=("model", "optim"))
    assert s.files == {"model": ["model.safetensors"], "optim": ["optimizer.safetensors"]}
    with safe_open(os.path.join(out, "optimizer.safetensors"), "pt") as f:
        names = list(f.keys())
        groups = json.loads(f.metadata()["optim.param_groups"])
    assert "state.fc1.weight.momentum_buffer" in names
    assert all(n.startswith("state.") for n in names)
    assert groups["optim.param_groups.fc1.weight.lr"] == 0.02
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(model.state_dict())
    fresh = TinyNet()
    fresh_opt = make_muon(fresh)
    report = import_optimizer_state(fresh_opt, os.path.join(out, "optimizer.safetensors"))
    assert report.fresh == [] and report.unused == [] and report.source_step == 2
    for (n, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        for k, v in opt.state[p].items():
            assert torch.equal(fresh_opt.state[q][k], v), (n, k)
    # Sharded, the set imports from its directory (the index gives step and files).
    s = export_hf(url, out, include=("optim",), max_shard_size="1KB")
    assert s.files["optim"][-1] == "optimizer.safetensors.index.json" and len(s.files["optim"]) > 2
    assert "model.safetensors" in os.listdir(out)  # the model set is left as it was
    fresh_opt = make_muon(fresh)
    report = import_optimizer_state(fresh_opt, out)
    assert report.fresh == [] and report.unused == [] and report.source_step == 2
    assert report.source.startswith("optimizer safetensors set ")
    for (n, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        for k, v in opt.state[p].items():
            assert torch.equal(fresh_opt.state[q][k], v), (n, k)


def test_bad_arguments_are_errors_that_say_what_to_do(tmp_path):
    url, out = str(tmp_path / "run"), str(tmp_path / "hf")
    torch.manual_seed(0)
    _saved_run(url, TinyNet(), optimizer=False)
    with pytest.raises(ValueError, match="extra has no Hugging Face layout: export_safetensors"):
        export_hf(url, out, include=("extra",))
    with pytest.raises(ValueError, match="include must be a non-empty subset"):
        export_hf(url, out, include=())
    with pytest.raises(ValueError, match=r"selects no tensor .*optim: 0 tensors"):
        export_hf(url, out, include=("model", "optim"))
    for bad in ("5XB", "0", -1, "GB", "1.5.2MB"):
        with pytest.raises(ValueError, match="max_shard_size must be a positive number"):
            export_hf(url, out, max_shard_size=bad)
    with pytest.raises(ValueError, match="is not a regular expression"):
        export_hf(url, out, rename={"(": "x"})
    with pytest.raises(ValueError, match=r"\['nope.weight'\] is not an exported model name"):
        export_hf(url, out, tied={"nope.weight": "emb.weight"})
    with pytest.raises(ValueError, match=r"'fc1\.weight' is dropped itself"):
        export_hf(url, out, tied={"emb.weight": "fc1.weight", "fc1.weight": "emb.weight"})
    with pytest.raises(CheckpointNotFoundError):
        export_hf(str(tmp_path / "nothing"), out)
    assert not os.path.exists(out)  # nothing was written by a failed call
    with pytest.raises(CheckpointNotFoundError, match=r"no model\.safetensors\.index\.json"):
        load_hf_model(TinyNet(), str(tmp_path))


def test_load_hf_model_checks_everything_before_changing_the_model(tmp_path):
    url, out = str(tmp_path / "run"), str(tmp_path / "hf")
    saved, _ = _saved_run(url, TinyNet())
    export_hf(url, out, max_shard_size="1KB")

    class Bigger(TinyNet):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(2, 2)

    model = Bigger()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        CheckpointMismatchError,
        match=r"2 model tensor\(s\) not in the files \[.extra.weight., .extra.bias.\]",
    ):
        load_hf_model(model, out)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    report = load_hf_model(model, out, strict=False)
    assert report.missing == ["extra.weight", "extra.bias"] and report.unexpected == []
    assert torch.equal(model.fc1.weight, saved.fc1.weight)
    assert "2 missing" in str(report)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"model-0000\d-of-0000\d\.safetensors: .emb\.weight. has shape \[11, 8\] in the files but .emb\.weight. has \[11, 4\]",
    ):
        load_hf_model(TinyNet(dim=4), out)
    model = TinyNet().to(torch.float64)
    report = load_hf_model(model, out)
    assert report.casts["fc1.weight"] == ("torch.float32", "torch.float64")
    assert torch.equal(model.fc1.weight, saved.fc1.weight.double())
    # A shard named by the index but missing is named in the error.
    shard = next(f for f in os.listdir(out) if f.startswith("model-00002"))
    os.remove(os.path.join(out, shard))
    with pytest.raises(Exception, match=f"{shard}: named by model.safetensors.index.json"):
        load_hf_model(TinyNet(), out)


def test_export_to_and_load_from_s3(s3_bucket):
    bucket, opts = s3_bucket
    url, out = f"s3://{bucket}/run", f"s3://{bucket}/hf"
    torch.manual_seed(0)
    model = TinyNet()
    opt = make_muon(model)
    with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as mgr:
        train(model, opt, 1)
        mgr.save(1)
    s = export_hf(url, out, max_shard_size="1KB", storage_options=opts)
    assert len(s.files["model"]) > 2
    fresh = TinyNet()
    report = load_hf_model(fresh, out, storage_options=opts)
    assert report.missing == [] and report.unexpected == []
    assert report.files == [f for f in s.files["model"] if f.endswith(".safetensors")]
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


class _CausalLM(nn.Module):
    """Hugging Face naming: the decoder under ``model.``, the head beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(10, 4)
        self.model.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 10, bias=False)


@pytest.mark.parametrize("nested", [False, True], ids=["model_sd", "under_model"])
def test_plain_dcp_source_keeps_the_models_own_names(tmp_path, nested):
    """A plain DCP directory holds the FQNs as saved: a model's own ``model.`` prefix stays
    (saved as ``model.state_dict()``); a prefix that every key has is the section (saved as
    ``{"model": model.state_dict()}``)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    torch.manual_seed(0)
    src = _CausalLM()
    d = str(tmp_path / "dcp")
    dcp.save(
        {"model": src.state_dict()} if nested else src.state_dict(), checkpoint_id=d, no_dist=True
    )
    out = str(tmp_path / "hf")
    export_hf(d, out)
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(sd) == sorted(src.state_dict())
    assert torch.equal(sd["lm_head.weight"], src.lm_head.weight)
    assert torch.equal(sd["model.embed_tokens.weight"], src.model.embed_tokens.weight)
    dst = _CausalLM()
    dst.load_state_dict(sd)
    assert all(torch.equal(dst.state_dict()[k], v) for k, v in src.state_dict().items())


def test_plain_dcp_source_with_a_step_beside_the_model(tmp_path):
    """``{"model": ..., "step": ...}``: the model's keys lose the section prefix; the
    top-level ``step`` is not a module path and does not count against it."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    src = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    d = str(tmp_path / "dcp")
    dcp.save({"model": src.state_dict(), "step": torch.tensor(7)}, checkpoint_id=d, no_dist=True)
    out = str(tmp_path / "hf")
    export_hf(d, out)
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(k for k in sd if k != "step") == sorted(src.state_dict())


def test_plain_dcp_model_with_its_own_rank_extra_module_exports_it(tmp_path):
    """Only muon-ckpt's ``rank_extra.<rank>.`` keys are per-rank state; a foreign model's own
    submodule called ``rank_extra`` is model weights."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    src = nn.Module()
    src.rank_extra = nn.Linear(2, 2)
    src.head = nn.Linear(2, 2)
    d = str(tmp_path / "dcp")
    dcp.save(src.state_dict(), checkpoint_id=d, no_dist=True)
    export_hf(d, str(tmp_path / "hf"))
    assert sorted(load_file(str(tmp_path / "hf" / "model.safetensors"))) == sorted(src.state_dict())
