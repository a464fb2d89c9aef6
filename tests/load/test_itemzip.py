"""The item layout parser (muon_ckpt/load/_item_zip.py) against torch's own zip reader.

A ``torch.save`` of one tensor is parsed from its two ends; the reference is torch: the
record offset from ``PyTorchFileReader`` and the values from ``torch.load``, which the bytes
at the parsed layout must reproduce bit for bit. Zip64 fields (what a record over 4 GiB
gets) are written into real items by rebuilding their central directory. Damaged and foreign
items must give None (torch.load's turn) or a layout inside the item, never an exception.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile

import pytest
import torch

from muon_ckpt.load import _local_files
from muon_ckpt.load._item_zip import EDGE, Layout, parse_layout, unbounded_records
from tests._ckpt import file_layout
from tests._crafted import bomb_item


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(100, generator=g)
    cases = {
        "f32": torch.randn(64, 48, generator=g),
        "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (17,), generator=g),
        "bool": torch.rand(11, generator=g) > 0.5,
        "c64": torch.randn(6, generator=g, dtype=torch.complex64),
        "u16": torch.arange(9, dtype=torch.int32).to(torch.uint16),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 5),
        "view": base[10:50],  # a storage offset
        "transposed": torch.arange(12, dtype=torch.int16).view(3, 4).t(),
        "permuted": torch.randn(3, 4, 5, generator=g).permute(2, 0, 1),
        "big": torch.randn(3 * EDGE, generator=g),  # bytes outside both edges
    }
    if hasattr(torch, "float8_e4m3fn"):
        cases["f8"] = torch.randn(4, 6, generator=g).to(torch.float8_e4m3fn)
    return cases


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _parse(data: bytes) -> Layout | None:
    return parse_layout(lambda lo, hi: data[lo:hi], len(data))


def _check_against_torch(data: bytes, lay: Layout | None) -> None:
    assert lay is not None
    want = torch.load(io.BytesIO(data), weights_only=True)
    reader = torch._C.PyTorchFileReader(io.BytesIO(data))
    [record] = [r for r in reader.get_all_records() if r.startswith("data/")]
    assert lay.start == reader.get_record_offset(record)
    assert (lay.dtype, lay.size, lay.stride, lay.offset) == (
        want.dtype,
        tuple(want.shape),
        want.stride(),
        want.storage_offset(),
    )
    assert lay.nbytes == want.untyped_storage().nbytes()
    if not want.numel():
        return
    raw = torch.frombuffer(bytearray(data[lay.start : lay.start + lay.nbytes]), dtype=torch.uint8)
    got = raw.view(lay.dtype).as_strided(lay.size, lay.stride, lay.offset)

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).contiguous().view(torch.uint8)

    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("name", sorted(_cases()))
def test_same_layout_as_torch(name):
    data = _saved(_cases()[name])
    _check_against_torch(data, _parse(data))


@pytest.mark.parametrize("name", ["f32", "big", "scalar"])
def test_item_inside_a_file_reads_only_its_edges(tmp_path, name):
    """An item at an offset in a larger file (as DCP stores them) parses to the same layout,
    from at most two reads of EDGE bytes (one for a small item)."""
    data = _saved(_cases()[name])
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(os.urandom(1000) + data + os.urandom(333))
    reads: list[int] = []

    def pread(fd, mv, at):
        reads.append(len(mv))
        assert os.preadv(fd, [mv], at) == len(mv)

    fd = os.open(path, os.O_RDONLY)
    try:
        lay = _local_files.item_layout(_local_files.Edges(fd, 1000, len(data), pread))
    finally:
        os.close(fd)
    _check_against_torch(data, lay)
    assert file_layout(path, 1000, len(data)) == lay
    assert len(reads) <= 2 and sum(reads) <= 2 * EDGE, reads


def _with_zip64(data: bytes, fields: bool, end_records: bool) -> bytes:
    """``data`` (a torch.save zip) with its central directory rewritten: sizes and offsets
    in zip64 extra fields (``fields``), and with or without the zip64 end records."""
    zf = zipfile.ZipFile(io.BytesIO(data))
    infos = zf.infolist()
    cd_off = zf.start_dir  # where the central directory starts
    body, cd = data[:cd_off], b""
    for info in infos:
        name = info.filename.encode()
        sizes = (info.file_size, info.compress_size, info.header_offset)
        extra = b""
        if fields:
            extra = struct.pack("<2H3Q", 1, 24, *sizes)
            sizes = (0xFFFFFFFF,) * 3
        cd += struct.pack(
            "<4s6H3L5H2L",
            b"PK\x01\x02",
            45,
            45,
            0,
            0,
            0,
            0,
            info.CRC,
            sizes[1],
            sizes[0],
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            sizes[2],
        )
        cd += name + extra
    n = len(infos)
    tail = b""
    if end_records:
        eocd64_at = cd_off + len(cd)
        tail += struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(cd), cd_off)
        tail += struct.pack("<4sLQL", b"PK\x06\x07", 0, eocd64_at, 1)
        tail += struct.pack(
            "<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0
        )
    else:
        tail += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, n, n, len(cd), cd_off, 0)
    return body + cd + tail


@pytest.mark.parametrize(
    "fields,end_records", [(True, True), (False, False), (True, False)], ids=str
)
def test_zip64_fields_and_plain_end_records(fields, end_records):
    """What torch writes for records over 4 GiB (sizes and offsets in zip64 extra fields),
    and an end of directory without the zip64 records: the same layout."""
    data = _with_zip64(_saved(_cases()["big"]), fields, end_records)
    if end_records:  # torch's own reader is the reference where it reads such a file
        _check_against_torch(data, _parse(data))
    else:
        assert _parse(data) == _parse(_saved(_cases()["big"]))


def _inside(lay: Layout | None, length: int) -> bool:
    """No layout, or one whose record lies in the item and whose elements lie in the record
    (the lowest and the highest reached, whatever the strides' signs)."""
    if lay is None:
        return True
    if lay.start < 0 or lay.start + lay.nbytes > length:
        return False
    if not all(lay.size):
        return True
    steps = [(n - 1) * s for n, s in zip(lay.size, lay.stride)]
    lowest = lay.offset + sum(x for x in steps if x < 0)
    highest = lay.offset + sum(x for x in steps if x > 0)
    return lowest >= 0 and highest < lay.nbytes // lay.dtype.itemsize


def test_damaged_records_give_none_or_a_layout_inside_the_item():
    """Every byte of the zip records (not the tensor's bytes) flipped in turn, and the item
    cut at every length: never an exception, never a layout reaching outside the item. (A
    flipped byte can still give another valid layout, e.g. a different shape: the checksum
    is what catches that.)"""
    data = _saved(_cases()["f32"])
    good = _parse(data)
    assert good is not None
    record = range(good.start, good.start + good.nbytes)
    for at in range(len(data)):
        if at in record:
            continue
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(data)
            bad[at] ^= mask
            assert _inside(_parse(bytes(bad)), len(bad)), (at, mask)
    for n in range(0, len(data), 7):
        cut = data[:n]
        assert _inside(_parse(cut), n), n


def test_other_files_are_declined():
    """A compressed zip of the same records, two archive names, a pickle of something else,
    random bytes, nothing: None."""
    data = _saved(_cases()["f32"])
    src = zipfile.ZipFile(io.BytesIO(data))
    deflated = io.BytesIO()
    with zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info))
    two = io.BytesIO()
    with zipfile.ZipFile(two, "w") as z:
        for i, info in enumerate(src.infolist()):
            z.writestr(("a/" if i % 2 else "b/") + info.filename.partition("/")[2], src.read(info))
    for other in (deflated.getvalue(), two.getvalue(), _saved({"a": 1}), os.urandom(5000), b""):
        assert _parse(other) is None


def _int_op(v: int) -> bytes:
    """A pickle opcode pushing ``v``."""
    if 0 <= v < 256:
        return b"K" + bytes([v])
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def _crafted(size: list[bytes], stride: list[bytes], byteorder: bytes = b"little") -> bytes:
    """A zip shaped like torch.save's of 4 float32 elements, with a hand-written pickle of
    ``_rebuild_tensor_v2`` whose size and stride tuples are the given opcodes."""

    def tup(ops: list[bytes]) -> bytes:
        return b"(" + b"".join(ops) + b"t"

    persid = [b"X\x07\x00\x00\x00storage", b"ctorch\nFloatStorage\n", b"X\x01\x00\x00\x000"]
    persid += [b"X\x03\x00\x00\x00cpu", _int_op(4)]
    pkl = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + tup(persid) + b"Q" + _int_op(0)
    pkl += tup(size) + tup(stride) + b"\x89" + b"ccollections\nOrderedDict\n)R" + b"tR."
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", byteorder)
        z.writestr("archive/data/0", bytes(16))
    return buf.getvalue()


def test_crafted_pickles_are_declined_at_once(monkeypatch):
    """A hand-written item of the same form parses; a negative stride (elements before the
    record) gives None, and so do sizes that are huge integers: thousands of references to
    one 255-byte integer, whose product alone took minutes, give None without any product
    taken of them. What makes it quick is checked (every product of at most 64 integers below
    2**63), not a wall-clock time, which a loaded host stretches."""
    ok = _parse(_crafted([_int_op(4)], [_int_op(1)]))
    assert ok is not None and ok.size == (4,)
    assert _parse(_crafted([_int_op(4)], [_int_op(-1)])) is None
    assert _parse(_crafted([_int_op(5)], [_int_op(1)])) is None  # past the record
    huge = b"\x8a\xff" + b"\x7f" * 255 + b"q\x01"  # LONG1 of 255 bytes, memoized
    item = _crafted([huge] + [b"h\x01"] * 8000, [_int_op(1)] * 8001)
    products: list[tuple[int, ...]] = []
    prod = math.prod

    def counted(values: tuple[int, ...]) -> int:
        products.append(tuple(values))
        if not all(0 <= v < 1 << 63 for v in products[-1]):
            raise AssertionError("a product of huge integers")  # (rather than minutes of it)
        return prod(values)

    monkeypatch.setattr(math, "prod", counted)
    assert _parse(item) is None
    assert _parse(_crafted([_int_op(4)], [_int_op(1)])) is not None  # (the count is live)
    monkeypatch.undo()
    assert products  # the good item's product was counted
    for values in products:
        assert len(values) <= 64 and all(0 <= v < 1 << 63 for v in values), len(values)


def test_a_record_that_claims_to_be_large_is_not_read():
    """A byte-order record of 1 MiB is declined without reading it: the parser reads the
    item's ends and small records only."""
    item = _crafted([_int_op(4)], [_int_op(1)], byteorder=b"x" * (1 << 20))
    sizes: list[int] = []

    def read(lo: int, hi: int) -> bytes:
        sizes.append(hi - lo)
        return item[lo:hi]

    assert parse_layout(read, len(item)) is None
    assert max(sizes) <= EDGE, sizes


def _bounded(data: bytes) -> str | None:
    return unbounded_records(lambda lo, hi: data[lo:hi], len(data))


def test_what_torch_load_may_read_is_bounded_by_the_item():
    """torch.save's own items pass (a tensor, an object holding many tensors, a
    scalar); an item with a deflated record, with directory entries that overlap one record,
    with an encrypted record or with a record outside the item does not, however torch.load
    would take it."""
    for obj in (_cases()["f32"], {"a": [torch.ones(3), torch.zeros(2, 2)] * 50, "b": 1.5}, 0.02):
        assert _bounded(_saved(obj)) is None
    value = torch.arange(96.0).view(12, 8)
    assert "compressed" in _bounded(bomb_item(value, 1 << 20, deflate=True))
    assert "overlap" in _bounded(bomb_item(value, 1 << 16, deflate=False, aliases=2))
    good = _saved(_cases()["f32"])
    zf = zipfile.ZipFile(io.BytesIO(good))
    cd = zf.start_dir
    encrypted = bytearray(good)
    encrypted[cd + 8] |= 1  # the first directory entry's flags: encrypted
    assert "encrypted" in _bounded(bytes(encrypted))
    outside = bytearray(good)
    struct.pack_into("<L", outside, cd + 42, len(good))  # its local header past the item
    assert "outside" in _bounded(bytes(outside))
    assert "not a zip" in _bounded(b"PK" + bytes(100))
