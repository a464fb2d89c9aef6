"""Checksums: CRC32C per 1 MiB chunk in new manifests (format 2), with a warned fallback when no
CRC32C package is installed; checkpoints of format 1 (one zlib crc32 per file, the fixture
``tests/fixtures/v1_crc32`` written by muon-ckpt 0.2.0) still load and verify."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import warnings
import zlib

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp

from muon_ckpt import CheckpointCorruptError, CheckpointManager
from muon_ckpt.store import MANIFEST, FileEntry, Storage, _crc, resolve, verify
from muon_ckpt.store.checksums import Checksum, check_chunks, chunk_span
from tests import REPO
from tests._ckpt import TinyNet, make_muon, train

FIXTURE = os.path.join(REPO, "tests", "fixtures", "v1_crc32")
STEP = "step-00000002"


@pytest.fixture
def crc_impl(monkeypatch):
    """Choose the CRC32C implementation of this process for one test (``MUON_CKPT_CRC32C``,
    read at the first use), and forget the choice and its warnings afterwards."""

    def use(name: str) -> None:
        monkeypatch.setenv("MUON_CKPT_CRC32C", name)
        monkeypatch.setattr(_crc, "_chosen", None)
        monkeypatch.setattr(_crc, "_warned", set())

    yield use
    _crc._chosen = None


@pytest.mark.parametrize("impl", ["crc32c", "google-crc32c", "python"])
def test_every_crc32c_implementation_gives_the_standard_values(crc_impl, impl):
    if impl == "google-crc32c":
        pytest.importorskip("google_crc32c")
    crc_impl(impl)
    assert _crc.implementation() == impl
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # python: "very slow", said once
        fn = _crc.crc_function("crc32c")
    assert fn(0, b"123456789") == 0xE3069283  # the CRC-32C check value
    data = bytearray(os.urandom(3000))
    assert fn(fn(0, data[:1234]), memoryview(data)[1234:]) == crc32c.crc32c(data)


def test_chunked_checksum_is_one_crc32c_per_chunk_whatever_the_write_sizes():
    data = os.urandom(10_000)
    c = Checksum("crc32c", 4096)
    for a, b in [(0, 1), (1, 4096), (4096, 4097), (4097, 9000), (9000, 10_000)]:
        c.update(data[a:b])
    want = "".join(f"{crc32c.crc32c(data[i : i + 4096]):08x}" for i in range(0, 10_000, 4096))
    assert c.size == 10_000 and c.hexdigest() == want
    whole = Checksum("crc32", None)
    whole.update(data)
    assert whole.hexdigest() == f"{zlib.crc32(data):08x}"


def test_cut_chunks_are_replayed_from_the_manifest_entry():
    data = os.urandom(10_000)
    w = Checksum("crc32c", 4096)
    w.update(data[:100])
    w.cut()  # a large write begins: its bytes start a chunk
    w.update(data[100:9100])
    w.cut()
    w.update(data[9100:])
    entry = FileEntry.from_dict(w.entry().to_dict())
    assert entry.cuts == [100, 9100]
    assert entry.chunk_starts() == [0, 100, 4196, 8292, 9100]
    bounds = [*entry.chunk_starts(), 10_000]
    want = "".join(f"{crc32c.crc32c(data[a:b]):08x}" for a, b in itertools.pairwise(bounds))
    assert entry.digest == want
    r = Checksum.like(entry)
    r.update(data)  # a reader, in one piece
    assert r.hexdigest() == want
    assert chunk_span(entry, 5000, 5100) == (4196, 8292)
    assert check_chunks(entry, 4196, data[4196:8292]) == []
    assert check_chunks(entry, 8292, data[8292:] + b"") == []


def test_ranged_check_verifies_only_the_chunks_read_and_finds_a_flipped_byte():
    data = bytearray(os.urandom(10_000))
    c = Checksum("crc32c", 4096)
    c.update(data)
    entry = c.entry()
    lo, hi = chunk_span(entry, 5000, 5100)
    assert (lo, hi) == (4096, 8192)
    assert check_chunks(entry, lo, data[lo:hi]) == []
    assert chunk_span(entry, 9000, 10_000) == (8192, 10_000)
    data[8000] ^= 1
    assert check_chunks(entry, lo, data[lo:hi]) == [1]
    assert check_chunks(entry, 0, data[0:4096]) == []


def test_manifest_refuses_a_file_entry_with_the_wrong_number_of_checksums():
    with pytest.raises(ValueError, match="needs 3 checksum"):
        FileEntry.from_dict({"size": 9000, "crc32c": "00000000", "chunk_bytes": 4096})
    with pytest.raises(ValueError, match="one of crc32c or crc32"):
        FileEntry.from_dict({"size": 1})


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _v1_copy(tmp_path) -> str:
    url = str(tmp_path / "v1")
    shutil.copytree(FIXTURE, url)
    return url


def _plain_dcp(path: str) -> dict[str, torch.Tensor]:
    """The fixture's tensors as plain DCP reads them (no muon-ckpt reader, no checks)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(path).read_metadata()
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def test_format_1_checkpoint_loads_and_verifies(tmp_path):
    url = _v1_copy(tmp_path)
    manifest = json.loads(Storage(url).read_bytes(STEP, MANIFEST))
    assert manifest["format_version"] == 1 and "crc32" in manifest["files"][".metadata"]
    assert verify(resolve(Storage(url))).ok
    want = _plain_dcp(os.path.join(url, STEP))
    model = TinyNet()
    opt = make_muon(model)
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        assert mgr.load() == 2
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), want[f"model.{name}"]), name
    names = {id(p): n for n, p in model.named_parameters()}
    assert len(opt.state) == len(names)
    for p, st in opt.state.items():
        for key, v in st.items():
            assert torch.equal(v, want[f"optim.state.{names[id(p)]}.{key}"]), key
    train(model, opt, 1, seed=3)  # and training goes on from it


def test_a_flipped_byte_in_a_format_1_checkpoint_is_detected(tmp_path):
    url = _v1_copy(tmp_path)
    path = os.path.join(url, STEP, "__0_3.distcp")
    with open(path, "r+b") as f:
        f.seek(20_000)
        b = f.read(1)
        f.seek(20_000)
        f.write(bytes([b[0] ^ 0x10]))
    res = verify(resolve(Storage(url)))
    assert res.problems == [
        f"__0_3.distcp: crc32 {zlib.crc32(_read(path)):08x}, manifest says "
        f"51d5d625 (content changed)"
    ]
    model = TinyNet()
    with (
        CheckpointManager(url, model=model, optimizer=make_muon(model)) as mgr,
        pytest.raises(CheckpointCorruptError, match=r"__0_3\.distcp: file is corrupt.*crc32"),
    ):
        mgr.load(step=2)


def test_without_a_crc32c_package_saves_use_crc32_with_one_warning_and_still_verify(
    tmp_path, crc_impl
):
    crc_impl("python")  # what a process without crc32c / google-crc32c gets
    url = str(tmp_path / "run")
    torch.manual_seed(0)
    model = TinyNet()
    opt = make_muon(model)
    train(model, opt, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(url, model=model, optimizer=opt) as mgr:
            mgr.save(1)
            mgr.save(2)
    said = [str(w.message) for w in caught if "CRC32C package" in str(w.message)]
    assert len(said) == 1 and "zlib's crc32" in said[0]
    files = json.loads(Storage(url).read_bytes("step-00000002", MANIFEST))["files"]
    assert all("crc32" in e and "crc32c" not in e for e in files.values())
    assert verify(resolve(Storage(url))).ok
    name = max((n for n in files if n.endswith(".distcp")), key=lambda n: files[n]["size"])
    path = os.path.join(url, "step-00000002", name)
    data = bytearray(_read(path))
    data[len(data) // 2] ^= 1
    with open(path, "wb") as f:
        f.write(data)
    with (
        CheckpointManager(url, model=model, optimizer=opt) as mgr,
        pytest.raises(CheckpointCorruptError, match=rf"{name}: file is corrupt"),
    ):
        mgr.load(step=2)


def test_a_crc32c_checkpoint_read_without_a_crc32c_package_is_verified_in_python(
    tmp_path, crc_impl
):
    url = str(tmp_path / "run")
    model = TinyNet()
    opt = make_muon(model)
    train(model, opt, 1)
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        mgr.save(1)
    crc_impl("python")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert verify(resolve(Storage(url))).ok
        with CheckpointManager(url, model=model, optimizer=opt) as mgr:
            assert mgr.load() == 1
    said = [str(w.message) for w in caught if "pure-Python CRC32C" in str(w.message)]
    assert len(said) == 1 and 'verify="size"' in said[0]
