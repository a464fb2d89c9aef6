"""The local item reader (muon_ckpt/load/_local_files.py) against DCP's own FileSystemReader.

A plain ``dcp.save`` of many dtypes and shapes (0-d, empty, transposed, non-tensor values) is
loaded twice into identical targets: by ``dcp.load`` with DCP's reader (the reference) and by
``VerifyingReader`` on local storage (which uses ``_local_files``). Every target must get the same
bits, on each of the reader's paths: straight into the target, through the whole-record buffer
(non-contiguous targets, dtype casts, transposed stored tensors) and the torch.load fallback.
"""

from __future__ import annotations

import os
import pickle
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import muon_ckpt.load._local_files as itemread
from muon_ckpt import CheckpointCorruptError, CheckpointError
from muon_ckpt._dcp import dcp_failure
from muon_ckpt.load import VerifyingReader
from muon_ckpt.load._item_zip import parse_tensor_pickle
from muon_ckpt.store import FileEntry, Storage
from muon_ckpt.store.checksums import crc_hex
from tests._ckpt import file_layout, flip_byte


def _stored() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    sd: dict[str, object] = {
        "f32": torch.randn(64, 48, generator=g),
        "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(5, 4, 3, generator=g).half(),
        "i64": torch.randint(-(2**40), 2**40, (17,), generator=g),
        "i32": torch.randint(-100, 100, (3, 3), generator=g, dtype=torch.int32),
        "u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(11, generator=g) > 0.5,
        "c64": torch.randn(6, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3.25),
        "step": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "empty_bf16": torch.empty(4, 0, dtype=torch.bfloat16),
        # A transposed tensor whose storage is exactly its size: DCP stores it as is, strides
        # (1, 40), so the reader must honour the stored strides.
        "transposed": torch.randn(40, 24, generator=g).t(),
        # Over three read chunks: the chunked paths run several times (and on CUDA reuse
        # each of their two page-locked buffers).
        "big": torch.randn(3 * itemread.CHUNK // 4 + 1000, generator=g),
        "meta": {"lr": 0.02, "name": "muon", "betas": (0.9, 0.95)},
        # Lazy conjugate / negative views: torch.save records the bit, torch.load applies it;
        # the raw bytes alone would load the wrong values.
        "conj": torch.randn(6, generator=g, dtype=torch.complex64).conj(),
        "neg": torch.randn(5, generator=g)._neg_view(),
    }
    # dtypes torch.save writes with an untyped storage (_rebuild_tensor_v3)
    if hasattr(torch, "float8_e4m3fn"):
        sd["f8"] = torch.randn(8, 8, generator=g).to(torch.float8_e4m3fn)
    if hasattr(torch, "uint16"):
        sd["u16"] = torch.randint(0, 60000, (7,), generator=g).to(torch.uint16)
    return sd


def _targets(sd: dict[str, object], kind: str, device: str = "cpu") -> dict[str, object]:
    """``same``: contiguous tensors of the stored dtype (read straight into them);
    ``strided``: transposed views (non-contiguous) for 2-d tensors, float64 for float32 ones."""
    out: dict[str, object] = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            out[k] = {"lr": 0.0, "name": "", "betas": None}
            continue
        if kind == "same":
            t = torch.zeros(v.shape, dtype=v.dtype, device=device)
        elif v.dim() == 2 and v.numel():
            t = torch.zeros(v.shape[1], v.shape[0], dtype=v.dtype, device=device).t()
        elif v.dtype == torch.float32:
            t = torch.zeros(v.shape, dtype=torch.float64, device=device)
        else:
            t = torch.zeros(v.shape, dtype=v.dtype, device=device)
        out[k] = t
    return out


def _bits(v: object) -> object:
    if isinstance(v, torch.Tensor):
        raw = v.detach().resolve_conj().resolve_neg().cpu().contiguous().view(-1).view(torch.uint8)
        return (v.dtype, tuple(v.shape), raw.tolist())
    return v


def _save(tmp_path) -> tuple[str, dict[str, object]]:
    d = str(tmp_path / "ckpt")
    sd = _stored()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(d, thread_count=2), no_dist=True)
    return d, sd


def _manifest(d: str) -> dict[str, FileEntry]:
    files = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".distcp"):
            with open(os.path.join(d, name), "rb") as f:
                data = f.read()
            files[name] = FileEntry(len(data), crc_hex(zlib.crc32(data)))
    return files


def _ours(d: str, targets: dict, files: dict | None = None, verify: bool = True) -> None:
    """Load with VerifyingReader; a failure comes out as our error class (as the manager
    does with DCP's CheckpointException)."""
    metadata = dcp.FileSystemReader(d).read_metadata()
    reader = VerifyingReader(
        Storage(d),
        files if files is not None else _manifest(d),
        metadata=metadata,
        rank=0,
        world_size=1,
        io_threads=2,
        verify_crc=verify,
    )
    try:
        dcp.load(targets, storage_reader=reader, no_dist=True)
    except CheckpointException as e:
        raise dcp_failure(e, f"loading {d}") from e


def check_same_bits_as_dcp_reader(tmp_path, kind: str, verify: bool, device: str) -> None:
    d, sd = _save(tmp_path)
    ref, got = _targets(sd, kind, device), _targets(sd, kind, device)
    dcp.load(ref, storage_reader=dcp.FileSystemReader(d), no_dist=True)
    _ours(d, got, verify=verify)
    assert set(got) == set(ref)
    for k in ref:
        assert _bits(got[k]) == _bits(ref[k]), k
    # and those are the saved values (the reference itself is right)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor) and kind == "same":
            assert _bits(got[k]) == _bits(v), k
    assert got["meta"] == sd["meta"] and ref["meta"] == sd["meta"]


@pytest.mark.parametrize("kind", ["same", "strided"])
@pytest.mark.parametrize("verify", [True, False], ids=["crc32", "size"])
def test_same_bits_as_dcp_reader(tmp_path, kind, verify):
    check_same_bits_as_dcp_reader(tmp_path, kind, verify, "cpu")


def test_each_item_takes_the_path_it_should(tmp_path, monkeypatch):
    """Same-kind targets: everything straight into the target, except the transposed stored
    tensor (whole-record buffer, for its strides) and the conj/neg views (torch.load)."""
    d, sd = _save(tmp_path)
    paths: dict[str, list] = {"direct": [], "buffer": [], "torch.load": []}
    layout, chunked, record = itemread.item_layout, itemread.FileLoad._take_chunked, None
    record = itemread.FileLoad._record_tensor

    def spy_layout(edges):
        lay = layout(edges)
        if lay is None:
            paths["torch.load"].append(edges.offset)
        return lay

    def spy_chunked(self, fd, target, offset, nbytes):
        paths["direct"].append(tuple(target.shape))
        return chunked(self, fd, target, offset, nbytes)

    def spy_record(self, fd, lay, offset):
        paths["buffer"].append(lay.size)
        return record(self, fd, lay, offset)

    monkeypatch.setattr(itemread, "item_layout", spy_layout)
    monkeypatch.setattr(itemread.FileLoad, "_take_chunked", spy_chunked)
    monkeypatch.setattr(itemread.FileLoad, "_record_tensor", spy_record)
    _ours(d, _targets(sd, "same"))
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and v.numel()}
    assert paths["buffer"] == [(24, 40)]
    assert len(paths["torch.load"]) == 2  # conj, neg
    assert sorted(paths["direct"]) == sorted(
        tuple(v.shape) for k, v in tensors.items() if k not in ("transposed", "conj", "neg")
    )


def test_direct_read_counts_as_an_in_place_write(tmp_path):
    """Like DCP's copy_, a load bumps the target's version counter, so autograd refuses a
    backward through a graph that saved the old values."""
    d, sd = _save(tmp_path)
    targets = _targets(sd, "same")
    w = targets["f32"].requires_grad_()
    before = w._version
    y = (w * w).sum()  # saves w for backward
    with torch.no_grad():
        _ours(d, targets)
    assert w._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_fallback_to_torch_load_gives_same_bits(tmp_path, monkeypatch):
    """Items the layout parser does not recognise load through torch.load, like DCP does."""
    d, sd = _save(tmp_path)
    seen = []

    def unknown(edges):
        seen.append(edges.offset)
        return None

    monkeypatch.setattr(itemread, "item_layout", unknown)
    got = _targets(sd, "same")
    _ours(d, got)
    # (DCP plans no read for an empty tensor)
    assert len(seen) == sum(isinstance(v, torch.Tensor) and v.numel() > 0 for v in sd.values())
    for k, v in sd.items():
        assert _bits(got[k]) == _bits(v), k


def test_layout_parser_declines_what_it_does_not_know(tmp_path):
    """Several storages, a non-tensor pickle, conj/neg views: None (torch.load's turn), never
    a wrong layout."""
    cases = [
        (torch.ones(2), torch.zeros(3)),
        {"a": 1},
        [torch.ones(1)],
        torch.ones(3, dtype=torch.complex64).conj(),
        torch.ones(3)._neg_view(),
    ]
    for i, obj in enumerate(cases):
        p = tmp_path / f"obj{i}.pt"
        torch.save(obj, str(p))
        assert file_layout(str(p)) is None, obj
    p = tmp_path / "t.pt"
    torch.save(torch.arange(12, dtype=torch.int16).view(3, 4).t(), str(p))
    lay = file_layout(str(p))
    assert lay is not None
    assert (lay.dtype, lay.size, lay.stride, lay.offset, lay.nbytes) == (
        torch.int16,
        (4, 3),
        (1, 4),
        0,
        24,
    )
    assert not lay.whole_and_contiguous
    if hasattr(torch, "float8_e5m2"):  # untyped storage + dtype (_rebuild_tensor_v3)
        p = tmp_path / "f8.pt"
        torch.save(torch.zeros(2, 5).to(torch.float8_e5m2), str(p))
        lay = file_layout(str(p))
        assert lay is not None and (lay.dtype, lay.size, lay.nbytes) == (
            torch.float8_e5m2,
            (2, 5),
            10,
        )
        assert lay.whole_and_contiguous


def test_layout_parser_rejects_pickles_torch_save_does_not_write():
    """Opcodes outside torch.save's repertoire are declined before unpickling: a byte string
    whose length field claims 2**62 bytes allocates nothing."""
    huge = b"\x80\x05\x96" + (2**62).to_bytes(8, "little") + b"x."
    assert parse_tensor_pickle(huge) is None
    assert parse_tensor_pickle(pickle.dumps([1, 2, 3])) is None  # EMPTY_LIST etc.
    assert parse_tensor_pickle(b"\x80\x02c") is None  # truncated


@pytest.mark.parametrize("where", ["head", "record", "tail"])
def test_damaged_byte_is_reported_as_corruption_naming_the_file(tmp_path, where):
    d, sd = _save(tmp_path)
    files = _manifest(d)
    md = dcp.FileSystemReader(d).read_metadata()
    info = next(i for idx, i in md.storage_data.items() if idx.fqn == "big")
    path = os.path.join(d, info.relative_path)
    at = {
        "head": info.offset + 40,  # inside the zip's first local header / pickle
        "record": info.offset + info.length // 2,  # tensor bytes
        "tail": info.offset + info.length - 30,  # central directory
    }[where]
    flip_byte(path, at, 0x5A)
    with pytest.raises(CheckpointCorruptError, match=info.relative_path):
        _ours(d, _targets(sd, "same"), files=files)


def test_damaged_item_without_crc_names_the_file(tmp_path):
    """verify="size" cannot tell damage from anything else, but the error names the file."""
    d, sd = _save(tmp_path)
    files = _manifest(d)
    md = dcp.FileSystemReader(d).read_metadata()
    info = next(i for idx, i in md.storage_data.items() if idx.fqn == "big")
    flip_byte(os.path.join(d, info.relative_path), info.offset + info.length - 30, 0x5A)
    with pytest.raises(CheckpointError, match=f"{info.relative_path}: cannot load it"):
        _ours(d, _targets(sd, "same"), files=files, verify=False)


def test_truncated_file_is_corruption_even_without_crc(tmp_path):
    d, sd = _save(tmp_path)
    files = _manifest(d)
    name = max(files, key=lambda n: files[n].size)
    with open(os.path.join(d, name), "r+b") as f:
        f.truncate(files[name].size - 100)
    with pytest.raises(CheckpointCorruptError, match=f"{name}.*truncated"):
        _ours(d, _targets(sd, "same"), files=files, verify=False)


class _TiedAndViews(torch.nn.Module):
    """Targets that share memory: a tied weight (one tensor, two keys) and buffers that are
    views of another buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(300, 200)
        self.head = torch.nn.Linear(200, 300, bias=False)
        self.head.weight = self.emb.weight
        base = torch.randn(2, 100, 50)
        self.register_buffer("whole", base)
        self.register_buffer("v0", base[0])
        self.register_buffer("v1", base[1])


def test_targets_sharing_memory_are_not_read_into_directly(tmp_path, monkeypatch):
    """A target whose memory another target shares is read into a buffer of the thread's own
    and checksummed there, then copied in: read straight into the target, its bytes could be
    overwritten by another thread's read of the other key between the read and the checksum."""
    from muon_ckpt import CheckpointManager

    torch.manual_seed(0)
    model = _TiedAndViews()
    CheckpointManager(str(tmp_path / "run"), model=model).save(1)
    direct: list[tuple[int, ...]] = []
    chunked = itemread.FileLoad._take_chunked

    def spy(self, fd, target, offset, nbytes):
        direct.append(tuple(target.shape))
        return chunked(self, fd, target, offset, nbytes)

    monkeypatch.setattr(itemread.FileLoad, "_take_chunked", spy)
    CheckpointManager(str(tmp_path / "run"), model=model, io_threads=4).load(1)
    assert direct == [], direct  # every target here shares its memory


def test_damage_in_a_tied_weight_is_found_whatever_the_threads_do(tmp_path):
    """Every flipped byte inside the two stored copies of a tied weight fails a verified load
    with several reading threads (each copy is read by its own thread, usually from another
    file, into the same memory)."""
    from muon_ckpt import CheckpointManager

    torch.manual_seed(0)
    model = _TiedAndViews()
    url = str(tmp_path / "run")
    CheckpointManager(url, model=model).save(1)
    mgr = CheckpointManager(url, model=model, io_threads=4)
    step = os.path.join(url, "step-00000001")
    md = mgr._catalog.checked(1)[1]
    spans = [
        (os.path.join(step, info.relative_path), info.offset, info.length)
        for idx, info in md.storage_data.items()
        if idx.fqn in ("model.emb.weight", "model.head.weight")
    ]
    assert len(spans) == 2
    missed = []
    for path, offset, length in spans:
        for at in range(offset + 1024, offset + length - 1024, 1999):
            flip_byte(path, at)
            try:
                mgr.load(step=1)
                missed.append((path, at))
            except CheckpointCorruptError:
                pass
            finally:
                flip_byte(path, at)
    assert missed == []
    mgr.close()
