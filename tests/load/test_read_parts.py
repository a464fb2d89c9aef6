"""Local files read in parts on several threads (``_split`` in muon_ckpt/load/_reader.py).

A checked file is split at item starts (or chunk starts between items) into parts that run on
their own threads, each checksumming whole chunks around its items against the manifest's
per-chunk checksums. The parts' windows must cover the file, every byte a part loads must lie
in its own window, and loads in parts must give the same bits as DCP's reader, with a damaged
byte anywhere in the file (an item, a gap, a border chunk, the end) still caught.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

import muon_ckpt.load._local_files as itemread
import muon_ckpt.load._reader as reader_mod
from muon_ckpt import CheckpointCorruptError, CheckpointManager
from muon_ckpt.store import FileEntry, Storage
from muon_ckpt.store.checksums import Checksum, chunk_span
from tests._ckpt import TinyNet, file_layout, flip_byte, make_muon, muon_state_sd, train
from tests.load.test_itemread import _bits, _ours

CHUNK = 64 << 10  # the manifests' chunk size here: many chunks in a small file


def _entry(data: bytes, cuts: list[int]) -> FileEntry:
    """A chunked CRC32C entry of ``data``, with chunks cut short at ``cuts`` (as a writer
    does around each tensor's bytes)."""
    c = Checksum("crc32c", CHUNK)
    at = 0
    for cut in sorted(cuts):
        c.update(data[at:cut])
        c.cut()
        at = cut
    c.update(data[at:])
    return c.entry()


def _check_split(spans: list[tuple[int, int]], entry: FileEntry, part_bytes: int) -> int:
    loads = {off: (n, []) for off, n in spans}
    parts = reader_mod._split(loads, {}, entry, part_bytes)
    starts = set(entry.chunk_starts()) | {entry.size}
    # windows: whole chunks, in order, covering the file, neighbours sharing <= one chunk
    windows = [w for _, w, _ in parts]
    assert windows[0][0] == 0 and windows[-1][1] == entry.size
    for lo, hi in windows:
        assert lo in starts and hi in starts and lo <= hi
    for (_, a_hi), (b_lo, _) in itertools.pairwise(windows):
        assert b_lo <= a_hi, "a gap between two parts' windows"
        if b_lo < a_hi:  # the one chunk at their border
            assert chunk_span(entry, b_lo, b_lo + 1) == (b_lo, a_hi)
    # every item in exactly one part, inside that part's window
    seen = []
    for offs, (lo, hi), _ in parts:
        for off in offs:
            assert lo <= off and off + loads[off][0] <= hi
        seen += offs
    assert sorted(seen) == sorted(loads)
    return len(parts)


def test_split_covers_the_file_and_keeps_items_in_their_window():
    rng = random.Random(0)
    split_some = 0
    for _ in range(300):
        spans, at = [], rng.randrange(0, 3 * CHUNK)
        cuts = []
        for _ in range(rng.randrange(0, 30)):
            n = rng.choice([rng.randrange(1, 300), rng.randrange(1, 5 * CHUNK)])
            spans.append((at, n))
            if n > CHUNK // 2 and rng.random() < 0.7:  # a tensor's bytes: chunks cut around
                head = rng.randrange(0, min(n, 700))
                cuts += [at + head, at + n - rng.randrange(0, min(n - head, 200) + 1)]
            at += n + rng.choice([0, 0, rng.randrange(1, 4 * CHUNK)])  # gaps: other ranks' items
        size = at + rng.randrange(0, 2 * CHUNK)
        cuts = sorted({c for c in cuts if 0 < c < size})
        entry = _entry(bytes(size), cuts)
        n = _check_split(spans, entry, rng.choice([1, CHUNK // 3, CHUNK, 4 * CHUNK]))
        split_some += n > 1
    assert split_some > 200


def test_split_of_a_file_read_only_to_check_it():
    entry = _entry(bytes(10 * CHUNK + 5), [3 * CHUNK + 7])
    assert _check_split([], entry, 2 * CHUNK) == 5


def _plain_save(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    sd = {
        f"t{i}": torch.randn(n, generator=g).to(dt)
        for i, (n, dt) in enumerate(
            [(70_000, torch.float32), (13, torch.float32), (50_000, torch.bfloat16)] * 4
            + [(1, torch.int64), (200_000, torch.float32)]
        )
    }
    d = str(tmp_path / "ckpt")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(d, thread_count=1), no_dist=True)
    return d, sd


def _chunked_manifest(d: str) -> dict[str, FileEntry]:
    md = dcp.FileSystemReader(d).read_metadata()
    files = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".distcp"):
            with open(os.path.join(d, name), "rb") as f:
                data = f.read()
            # cuts a little into every other item: chunk borders inside and between items
            cuts = [
                i.offset + 600
                for k, i in enumerate(md.storage_data.values())
                if i.relative_path == name and k % 2 and i.length > 600
            ]
            files[name] = _entry(data, cuts)
    return files


@pytest.fixture
def small_parts(monkeypatch):
    """Parts of a few chunks, and a count of the parts each load ran."""
    monkeypatch.setattr(reader_mod, "PART_BYTES", 1)
    counts: list[int] = []
    split = reader_mod._split

    def counting(*args):
        out = split(*args)
        counts.append(len(out))
        return out

    monkeypatch.setattr(reader_mod, "_split", counting)
    return counts


@pytest.mark.parametrize("subset", [False, True], ids=["all", "subset"])
def test_load_in_parts_gives_the_stored_bits(tmp_path, small_parts, subset):
    """One file in many parts; ``subset``: only some items are loaded, the rest of the file
    (gaps between loaded items) is still checked."""
    d, sd = _plain_save(tmp_path)
    keys = [k for i, k in enumerate(sd) if not subset or i % 3 == 0]
    got = {k: torch.zeros_like(sd[k]) for k in keys}
    _ours(d, got, files=_chunked_manifest(d))
    assert max(small_parts) >= 4, small_parts
    for k in keys:
        assert _bits(got[k]) == _bits(sd[k]), k


def check_parts_share_their_threads_buffers(tmp_path, monkeypatch, device: str) -> None:
    """Each reading thread makes one set of buffers (page-locked ones on CUDA) for all the
    parts it runs, and the parts fill the targets bit for bit."""
    made: list[object] = []
    init = itemread.ReadBuffers.__init__

    def counting(self):
        made.append(self)
        init(self)

    monkeypatch.setattr(itemread.ReadBuffers, "__init__", counting)
    d, sd = _plain_save(tmp_path)
    got = {k: torch.zeros_like(v, device=device) for k, v in sd.items()}
    _ours(d, got, files=_chunked_manifest(d))  # 2 threads
    for k in sd:
        assert torch.equal(got[k].cpu(), sd[k]), k
    assert 1 <= len(made) <= 2, len(made)


def test_parts_share_their_threads_buffers(tmp_path, small_parts, monkeypatch):
    check_parts_share_their_threads_buffers(tmp_path, monkeypatch, "cpu")
    assert max(small_parts) >= 4


def _data_span(d: str, info) -> tuple[int, int]:
    """File offsets of the tensor bytes of stored item ``info``."""
    lay = file_layout(os.path.join(d, info.relative_path), info.offset, info.length)
    assert lay is not None
    return info.offset + lay.start, info.offset + lay.start + lay.nbytes


@pytest.mark.parametrize("where", ["item", "gap", "first", "last", "tail", "appended"])
def test_damage_anywhere_is_caught_when_loading_in_parts(tmp_path, small_parts, monkeypatch, where):
    """A flipped tensor byte (in a loaded item, in an item not loaded, in the file's first
    and last chunks) is caught by the parts' windows alone: the whole-file check that a
    parser failure calls for is disabled. A flipped zip record at the end (the parser fails
    first) and an appended byte are caught too."""
    d, sd = _plain_save(tmp_path)
    files = _chunked_manifest(d)
    md = dcp.FileSystemReader(d).read_metadata()
    infos = sorted(md.storage_data.values(), key=lambda i: i.offset)
    name = infos[0].relative_path
    path = os.path.join(d, name)
    keys = [idx.fqn for idx, i in md.storage_data.items() if i is not infos[5]]  # a gap
    match = "corrupt: the crc32c of its bytes [0-9]+-[0-9]+ differs"
    if where in ("item", "gap", "first", "last"):
        monkeypatch.setattr(reader_mod.VerifyingReader, "verdict", lambda self, name: None)
    if where == "appended":
        with open(path, "ab") as f:
            f.write(b"\0")
        match = "corrupt: it has [0-9]+ bytes, the manifest says"
    else:
        spans = {k: _data_span(d, infos[i]) for k, i in (("item", 7), ("gap", 5), ("first", 0))}
        at = {
            "item": sum(spans["item"]) // 2,
            "gap": sum(spans["gap"]) // 2,
            "first": spans["first"][0] + 10,
            "last": _data_span(d, infos[-1])[1] - 10,
            "tail": files[name].size - 2,
        }[where]
        if where == "first":
            assert at < files[name].chunk_starts()[1]
        flip_byte(path, at, 0x5A)
    got = {k: torch.zeros_like(sd[k]) for k in keys}
    with pytest.raises(CheckpointCorruptError, match=f"{name}: file is {match}"):
        _ours(d, got, files=files)
    assert max(small_parts) >= 4


def test_a_part_that_fails_to_parse_checks_its_own_window(tmp_path, small_parts, monkeypatch):
    """A damaged zip header inside the file: the part that fails to parse it looks for the
    corruption in its own chunks, not in the whole file."""

    def whole_file(self, name):
        raise AssertionError("a part checked the whole file")

    monkeypatch.setattr(reader_mod.VerifyingReader, "verdict", whole_file)
    d, sd = _plain_save(tmp_path)
    files = _chunked_manifest(d)
    md = dcp.FileSystemReader(d).read_metadata()
    info = sorted(md.storage_data.values(), key=lambda i: i.offset)[8]
    flip_byte(os.path.join(d, info.relative_path), info.offset + 2, 0x5A)  # its zip signature
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(CheckpointCorruptError, match="the crc32c of its bytes"):
        _ours(d, got, files=files)


def test_an_item_at_the_end_of_the_file_is_not_dropped():
    """An item at or past the manifest's size (metadata that cannot be right) is still given
    to a part, whose load then says what is wrong, never silently skipped."""
    entry = _entry(bytes(5 * CHUNK), [])
    loads = {0: (CHUNK, []), 3 * CHUNK: (CHUNK, []), 5 * CHUNK: (0, []), 6 * CHUNK: (10, [])}
    parts = reader_mod._split(loads, {}, entry, CHUNK)
    assert sorted(o for offs, _, _ in parts for o in offs) == sorted(loads)
    assert {5 * CHUNK, 6 * CHUNK} <= set(parts[-1][0])


def _run(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyNet(vocab=11, dim=384)  # 0.6-1.8 MiB matrices, small norms and biases
    return model, make_muon(model)


def test_manager_load_in_parts_same_bits_and_bytes(tmp_path, small_parts):
    """A manager checkpoint (CRC32C chunks cut around every tensor's bytes) loaded in parts:
    the same bits, each stored byte read about once."""
    model, opt = _run()
    train(model, opt, 2)
    mgr = CheckpointManager(str(tmp_path / "run"), model=model, optimizer=opt, io_threads=2)
    mgr.save(1)
    want = muon_state_sd(model, opt)
    m2, o2 = _run(seed=5)
    train(m2, o2, 1, seed=9)
    got_mgr = CheckpointManager(str(tmp_path / "run"), model=m2, optimizer=o2, io_threads=4)
    assert got_mgr.load() == 1
    assert max(small_parts) >= 4, small_parts
    got = muon_state_sd(m2, o2)
    assert sorted(got) == sorted(want)
    for k in want:
        assert _bits(got[k]) == _bits(want[k]), k
    st = Storage(str(tmp_path / "run"))
    stored = sum(
        os.path.getsize(os.path.join(st.path(p), f))
        for p in [d for d in os.listdir(st.root) if d.startswith("step")]
        for f in os.listdir(st.path(p))
        if f.endswith(".distcp")
    )
    assert (
        stored <= got_mgr.last_load_bytes_read <= 1.05 * stored + 2 * max(small_parts) * (1 << 20)
    )
