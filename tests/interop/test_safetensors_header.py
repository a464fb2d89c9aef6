"""Crafted safetensors headers: parsed in time linear in their size, and every malformed one a
CheckpointCorruptError naming the file, never a raw AttributeError or RecursionError, nor a
header accepted with shapes or offsets the format does not allow."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch

from muon_ckpt import (
    CheckpointCorruptError,
    CheckpointError,
    import_optimizer_state,
    load_hf_model,
)
from muon_ckpt.interop import _safetensors
from tests._ckpt import TinyNet, make_muon

MAX_DIM = 1 << 63  # the largest dimension a shape may hold before its product is taken


def _file(path: Any, header: bytes, data: bytes = b"") -> str:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)
    return str(path)


def _hf_dir(tmp_path: Any, header: bytes, data: bytes = b"") -> str:
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    _file(d / "model.safetensors", header, data)
    return str(d)


def _entry(shape: str, offsets: str = "[0,4]", dtype: str = '"F32"') -> bytes:
    return f'{{"w":{{"dtype":{dtype},"shape":{shape},"data_offsets":{offsets}}}}}'.encode()


BIG = "9" * 4299  # as many digits as Python parses into an int by default
JUNK = {
    "800k_dims": _entry("[" + ",".join(["2"] * 800_000) + "]"),
    "370_huge_dims": _entry("[" + ",".join([BIG] * 370) + "]"),
    "20k_entries": json.dumps(
        {
            f"t{i}": {"dtype": "F32", "shape": [2] * 60, "data_offsets": [0, 4]}
            for i in range(20_000)
        }
    ).encode(),
}


@pytest.mark.parametrize("name", sorted(JUNK))
def test_a_junk_header_is_refused_in_linear_time(tmp_path, monkeypatch, name):
    """1.6 MB of junk header took 6 to 28 s: a product of 800k dimensions, big integers
    multiplied, the whole shape printed into the message. Linear time holds by construction
    when every product taken is of at most MAX_DIMS integers below 2**63, at most one per
    entry, and the message is cut short; those are what is checked (not a wall-clock time,
    which a loaded host stretches)."""
    header = JUNK[name]
    assert len(header) > 1_000_000
    products: list[tuple[int, ...]] = []
    real = _safetensors._nbytes

    def counted(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        products.append(shape)
        return real(dtype, shape)

    monkeypatch.setattr(_safetensors, "_nbytes", counted)
    d = _hf_dir(tmp_path, header, bytes(16))
    with pytest.raises(CheckpointCorruptError, match=r"model\.safetensors") as e:
        load_hf_model(TinyNet(), d)
    assert len(products) <= header.count(b'"shape"')
    for shape in products:
        assert len(shape) <= _safetensors.MAX_DIMS, len(shape)
        assert all(0 <= v < MAX_DIM for v in shape)
    assert len(str(e.value)) < 2000  # names what is wrong, without echoing the header


MALFORMED = {
    "metadata_list": b'{"__metadata__": [1]}',
    "metadata_values_not_strings": b'{"__metadata__": {"a": {"b": 1}}}',
    "nested_without_end": b"[" * 100_000,
    "object_nested_without_end": b'{"a":' * 100_000,
    "shape_of_bools": _entry("[true]"),
    "shape_of_floats": _entry("[1.5]", "[0,4]"),
    "negative_dim": _entry("[-1]", "[0,0]"),
    "dims_past_int64": _entry("[0, 100000000000000000000000000000]", "[0,0]"),
    "too_many_dims": _entry("[" + ",".join(["1"] * 65) + "]"),
    "offsets_of_floats": _entry("[1]", "[0,4.0]"),
    "offsets_reversed": _entry("[1]", "[4,0]"),
    "offsets_not_a_pair": _entry("[1]", "[0,4,8]"),
    "entry_not_an_object": b'{"w": 5}',
    "dtype_unknown": _entry("[1]", dtype='"F128"'),
    "dtype_not_a_string": _entry("[1]", dtype="[1]"),
    "overlapping_tensors": (
        b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
        b'"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}'
    ),
    "not_utf8": b'{"w\xff": 1}',
    "not_an_object": b"[1, 2]",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_every_malformed_header_is_a_corrupt_file_naming_it(tmp_path, name):
    """Each header names its file in a CheckpointCorruptError, through load_hf_model and
    import_optimizer_state alike (which takes a file for safetensors by its ``{``: other
    files are not of a format it knows, a CheckpointError naming the file)."""
    header = MALFORMED[name]
    d = _hf_dir(tmp_path, header, bytes(64))
    with pytest.raises(CheckpointCorruptError, match=r"model\.safetensors"):
        load_hf_model(TinyNet(), d)
    single = _file(tmp_path / "opt.safetensors", header, bytes(64))
    torch.manual_seed(0)
    model = TinyNet()
    error = CheckpointCorruptError if header.startswith(b"{") else CheckpointError
    with pytest.raises(error, match=r"opt\.safetensors"):
        import_optimizer_state(make_muon(model), single, model=model)
