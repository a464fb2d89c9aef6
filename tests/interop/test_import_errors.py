"""Bad sources and mismatches: each raises a documented error class with an actionable message,
and the optimizer is left untouched."""

from __future__ import annotations

import os
import pickle
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp

from muon_ckpt import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    import_optimizer_state,
)
from tests._ckpt import TinyNet, make_muon, muon_state_sd, train, write_step


def _fresh():
    torch.manual_seed(1)
    model = TinyNet()
    opt = make_muon(model)
    train(model, opt, 1)
    before = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    return model, opt, before


def _unchanged(opt, before) -> bool:
    return all(
        torch.equal(v, before[id(p)][k]) for p, st in opt.state.items() for k, v in st.items()
    )


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    _, opt, before = _fresh()
    sd = {
        "state.fc1.bias.moment1": torch.zeros(12),  # fine, but the next one is wrong:
        "state.fc2.weight.momentum_buffer": torch.zeros(8, 13),
    }
    with pytest.raises(CheckpointMismatchError) as e:
        import_optimizer_state(opt, sd)
    msg = str(e.value)
    assert "state.fc2.weight.momentum_buffer" in msg
    assert "(8, 13)" in msg and "(8, 12)" in msg
    assert _unchanged(opt, before)  # checked before anything was written


def test_missing_source_is_not_found(tmp_path):
    _, opt, _ = _fresh()
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        import_optimizer_state(opt, str(tmp_path / "nope.pt"))
    with pytest.raises(FileNotFoundError):
        import_optimizer_state(opt, str(tmp_path / "nope.pt"))


def test_file_of_unknown_format(tmp_path):
    (tmp_path / "x.txt").write_text("hello, not a checkpoint")
    _, opt, _ = _fresh()
    with pytest.raises(CheckpointError, match=r"not a safetensors file, a torch\.save file"):
        import_optimizer_state(opt, str(tmp_path / "x.txt"))


class Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_pickled_objects_are_never_unpickled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"state": {0: {"x": Evil()}}, "param_groups": []}, tmp_path / "evil.pt")
    _, opt, before = _fresh()
    with pytest.raises(CheckpointError, match="weights_only=True"):
        import_optimizer_state(opt, str(tmp_path / "evil.pt"))
    assert not (tmp_path / "PWNED").exists()
    assert _unchanged(opt, before)


def test_dcp_metadata_with_foreign_classes_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "dcp"
    dcp.save({"state.fc1.bias.moment1": torch.zeros(12)}, checkpoint_id=str(d), no_dist=True)
    (d / ".metadata").write_bytes(pickle.dumps(Evil()))
    _, opt, _ = _fresh()
    with pytest.raises(CheckpointCorruptError, match="refusing to unpickle"):
        import_optimizer_state(opt, str(d))
    assert not (tmp_path / "PWNED").exists()


def test_truncated_safetensors_is_corrupt(tmp_path):
    header = b'{"state.fc1.bias.moment1":{"dtype":"F32","shape":[12],"data_offsets":[0,48]}}'
    header += b" " * (-len(header) % 8)
    data = struct.pack("<Q", len(header)) + header + b"\0" * 20  # 28 of 48 bytes
    (tmp_path / "t.safetensors").write_bytes(data)
    _, opt, _ = _fresh()
    with pytest.raises(CheckpointCorruptError, match="data_offsets"):
        import_optimizer_state(opt, str(tmp_path / "t.safetensors"))


def test_source_without_optimizer_state(tmp_path):
    d = tmp_path / "model_only"
    dcp.save({"model.fc1.weight": torch.zeros(12, 8)}, checkpoint_id=str(d), no_dist=True)
    _, opt, _ = _fresh()
    with pytest.raises(CheckpointError, match="no optimizer state found"):
        import_optimizer_state(opt, str(d))
    torch.save({"model": {"w": torch.zeros(2)}}, tmp_path / "m.pt")
    with pytest.raises(CheckpointError, match="no optimizer state found"):
        import_optimizer_state(opt, str(tmp_path / "m.pt"))


def test_uncommitted_step_and_missing_step(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    src = make_muon(model)
    train(model, src, 1)
    url = str(tmp_path / "run")
    write_step(url, 1, muon_state_sd(model, src))
    write_step(url, 2, muon_state_sd(model, src), commit=False)
    _, opt, _ = _fresh()
    with pytest.raises(CheckpointNotFoundError, match="never committed"):
        import_optimizer_state(opt, url + "/step-00000002")
    with pytest.raises(CheckpointNotFoundError, match=r"committed steps: 1\."):
        import_optimizer_state(opt, url, step=2)
    assert import_optimizer_state(opt, url).source_step == 1  # newest committed


def test_renamed_params_leave_fresh_state_and_a_hint():
    _, opt, _ = _fresh()
    sd = {"state.encoder.fc1.bias.moment1": torch.zeros(12)}
    report = import_optimizer_state(opt, sd, dry_run=True)
    assert report.imported == {}
    assert report.unused == ["state.encoder.fc1.bias.moment1"]
    assert any("match no optimizer param" in h and "encoder.fc1.bias" in h for h in report.hints)


def test_optimizer_that_is_not_muon():
    model = TinyNet()
    with pytest.raises(TypeError, match="needs a Muon optimizer"):
        import_optimizer_state(torch.optim.AdamW(model.parameters()), {"state": {}})


def test_a_torch_save_file_that_inflates_is_refused_within_a_memory_bound(tmp_path):
    """A 70 KiB torch.save file whose record is deflated (256 MiB for torch.load) is refused
    before torch.load runs, naming the file (the same check as a checkpoint's items)."""
    from tests._crafted import MiB, bomb_item, peak_growth

    path = tmp_path / "bomb.pt"
    path.write_bytes(bomb_item(torch.zeros(2, 2), 256 * MiB, deflate=True))
    _, opt, before = _fresh()
    grew, out = peak_growth(lambda: import_optimizer_state(opt, str(path)))
    assert isinstance(out, CheckpointCorruptError) and "bomb.pt" in str(out), out
    assert grew < 64 * MiB, grew // MiB
    assert _unchanged(opt, before)
