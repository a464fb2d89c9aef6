"""Lossless compression (``compression="zstd"``, muon_ckpt/store/_codec.py): tensors of 64 KiB
and more are stored byte-grouped and zstd-compressed by the writer threads, and expanded by
the reader's. Every load is bitwise; the manifest's CRC32C covers the stored (compressed)
bytes, so a flipped byte in a compressed item is caught before it is expanded.

Real saves and loads (local directory, ``memory://``, moto S3, 2 gloo ranks).
"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
import sys
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from muon_ckpt import CheckpointCorruptError, CheckpointError, CheckpointManager
from muon_ckpt.cli import main
from muon_ckpt.store import MANIFEST, Catalog, Storage, step_dirname
from muon_ckpt.store.codec import DESCRIPTOR, BadEncoding, Encoder, decode, extension_registry
from tests._ckpt import flip_byte
from tests._dist import run_on_ranks


class _Mixed(nn.Module):
    """fp32 and bf16 weights (one of several frames, one of an odd size), a zero matrix (the
    most compressible: its ratio is capped), an int64 buffer, a tensor too small to compress."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.big = nn.Parameter(torch.randn(700, 512, generator=g))  # 1.4 MB: two frames
        self.bf = nn.Parameter(torch.randn(301, 257, generator=g).bfloat16())
        self.zeros = nn.Parameter(torch.zeros(512, 512))
        self.small = nn.Parameter(torch.randn(10, generator=g))
        self.register_buffer("ids", torch.arange(20000, dtype=torch.int64))


def _trained(steps: int = 1) -> tuple[_Mixed, torch.optim.Optimizer]:
    m = _Mixed()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    return m, opt


def _state(m: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in m.state_dict().items()}
    for n, p in m.named_parameters():
        for k, v in opt.state[p].items():
            out[f"optim.{n}.{k}"] = v.detach().clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _load(
    url: str, step: int | None, opts: dict | None = None, **kw: Any
) -> tuple[int | None, dict[str, torch.Tensor]]:
    """What ``load(step=step)`` (None: the newest it can) loads into a fresh model: the
    step it loaded, and the state."""
    m, opt = _trained(0)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(7)
    opt.step()  # (states to load into: AdamW makes them at its first step)
    mgr = CheckpointManager(url, model=m, optimizer=opt, storage_options=opts, **kw)
    return mgr.load(step=step), _state(m, opt)


def _loaded(url: str, step: int, opts: dict | None = None) -> dict[str, torch.Tensor]:
    got, state = _load(url, step, opts)
    assert got == step
    return state


def _encoded(st: Storage, step: int) -> set[str]:
    """The keys whose items ``step`` stores compressed."""
    _, md = Catalog(st).checked(step)
    return {i.fqn for i, info in md.storage_data.items() if info.transform_descriptors}


def _manifest(st: Storage, step: int) -> dict[str, Any]:
    return json.loads(st.read_bytes(Catalog(st).dirname(step), MANIFEST))


def _stored(st: Storage, step: int) -> int:
    return sum(e["size"] for e in _manifest(st, step)["files"].values())


# ---------------------------------------------------------------------- the codec alone
def _encode(data: bytes, stride: int, writes: int = 1) -> bytes:
    out = io.BytesIO()
    enc = Encoder(out, stride)
    step = -(-len(data) // writes) or 1
    for i in range(0, len(data), step):  # (several writes: frames across write boundaries)
        enc.write(data[i : i + step])
    enc.finish()
    assert enc.raw == len(data) and enc.stored == len(out.getvalue())
    return out.getvalue()


@pytest.mark.parametrize(
    "dtype,n,writes",
    [
        (torch.float32, 700 * 512 + 3, 1),  # two frames, the second short
        (torch.bfloat16, 301 * 257, 3),
        (torch.float64, 65537, 7),
        (torch.uint8, 3 << 20, 2),  # random bytes: frames stored as they are (mode 0)
        (torch.float32, 0, 1),
    ],
)
def test_the_codec_round_trips_bitwise(dtype, n, writes):
    g = torch.Generator().manual_seed(n)
    if dtype.is_floating_point:
        t = torch.randn(n, generator=g).to(dtype)
    else:
        t = torch.randint(0, 256, (n,), generator=g, dtype=dtype)
    data = t.view(torch.uint8).numpy().tobytes()
    enc = _encode(data, t.element_size(), writes)
    assert bytes(decode(enc, len(data), "f", "k")) == data
    if dtype == torch.bfloat16:
        assert len(enc) < 0.9 * len(data)  # (grouped, bf16 normal values shrink)
    if dtype == torch.uint8:  # every frame as it is: 6 bytes of header, 13 per frame
        assert len(enc) == len(data) + 6 + 13 * 3
    if data:
        with pytest.raises(BadEncoding, match="expands beyond the"):
            decode(enc, len(data) - 1, "f", "k")


def _damaged(how: str) -> bytes:
    data = torch.randn(300_000, generator=torch.Generator().manual_seed(1))
    item = bytearray(_encode(data.view(torch.uint8).numpy().tobytes(), 4))
    if how == "magic":
        item[:4] = b"PK\x03\x04"
    elif how == "frame_size":
        item[6] ^= 1  # the first frame's raw length
    elif how == "mode":
        item[14] = 2
    elif how == "crc":
        item[15] ^= 1  # (6 bytes of header, then the frame's raw, stored length and mode)
    elif how == "payload":
        item[len(item) // 3] ^= 0x10  # a byte inside the first zstd frame
    elif how == "truncated":
        del item[len(item) // 2 :]
    elif how == "tail":
        item += b"\0" * 5  # bytes after the last frame: no frame header
    return bytes(item)


@pytest.mark.parametrize(
    "how", ["magic", "frame_size", "mode", "crc", "payload", "truncated", "tail"]
)
def test_a_damaged_encoding_is_refused_naming_the_file_and_key(how):
    with pytest.raises(BadEncoding, match=r"^dir/file: cannot load it: the compressed item of 'k'"):
        decode(_damaged(how), 2 << 20, "dir/file", "k")


# ---------------------------------------------------------------------- what is written
def test_compressed_steps_load_bitwise_on_every_backend(storage_url):
    """Two steps with compression on (the second refers to the unchanged int64 buffer and
    zeros' moments of the first): format 4; the tensors of 64 KiB and more are compressed,
    the small one is not; fewer bytes than without; each step loads bitwise and verifies."""
    url, opts = storage_url
    m, opt = _trained()
    mgr = CheckpointManager(url, model=m, optimizer=opt, compression="zstd", storage_options=opts)
    want = {}
    for step in (1, 2):
        mgr.save(step)
        want[step] = _state(m, opt)
        with torch.no_grad():
            m.big.add_(1.0)
            m.bf.mul_(2)
    mgr.close()
    plain = url.rstrip("/") + "-plain"
    m2, opt2 = _trained()
    with CheckpointManager(plain, model=m2, optimizer=opt2, storage_options=opts) as p:
        p.save(1)
    st = Storage(url, opts)
    assert _manifest(st, 2)["format_version"] == 4
    enc = _encoded(st, 1)
    assert {"model.big", "model.bf", "model.zeros", "model.ids"} <= enc, enc
    assert "optim.state.big.exp_avg_sq" in enc and "model.small" not in enc
    assert _stored(st, 1) < 0.8 * _stored(Storage(plain, opts), 1)
    for step in (1, 2):
        _same(_loaded(url, step, opts), want[step])
    if not opts:  # (the CLI's options: local only here)
        assert main(["verify", url]) == 0


def test_a_run_turns_compression_on_and_off_and_every_step_loads(tmp_path):
    """Step 1 plain (format 3); step 2 compressed (format 4): the two tensors that changed
    are compressed, the rest refer to step 1's plain items; step 3 plain again: the one
    that changed is plain, the bf16 one it refers to is step 2's compressed item (format 4
    still). A prune to the newest step keeps what it refers to."""
    url = str(tmp_path / "run")
    m, opt = _trained()
    want = {}
    for step, how in ((1, None), (2, "zstd"), (3, None)):
        with CheckpointManager(url, model=m, optimizer=opt, compression=how) as mgr:
            if step > 1:
                assert mgr.load() == step - 1
            with torch.no_grad():
                m.big.add_(1.0)
                if step == 2:
                    m.bf.mul_(2)
            mgr.save(step)
        want[step] = _state(m, opt)
    st = Storage(url)
    assert [_manifest(st, s)["format_version"] for s in (1, 2, 3)] == [3, 4, 4]
    assert [_encoded(st, s) for s in (1, 2, 3)] == [set(), {"model.big", "model.bf"}, {"model.bf"}]
    for step in (1, 2, 3):
        _same(_loaded(url, step), want[step])
    assert main(["prune", url, "--keep", "1"]) == 0
    assert Catalog(st).committed_steps() == [3]
    _same(_loaded(url, 3), want[3])


def test_compression_with_dedup_off_writes_every_step_into_its_directory(tmp_path):
    url = str(tmp_path / "run")
    m, opt = _trained()
    with CheckpointManager(url, model=m, optimizer=opt, compression="zstd", dedup=False) as mgr:
        mgr.save(1)
    st = Storage(url)
    man = _manifest(st, 1)
    assert man["format_version"] == 4 and all("/" not in n for n in man["files"])
    _same(_loaded(url, 1), _state(m, opt))


# ---------------------------------------------------------------------- damage and trust
def test_a_flipped_byte_in_a_compressed_item_is_caught(tmp_path):
    """The CRC32C covers the stored bytes: one flipped bit inside a zstd frame fails the
    step's load (naming the file) and verify, before anything is expanded; the older step
    loads."""
    url = str(tmp_path / "run")
    m, opt = _trained()
    with CheckpointManager(url, model=m, optimizer=opt, compression="zstd", dedup=False) as mgr:
        mgr.save(1)
        mgr.save(2)
    st = Storage(url)
    _, md = Catalog(st).checked(2)
    info = next(i for k, i in md.storage_data.items() if k.fqn == "model.big")
    assert info.transform_descriptors == [DESCRIPTOR]
    path = os.path.join(url, step_dirname(2), info.relative_path)
    flip_byte(path, info.offset + info.length // 2)
    m2, opt2 = _trained(0)
    opt2.step()
    with pytest.raises(CheckpointCorruptError, match=info.relative_path):
        CheckpointManager(url, model=m2, optimizer=opt2).load(step=2)
    assert main(["verify", url, "--step", "2"]) == 1
    _same(_loaded(url, 1), _state(m, opt))


def test_a_corrupt_compressed_frame_is_named_and_load_falls_back(storage_url, caplog):
    """A flipped byte inside a compressed item of the newest step, loaded with
    verify="size" (no checksum of the stored bytes: the frame's CRC32C of the bytes it
    expands to, or zstd itself, catches it): load(step=2) raises CheckpointCorruptError
    naming the file and the key; load() skips the step with a WARNING, as for any damaged
    step, and loads step 1 bitwise (with the default verify the file's CRC32C catches it
    first: test_a_flipped_byte_in_a_compressed_item_is_caught)."""
    url, opts = storage_url
    m, opt = _trained()
    mgr = CheckpointManager(url, model=m, optimizer=opt, compression="zstd", storage_options=opts)
    mgr.save(1)
    want = _state(m, opt)
    with torch.no_grad():
        m.big.add_(1.0)
    mgr.save(2)
    mgr.close()
    st = Storage(url, opts)
    _, md = Catalog(st).checked(2)
    info = next(i for k, i in md.storage_data.items() if k.fqn == "model.big")
    assert info.transform_descriptors == [DESCRIPTOR]
    name = posixpath.normpath(posixpath.join(step_dirname(2), info.relative_path))
    data = bytearray(st.read_bytes(name))
    data[info.offset + info.length // 2] ^= 0x10
    st.write_bytes(bytes(data), name)
    with pytest.raises(CheckpointCorruptError) as e:
        _load(url, 2, opts, verify="size")
    msg = str(e.value)
    assert posixpath.basename(name) in msg and "'model.big'" in msg, msg
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        got, state = _load(url, None, opts, verify="size")
    assert got == 1
    _same(state, want)
    assert any("skipping step 2" in r.getMessage() for r in caplog.records)


def test_plain_dcp_reads_a_compressed_step_with_muon_ckpts_registry(tmp_path):
    """Outside readers: DCP's FileSystemReader, and so dcp_to_torch_save, refuse the encoding
    ("Unknown extension"); given ``store.codec.extension_registry()``, dcp.load reads it
    exactly."""
    url = str(tmp_path / "run")
    m, opt = _trained()
    with CheckpointManager(url, model=m, optimizer=opt, compression="zstd", dedup=False) as mgr:
        mgr.save(1)
    path = os.path.join(url, step_dirname(1))
    sd = {f"model.{k}": torch.empty_like(v) for k, v in m.state_dict().items()}
    with pytest.raises(BaseException, match="Unknown extension"):  # (DCP's own exception type)
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    with pytest.raises(BaseException, match="Unknown extension"):
        dcp_to_torch_save(path, str(tmp_path / "out.pt"))
    reader = dcp.FileSystemReader(path, _extension_registry=extension_registry())
    dcp.load(sd, storage_reader=reader, no_dist=True)
    for k, v in m.state_dict().items():
        assert torch.equal(sd[f"model.{k}"], v), k


def test_compression_needs_zstandard_and_says_how_to_get_it(tmp_path, monkeypatch):
    """Without zstandard: a manager with compression="zstd" is refused at construction; a
    load of a compressed step fails saying what to install, and does not fall back to the
    older plain step (the step is not damaged: this host cannot read it)."""
    url = str(tmp_path / "run")
    m, opt = _trained()
    with CheckpointManager(url, model=m, optimizer=opt, dedup=False) as mgr:
        mgr.save(1)
    with CheckpointManager(url, model=m, optimizer=opt, compression="zstd") as mgr:
        assert mgr.load() == 1
        mgr.save(2)
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'muon-ckpt\[zstd\]'"):
        CheckpointManager(str(tmp_path / "other"), model=m, compression="zstd")
    assert not os.path.exists(tmp_path / "other")
    for step in (2, None):
        with pytest.raises(CheckpointError, match=r"muon-ckpt\[zstd\]") as e:
            _load(url, step)
        assert not isinstance(e.value, CheckpointCorruptError)
    _same(_loaded(url, 1), _state(*_trained()))
    with pytest.raises(ValueError, match="compression must be one of"):
        CheckpointManager(url, model=m, compression="lz4")


# ---------------------------------------------------------------------- resharded reads
def test_a_compressed_step_loads_resharded_on_2_ranks(tmp_path, s3_bucket):
    """Saved whole in one process (local and moto S3), loaded on 2 ranks that each take half
    of every stored tensor (FSDP2's Shard(0)): the whole item expanded, then its rows;
    with read_once one rank reads it and sends it to the other."""
    bucket, opts = s3_bucket
    m, _ = _trained()
    urls = [(str(tmp_path / "run"), {}), (f"s3://{bucket}/run", opts)]
    for url, o in urls:
        with CheckpointManager(url, model=m, compression="zstd", storage_options=o) as mgr:
            mgr.save(1)
    want = {f"model.{k}": v for k, v in m.state_dict().items()}
    run_on_ranks(_body_resharded, 2, urls, want)


def _body_resharded(rank: int, world: int, urls: list, want: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for url, opts in urls:
        for read_once in (False, True):
            m = _Mixed()
            for name, p in list(m.named_parameters()):
                d = distribute_tensor(torch.full_like(p.detach(), 7), mesh, [Shard(0)])
                setattr(m, name, nn.Parameter(d))
            mgr = CheckpointManager(url, model=m, storage_options=opts, read_once=read_once)
            assert mgr.load() == 1
            for k, v in m.state_dict().items():
                full = v.full_tensor() if hasattr(v, "full_tensor") else v
                assert torch.equal(full, want[f"model.{k}"]), (url, read_once, k)
            mgr.close()
