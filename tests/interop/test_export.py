"""export_safetensors: consolidated full tensors in one process, metadata, include/dtype, S3,
and export -> import restoring optimizer state bitwise."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from muon_ckpt import (
    CheckpointManager,
    CheckpointNotFoundError,
    export_safetensors,
    import_optimizer_state,
)
from muon_ckpt.store.keys import KEY_FORMAT_VERSION
from tests._ckpt import TinyNet, make_muon, train
from tests._dist import dist_device, run_on_ranks


def _read_all(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, "pt") as f:  # the safetensors package itself reads our files
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118


def body_save_sharded(rank, world_size, url, full_file):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh(dist_device().type, (world_size,))
    torch.manual_seed(0)
    model = TinyNet().to(dist_device())
    fully_shard(model, mesh=mesh)
    opt = make_muon(model)
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        train(model, opt, 3)
        mgr.save(3)
    full = {}
    for fqn, p in model.named_parameters():
        full[f"model.{fqn}"] = p.full_tensor().cpu()
        for k, v in opt.state[p].items():
            full[f"optim.state.{fqn}.{k}"] = (
                v.full_tensor() if isinstance(v, DTensor) else v
            ).cpu()
    if rank == 0:
        torch.save(full, full_file)
    return len(full)


def test_export_of_a_sharded_checkpoint_then_import_is_bitwise(tmp_path):
    url, full_file = str(tmp_path / "run"), str(tmp_path / "full.pt")
    n = run_on_ranks(body_save_sharded, 3, url, full_file)[0]
    out = str(tmp_path / "out" / "export.safetensors")
    # This process has no process group: export must not need one.
    assert not torch.distributed.is_initialized()
    # The model only by default; the optimizer state when asked.
    summary = export_safetensors(url, out, include=("model", "optim"))
    assert summary.step == 3 and summary.tensors == n
    full = torch.load(full_file, weights_only=True)
    tensors, meta = _read_all(out)
    assert sorted(tensors) == sorted(full)
    for k, v in full.items():
        assert tensors[k].dtype == v.dtype and torch.equal(tensors[k], v), k
    assert meta["step"] == "3"
    assert meta["key_format_version"] == str(KEY_FORMAT_VERSION)
    groups = json.loads(meta["optim.param_groups"])
    assert groups["optim.param_groups.fc1.weight.lr"] == 0.02
    assert groups["optim.param_groups.emb.weight.use_muon"] is False
    # export -> import restores the optimizer state bitwise, in another world (1 process).
    model = TinyNet()
    opt = make_muon(model)
    report = import_optimizer_state(opt, out)
    assert report.fresh == [] and report.unused == [] and report.casts == {}
    assert report.source_step == 3
    for fqn, p in model.named_parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, full[f"optim.state.{fqn}.{k}"]), (fqn, k)


def _single_process_checkpoint(url: str) -> tuple[TinyNet, object]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = make_muon(model)
    with CheckpointManager(url, model=model, optimizer=opt, extra={"sched": _Counter()}) as mgr:
        train(model, opt, 2)
        mgr.save(2)
        train(model, opt, 1, seed=3)
        mgr.save(4)
    return model, opt


class _Counter:
    def __init__(self) -> None:
        self.n = 7

    def state_dict(self):
        return {"n": self.n, "t": torch.tensor([1.5, 2.5])}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def test_include_dtype_and_step_selection(tmp_path):
    url = str(tmp_path / "run")
    model, opt = _single_process_checkpoint(url)
    out = str(tmp_path / "m.safetensors")
    s = export_safetensors(url, out, include=("model",), dtype="bf16", step=2)
    tensors, meta = _read_all(out)
    assert s.step == 2 and meta["step"] == "2" and meta["dtype"] == "torch.bfloat16"
    assert sorted(tensors) == sorted(f"model.{n}" for n, _ in model.named_parameters())
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    s = export_safetensors(url, out, include=("optim", "extra"), dtype=torch.float16)
    tensors, meta = _read_all(out)
    assert s.step == 4
    assert "extra.sched.t" in tensors and not any(k.startswith("model.") for k in tensors)
    assert tensors["optim.state.emb.weight.step"].dtype == torch.float32  # scalars keep theirs
    assert tensors["optim.state.emb.weight.moment1"].dtype == torch.float16
    want = opt.state[model.emb.weight]["moment1"].to(torch.float16)
    assert torch.equal(tensors["optim.state.emb.weight.moment1"], want)
    assert "extra.sched.n" in s.skipped  # a non-tensor value cannot go into safetensors


def test_export_from_and_to_s3(s3_bucket, tmp_path):
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    model, opt = _single_process_checkpoint_s3(url, opts)
    out = f"s3://{bucket}/exports/run.safetensors"
    s = export_safetensors(url, out, include=("model", "optim"), storage_options=opts)
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    local = str(tmp_path / "copy.safetensors")
    fs.get(out.removeprefix("s3://"), local)
    tensors, meta = _read_all(local)
    assert s.step == 1 and meta["step"] == "1"
    assert torch.equal(tensors["model.fc1.weight"], model.fc1.weight.detach())
    mb = opt.state[model.fc2.weight]["momentum_buffer"]
    assert torch.equal(tensors["optim.state.fc2.weight.momentum_buffer"], mb)
    # and the remote export imports back directly
    opt2 = make_muon(TinyNet())
    report = import_optimizer_state(opt2, out, storage_options=opts)
    assert report.fresh == [] and report.source_step == 1


def _single_process_checkpoint_s3(url, opts):
    torch.manual_seed(0)
    model = TinyNet()
    opt = make_muon(model)
    with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as mgr:
        train(model, opt, 1)
        mgr.save(1)
    return model, opt


def test_bad_arguments_and_missing_checkpoint(tmp_path):
    url = str(tmp_path / "run")
    _single_process_checkpoint(url)
    out = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="include must be a non-empty subset"):
        export_safetensors(url, str(out), include=("weights",))
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_safetensors(url, str(out), dtype="int3")
    with pytest.raises(CheckpointNotFoundError, match=r"committed steps: 2, 4\."):
        export_safetensors(url, str(out), step=3)
    with pytest.raises(CheckpointNotFoundError):
        export_safetensors(str(tmp_path / "nothing"), str(out))
    assert not out.exists() and not list(tmp_path.glob("x.safetensors*"))  # no tmp file either


class _Rng:
    """A ``rank_extra`` holding a tensor (an RNG state, per rank)."""

    def __init__(self) -> None:
        self.state = torch.arange(5, dtype=torch.uint8)

    def state_dict(self) -> dict:
        return {"cpu": self.state}

    def load_state_dict(self, sd: dict) -> None:
        self.state = sd["cpu"]


def test_rank_extra_tensors_are_extra_not_model_weights(tmp_path):
    """A tensor of ``rank_extra`` is never exported as a model weight (the model's
    safetensors and Hugging Face files load into the model strictly); ``include`` extra
    exports it."""
    from safetensors.torch import load_file

    from muon_ckpt import export_hf

    url = str(tmp_path / "run")
    model = torch.nn.Linear(3, 2)
    CheckpointManager(url, model=model, rank_extra={"rng": _Rng()}).save(1)
    out = str(tmp_path / "model.safetensors")
    export_safetensors(url, out)
    assert sorted(load_file(out)) == ["model.bias", "model.weight"]
    export_hf(url, str(tmp_path / "hf"))
    torch.nn.Linear(3, 2).load_state_dict(load_file(str(tmp_path / "hf" / "model.safetensors")))
    out = str(tmp_path / "extra.safetensors")
    export_safetensors(url, out, include=("extra",))
    assert sorted(load_file(out)) == ["rank_extra.0.rng.cpu"]
