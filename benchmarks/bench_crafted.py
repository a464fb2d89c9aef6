"""What crafted checkpoints cost (issue 31): peak memory and time of each command on a crafted
step, of crafted safetensors headers, and what the metadata's check adds to a large step.

* ``step``: a run of TinyNet + Muon whose newest step has one object item (69 KiB) holding a
  deflated 64 MiB record and 15 directory entries that overlap it (1 GiB for an unchecked
  ``torch.load``); load, inspect and export of that step, each: peak RSS growth, time, outcome.
* ``headers``: ``load_hf_model`` on safetensors headers of junk (1.6 MB: 800k dimensions, 370
  integers of 4299 digits; with ``--big``, 100 MB ones): time, peak RSS growth.
* ``pickle``: what ``torch.load(weights_only=True)`` makes of a 3.8 MiB pickle of nested
  empty lists (the factor any pickle may have over its size; a checked zip bounds the rest).
* ``metadata``: the checks of a step's metadata (T tensors in R row chunks, B objects) against
  unpickling it: ``check_tensors`` (``store/_chunks.py``) and ``check_ranges``; three rounds.

Peak RSS growth: the kernel's high-water mark (VmHWM), reset before each command
(``/proc/self/clear_refs``; Linux only).

Usage::

    python -m benchmarks.bench_crafted
    python -m benchmarks.bench_crafted --big --tensors 1000 --chunks 64 --objects 10000
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from muon_ckpt import (
    CheckpointCorruptError,
    CheckpointManager,
    export_safetensors,
    load_hf_model,
)
from muon_ckpt.cli import main as cli
from muon_ckpt.store import Storage
from tests._ckpt import TinyNet, make_muon, three_step_run
from tests._crafted import MiB, bomb_item, craft_step, peak_growth


def _report(name: str, fn: Callable[[], Any]) -> None:
    t = time.perf_counter()
    grew, out = peak_growth(fn)
    took = time.perf_counter() - t
    what = type(out).__name__ if isinstance(out, Exception) else "ok"
    print(f"  {name:<28} {took:7.2f} s  peak +{grew / MiB:6.0f} MiB  {what}")


def bench_step(tmp: str) -> None:
    url = three_step_run(os.path.join(tmp, "run"), {})["url"]
    lr = "optim.param_groups.fc1.weight.lr"
    item = bomb_item(torch.tensor([0.02]), 64 * MiB, deflate=True, aliases=15)
    craft_step(Storage(url), 3, lambda ed: ed.replace_item(lr, item))
    step = os.path.join(url, "step-00000003")
    size = sum(os.path.getsize(os.path.join(step, f)) for f in os.listdir(step))
    print(f"step: {size / 1024:.0f} KiB, the crafted item {len(item) / 1024:.0f} KiB")

    def load() -> Any:
        model = TinyNet()
        return CheckpointManager(url, model=model, optimizer=make_muon(model)).load(step=3)

    def inspect() -> Any:
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            if cli(["inspect", url, "--step", "3"]):
                raise CheckpointCorruptError(err.getvalue())

    out = os.path.join(tmp, "o.safetensors")
    _report("load", load)
    _report("inspect", inspect)
    _report("export", lambda: export_safetensors(url, out, step=3, include=("model", "optim")))


def bench_headers(tmp: str, big: bool) -> None:
    print("safetensors headers (load_hf_model):")

    def run(name: str, header: bytes) -> None:
        with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header + bytes(16))
        _report(f"{name} ({len(header) / 1e6:.1f} MB)", lambda: load_hf_model(TinyNet(), tmp))

    def entry(shape: str) -> bytes:
        return f'{{"w":{{"dtype":"F32","shape":{shape},"data_offsets":[0,4]}}}}'.encode()

    digits = "9" * 4299
    run("800k dimensions", entry("[" + ",".join(["2"] * 800_000) + "]"))
    run("370 integers of 4299 digits", entry("[" + ",".join([digits] * 370) + "]"))
    if big:
        run("49M dimensions", entry("[" + ",".join(["2"] * 49_000_000) + "]"))
        run("23k integers of 4299 digits", entry("[" + ",".join([digits] * 23_000) + "]"))
        entries = {
            f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
            for i in range(1_300_000)
        }
        run("1.3M entries", json.dumps(entries).encode())


def bench_pickle() -> None:
    """What a pickle may become: an object item of 4M EMPTY_LIST opcodes (each a list object
    on the unpickler's stack; torch.load refuses the result only at the end)."""
    from tests._crafted import zip_bytes

    pkl = b"\x80\x02(" + b"]" * 4_000_000 + b"l."
    item = zip_bytes([("archive/data.pkl", pkl, False), ("archive/version", b"3\n", False)])
    print(f"pickle of nested empty lists ({len(item) / MiB:.1f} MiB item), torch.load:")
    _report("weights_only=True", lambda: torch.load(io.BytesIO(item), weights_only=True))


def bench_metadata(tensors: int, chunks: int, objects: int) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from muon_ckpt.store import _metadata
    from muon_ckpt.store._chunks import check_tensors
    from muon_ckpt.store.dcp import StorageIndex

    sd: dict[str, Any] = {}
    items: dict[Any, Any] = {}
    rows, cols, at = 64, 1024, 0
    for t in range(tensors):
        key, pieces = f"model.layers.{t}.w", []
        for r in range(chunks):
            pieces.append(ChunkStorageMetadata(torch.Size([rows * r, 0]), torch.Size([rows, cols])))
            items[MetadataIndex(key, [rows * r, 0], r)] = _StorageInfo(
                f"__{r}_0.distcp", at, rows * cols * 2 + 1200
            )
        at += rows * cols * 2 + 1200
        props = TensorProperties(dtype=torch.bfloat16)
        sd[key] = TensorStorageMetadata(props, torch.Size([rows * chunks, cols]), pieces)
    for b in range(objects):
        sd[f"optim.param_groups.p{b}.lr"] = BytesStorageMetadata()
        items[MetadataIndex(f"optim.param_groups.p{b}.lr")] = _StorageInfo(
            "o.distcp", 1261 * b, 1261
        )
    data = pickle.dumps(Metadata(sd, storage_data=items))
    sizes = {name: 1 << 40 for name in {i.relative_path for i in items.values()}}
    for _ in range(3):
        t0 = time.perf_counter()
        md = _metadata._MetadataUnpickler(io.BytesIO(data)).load()
        items = md.storage_data  # (DCP's own pickle: its stored items as columns, as read)
        md.storage_data = StorageIndex.of_items(list(items), list(items.values()))
        t1 = time.perf_counter()
        check_tensors(md, "bench")
        t2 = time.perf_counter()
        _metadata.check_ranges(md, sizes, "bench")
        t3 = time.perf_counter()
        print(
            f"metadata of {tensors} tensors x {chunks} chunks + {objects} objects "
            f"({len(data) / 1e6:.1f} MB): unpickled in {t1 - t0:.2f} s, check_tensors "
            f"{t2 - t1:.2f} s, check_ranges {t3 - t2:.2f} s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--big", action="store_true", help="also 100 MB safetensors headers")
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--objects", type=int, default=10000)
    args = p.parse_args()
    tmp = tempfile.mkdtemp()
    try:
        bench_step(tmp)
        bench_headers(tmp, args.big)
        bench_pickle()
        bench_metadata(args.tensors, args.chunks, args.objects)
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
