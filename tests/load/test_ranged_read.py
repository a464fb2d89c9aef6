"""Ranged local reads (muon_ckpt/load/_chunk_spans.py): a rank that does not check a file whole reads
only the rows of each stored item that its slice takes, and checks exactly those bytes (with
the item's zip header and directory) against the manifest's per-chunk checksums.

A plain ``dcp.save`` of a few 16 MiB matrices, a format-2 manifest computed for it, and
``VerifyingReader`` driven with DCP's own read items for a slice of rows (what a resharded
rank's planner asks for), as rank 1 of 2: the file belongs to rank 0, which checks it whole.
"""

from __future__ import annotations

import io
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from muon_ckpt import CheckpointCorruptError
from muon_ckpt.load import VerifyingReader
from muon_ckpt.store import FileEntry, Storage, resolve, verify
from muon_ckpt.store._layout import MANIFEST, Manifest
from muon_ckpt.store.checksums import Checksum
from tests._ckpt import flip_byte

ROWS, COLS = 4096, 1024  # fp32: 16 MiB per item, sixteen 1 MiB checksum chunks
NAMES = ("a", "b", "c")
SLICE = (1365, 2730)  # rank 1's rows of 3 (a 2 -> 3 reshard's middle rank)


class _SlicePlanner:
    """Resolves each read item to its part of a target holding rows ``SLICE`` (the role of
    DCP's planner for a resharded rank)."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets

    def resolve_tensor(self, req: Any) -> torch.Tensor:
        t = self.targets[req.dest_index.fqn]
        for dim, (o, n) in enumerate(zip(req.dest_offsets, req.lengths)):
            t = t.narrow(dim, o, n)
        return t

    def commit_tensor(self, req: Any, tensor: torch.Tensor) -> None:
        pass


def _save(
    tmp_path, names: tuple[str, ...] = NAMES, extra: dict[str, torch.Tensor] | None = None
) -> tuple[str, dict[str, torch.Tensor], dict[str, FileEntry]]:
    """``names`` as 16 MiB matrices (returned) and ``extra`` saved in one DCP file, and a
    format-2 manifest of it."""
    d = str(tmp_path / "step")
    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(ROWS, COLS, generator=g) for n in names}
    dcp.save(
        {**sd, **(extra or {})},
        storage_writer=dcp.FileSystemWriter(d, thread_count=1),
        no_dist=True,
    )
    files = {}
    for name in sorted(os.listdir(d)):
        c = Checksum("crc32c", 1 << 20)
        with open(os.path.join(d, name), "rb") as f:
            c.update(f.read())
        files[name] = c.entry()
    return d, sd, files


def _load_rows(
    d: str,
    files: dict[str, FileEntry],
    rank: int,
    url: str | None = None,
    names: tuple[str, ...] = NAMES,
    verify: bool = True,
    options: dict | None = None,
) -> tuple[dict, VerifyingReader]:
    """Rows ``SLICE`` of ``names``, read as ``rank`` of 2 from ``url`` (default: ``d``)."""
    md = dcp.FileSystemReader(d).read_metadata()
    reader = VerifyingReader(
        Storage(url or d, options or {}),
        files,
        metadata=md,
        rank=rank,
        world_size=2,
        io_threads=1,
        check_unread=False,
        verify_crc=verify,
    )
    reader.set_up_storage_reader(md, is_coordinator=True)
    lo, hi = SLICE
    targets = {n: torch.full((hi - lo, COLS), float("nan")) for n in names}
    chunk = ChunkStorageMetadata(offsets=torch.Size([lo, 0]), sizes=torch.Size([hi - lo, COLS]))
    items = []
    for n in names:
        items += create_read_items_for_chunk_list(n, md.state_dict_metadata[n], [chunk])
    reader.read_data(LoadPlan(items), _SlicePlanner(targets)).wait()
    return targets, reader


def _data_file(files: dict[str, FileEntry]) -> str:
    return next(n for n in files if n.endswith(".distcp"))


def _check_rows_only(got: dict, sd: dict, reader) -> None:
    """``got`` holds rank 1's rows (bitwise), and ``reader`` read little more than them."""
    lo, hi = SLICE
    for n in NAMES:
        assert torch.equal(got[n], sd[n][lo:hi]), n
    needed = len(NAMES) * (hi - lo) * COLS * 4
    whole_items = len(NAMES) * ROWS * COLS * 4
    # The rows, widened to whole 1 MiB chunks (<= 2 MiB more: this manifest has no cuts, so
    # the grid runs from the file's start), and the chunks of each item's zip header and
    # directory (<= 2 MiB more).
    assert needed <= reader.bytes_read <= needed + len(NAMES) * 4 * (1 << 20)
    assert reader.bytes_read < 0.6 * whole_items


def test_a_rank_that_does_not_own_a_file_reads_only_the_rows_it_needs(tmp_path):
    d, sd, files = _save(tmp_path)
    got, reader = _load_rows(d, files, rank=1)
    _check_rows_only(got, sd, reader)
    # The file's owner reads (and checks) it whole.
    got0, owner = _load_rows(d, files, rank=0)
    lo, hi = SLICE
    assert torch.equal(got0["b"], sd["b"][lo:hi])
    assert owner.bytes_read >= files[_data_file(files)].size


@pytest.mark.parametrize("where", ["rows read", "item header"])
def test_corruption_in_the_bytes_a_rank_reads_is_detected_by_that_rank(tmp_path, where):
    d, _, files = _save(tmp_path)
    name = _data_file(files)
    md = dcp.FileSystemReader(d).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "b")
    # An item's tensor bytes start within its first 4 KiB (zip header, 64-byte aligned).
    at = info.offset + 64 if where == "item header" else info.offset + 4096 + SLICE[0] * COLS * 4
    flip_byte(os.path.join(d, name), at)
    what = "file is corrupt: the crc32c" if where == "rows read" else "file is corrupt"
    with pytest.raises(CheckpointCorruptError, match=rf"{name}: {what}"):
        _load_rows(d, files, rank=1)


def test_corruption_outside_the_bytes_read_is_left_to_the_owner_and_a_full_verify(tmp_path):
    d, sd, files = _save(tmp_path)
    name = _data_file(files)
    md = dcp.FileSystemReader(d).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "c")
    flip_byte(os.path.join(d, name), info.offset + 3600 * COLS * 4)  # rank 1 reads rows 1365-2729
    got, _ = _load_rows(d, files, rank=1)
    lo, hi = SLICE
    for n in NAMES:
        assert torch.equal(got[n], sd[n][lo:hi]), n
    with pytest.raises(CheckpointCorruptError, match=rf"{name}: file is corrupt"):
        _load_rows(d, files, rank=0)  # the owner checks every byte
    Storage(d).write_bytes(
        Manifest(1, 1, files, "t", torch.__version__, "test").to_json(), MANIFEST
    )
    res = verify(resolve(Storage(d)))
    assert [p.split(":")[0] for p in res.problems] == [name]


def _body_save_sharded(rank: int, world: int, url: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muon_ckpt import CheckpointManager

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    with CheckpointManager(url, model=model) as m:
        m.save(1)


def _body_load_sharded(rank: int, world: int, url: str) -> tuple[int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muon_ckpt import CheckpointManager

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]))
    with CheckpointManager(url, model=model) as m:
        assert m.load() == 1
        got = m.last_load_bytes_read
    want = distribute_tensor(full, mesh, [Shard(0)]).to_local()
    assert torch.equal(model.w.to_local(), want)
    return got, want.numel() * 4


def test_a_resharded_rank_reads_fewer_bytes_than_the_items_it_takes_rows_from(tmp_path):
    """Saved on 2 ranks (one 8 MiB item per rank), loaded on 3: rank 2 owns no file and takes
    rows 2731-4095, all from rank 1's item; it reads those rows (and the chunks around them),
    not the item."""
    from tests._dist import run_on_ranks

    url = str(tmp_path / "run")
    run_on_ranks(_body_save_sharded, 2, url)
    (_, _), (_, _), (read2, rows2) = run_on_ranks(_body_load_sharded, 3, url)
    item = ROWS // 2 * COLS * 4
    # The rows; the chunk grid starts at the item's tensor bytes (the writer cut there) and
    # its end is a chunk end, so only the chunk holding the first row adds bytes (< 1 MiB),
    # with the small chunks of the zip records around the tensor.
    assert rows2 <= read2 <= rows2 + (1 << 20) + (64 << 10), (read2, rows2)
    assert read2 < item, (read2, item)


def _to_memory(d: str) -> str:
    """A copy of directory ``d`` on fsspec's memory:// filesystem (a remote filesystem here)."""
    import uuid

    import fsspec

    url = f"memory://ranged-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    for name in os.listdir(d):
        with open(os.path.join(d, name), "rb") as f:
            fs.pipe(f"{url}/{name}", f.read())
    return url


@pytest.mark.parametrize("verify", [True, False])
def test_a_remote_rank_reads_only_the_rows_it_needs(tmp_path, verify):
    """On a remote filesystem too, a rank that takes rows of items it does not check whole
    reads each item's zip records and its rows (widened to whole chunks when checking), not
    the items."""
    d, sd, files = _save(tmp_path)
    got, reader = _load_rows(d, files, rank=1, url=_to_memory(d), verify=verify)
    _check_rows_only(got, sd, reader)


def _to_s3(d: str, bucket: str, opts: dict) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    for name in sorted(os.listdir(d)):
        fs.put_file(os.path.join(d, name), f"{bucket}/step/{name}")
    return f"s3://{bucket}/step"


def _count_requests(monkeypatch) -> list[tuple[str, int]]:
    """Every ranged GET s3fs makes from here on: (object key, bytes)."""
    import s3fs

    requests: list[tuple[str, int]] = []
    fetch = s3fs.core.S3File._fetch_range

    def spy(self, start, end):
        requests.append((self.path.rsplit("/", 1)[-1], end - start))
        return fetch(self, start, end)

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", spy)
    return requests


@pytest.mark.parametrize("verify", [True, False])
def test_a_rank_reading_rows_from_s3_fetches_only_them(tmp_path, s3_bucket, monkeypatch, verify):
    """What crosses the network, counted where s3fs makes its requests: the rows and the
    zip records of each item (whole chunks when checking), not a read-ahead block after each
    (fsspec's default would fetch 50 MiB after every read)."""
    d, sd, files = _save(tmp_path)
    bucket, opts = s3_bucket
    url = _to_s3(d, bucket, opts)
    requests = _count_requests(monkeypatch)
    got, reader = _load_rows(d, files, rank=1, url=url, verify=verify, options=opts)
    _check_rows_only(got, sd, reader)
    assert sum(n for _, n in requests) == reader.bytes_read, requests


def test_a_file_read_whole_from_s3_is_one_request(tmp_path, s3_bucket, monkeypatch):
    """The owner of a file checks it whole, streaming it front to back: one request for the
    whole file (under STREAM_BLOCK), not one per fsspec block (two for this file of 80 MiB
    with s3fs's 50 MiB: a read-ahead block after the first item, then the rest)."""
    names = (*NAMES, "d", "e")
    d, sd, files = _save(tmp_path, names)
    bucket, opts = s3_bucket
    url = _to_s3(d, bucket, opts)
    requests = _count_requests(monkeypatch)
    got, _ = _load_rows(d, files, rank=0, url=url, names=names, options=opts)
    lo, hi = SLICE
    assert torch.equal(got["b"], sd["b"][lo:hi])
    name = _data_file(files)
    assert [n for f, n in requests if f == name] == [files[name].size], requests


def test_remote_part_reads_load_items_without_torch_load_and_check_their_chunks(
    tmp_path, monkeypatch
):
    """Remote items are parsed in memory, never torch.load'ed: those of a file read whole
    (every item: streamed with the file's checksum) and those of a file needed in part (two
    of three items: one ranged read each, widened to whole checksum chunks and checked)."""
    d, sd, files = _save(tmp_path)

    def no_torch_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.load called for a plain tensor item")

    monkeypatch.setattr(torch, "load", no_torch_load)
    lo, hi = SLICE
    for names in (NAMES, ("a", "b")):
        got, _ = _load_rows(d, files, rank=1, url=_to_memory(d), names=names)
        for n in names:
            assert torch.equal(got[n], sd[n][lo:hi]), n
    name = _data_file(files)
    md = dcp.FileSystemReader(d).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "b")
    flip_byte(os.path.join(d, name), info.offset + 4096 + lo * COLS * 4)
    with pytest.raises(CheckpointCorruptError, match=rf"{name}: file is corrupt: the crc32c"):
        _load_rows(d, files, rank=1, url=_to_memory(d), names=("a", "b"))


def test_whole_items_beside_sliced_ones_are_read_ahead_together(tmp_path, s3_bucket, monkeypatch):
    """A file with items read in part and 64 small items read whole: the whole ones are
    fetched together (one request for their run), not one request each, and nothing is
    fetched that the load does not read."""
    g = torch.Generator().manual_seed(1)
    small = {f"s{i:03d}": torch.randn(1024, generator=g) for i in range(64)}
    d, sd, files = _save(tmp_path, extra=small)
    bucket, opts = s3_bucket
    url = _to_s3(d, bucket, opts)
    requests = _count_requests(monkeypatch)
    md = dcp.FileSystemReader(d).read_metadata()
    reader = VerifyingReader(
        Storage(url, opts),
        files,
        metadata=md,
        rank=1,
        world_size=2,
        io_threads=1,
        check_unread=False,
    )
    reader.set_up_storage_reader(md, is_coordinator=True)
    lo, hi = SLICE
    targets = {n: torch.full((hi - lo, COLS), float("nan")) for n in NAMES}
    targets |= {k: torch.full_like(v, float("nan")) for k, v in small.items()}
    rows = ChunkStorageMetadata(offsets=torch.Size([lo, 0]), sizes=torch.Size([hi - lo, COLS]))
    items = []
    for n in NAMES:
        items += create_read_items_for_chunk_list(n, md.state_dict_metadata[n], [rows])
    for k in small:
        whole = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1024]))
        items += create_read_items_for_chunk_list(k, md.state_dict_metadata[k], [whole])
    reader.read_data(LoadPlan(items), _SlicePlanner(targets)).wait()
    for n in NAMES:
        assert torch.equal(targets[n], sd[n][lo:hi]), n
    for k, v in small.items():
        assert torch.equal(targets[k], v), k
    data = _data_file(files)
    fetched = [n for f, n in requests if f == data]
    # each sliced item: its two ends and its rows (at most 3 requests); the small ones: one
    assert len(fetched) <= 3 * len(NAMES) + 1, fetched
    # No more than the rows and the small items, widened to whole 1 MiB chunks (the small
    # items share chunks, each read again out of the one fetch: bytes_read counts each).
    needed = len(NAMES) * (hi - lo) * COLS * 4 + sum(v.numel() * 4 for v in small.values())
    assert sum(fetched) <= min(reader.bytes_read, needed + 4 * len(NAMES) * (1 << 20) + (2 << 20))


def test_read_ahead_through_a_caching_wrapper(tmp_path, s3_bucket):
    """A chained URL whose caching layer sets fsspec's cache itself (``blockcache::s3://``)
    reads the same bytes with and without ``ahead`` (the wrapper refuses ``cache_type``)."""
    bucket, opts = s3_bucket
    payload = os.urandom(3 << 20)
    url = f"blockcache::s3://{bucket}/run"
    st = Storage(url, {"s3": opts, "blockcache": {"cache_storage": str(tmp_path / "cache")}})
    st.write_bytes(payload, "f")
    for ahead in (None, [(0, len(payload))], []):
        with st.open("f", ahead=ahead) as f:
            f.seek(1000)
            assert f.read(5000) == payload[1000:6000], ahead
            assert f.read() == payload[6000:], ahead


def test_read_ahead_fetches_inside_its_spans_only(monkeypatch):
    """ReadAhead over a file that records each fetch: inside a span, fetches of a block
    (STREAM_BLOCK, here 100 bytes) or of the read when it asks for more, never past the
    span's end; outside, exactly the bytes read; the same bytes as the file either way."""
    from muon_ckpt.store import _readahead

    monkeypatch.setattr(_readahead, "STREAM_BLOCK", 100)
    payload = bytes(range(256)) * 4  # 1024 bytes
    fetches: list[tuple[int, int]] = []

    class Raw(io.BytesIO):
        def read(self, n=-1):
            at = self.tell()
            out = super().read(n)
            fetches.append((at, len(out)))
            return out

    f = _readahead.ReadAhead(Raw(payload), [(0, 250), (600, 700)])
    got = [f.read(30) for _ in range(9)]  # 0-270: blocks 0-100, 100-200, 200-250; then 250-270
    assert b"".join(got) == payload[:270]
    assert fetches == [(0, 100), (100, 100), (200, 50), (250, 20)], fetches
    assert isinstance(got[0], memoryview)  # a view into the block, not a copy
    fetches.clear()
    f.seek(600)
    assert f.read(150) == payload[600:750]  # asks past the span: fetches what it asks
    assert fetches == [(600, 150)], fetches
    fetches.clear()
    f.seek(610)
    assert f.read(10) == payload[610:620] and fetches == []  # still in the last block
    f.seek(-24, io.SEEK_END)
    assert f.read() == payload[-24:] and f.read(5) == b""
