"""Crafted ``.metadata`` pickles against our reader: one that sets attributes of a class it
was handed (pickle's BUILD on a class) is refused and changes nothing in the process, one that
refers to a map or zip many times does not make it again each time, and a manifest rewritten
in place with its mtime set back is read again, not taken from the run's index."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from muon_ckpt import CheckpointCorruptError, CheckpointManager
from muon_ckpt.store._metadata import unpack_metadata

_DCP = b"ctorch.distributed.checkpoint.metadata\nChunkStorageMetadata\n"


def test_a_pickle_that_sets_a_class_attribute_is_refused_and_the_class_kept():
    init = ChunkStorageMetadata.__init__
    # BUILD on the class: (None, {"__init__": slice}) sets ChunkStorageMetadata.__init__
    crafted = b"\x80\x02" + _DCP + b"N}X\x08\x00\x00\x00__init__cbuiltins\nslice\ns\x86b."
    with pytest.raises(CheckpointCorruptError, match="sets attributes of ChunkStorageMetadata"):
        unpack_metadata(crafted, "crafted")
    assert ChunkStorageMetadata.__init__ is init
    assert ChunkStorageMetadata([0], [1]).offsets == [0]


def _amplifying(n: int) -> bytes:
    """list(map(list, [Z] * n)) with Z = zip(*[L] * n), L = [0] * n: n**3 references from a
    file of a few KB, if every reference to Z made it again."""
    out = [b"\x80\x04", b"cbuiltins\nlist\n", b"cbuiltins\nmap\n", b"cbuiltins\nlist\n"]
    out += [b"]q\x00(" + b"K\x00" * n + b"e0"]  # L, memo 0
    out += [b"cbuiltins\nzip\n(" + b"h\x00" * n + b"tRq\x010"]  # Z, memo 1
    out += [b"](" + b"h\x01" * n + b"e", b"\x86R", b"\x85R", b"."]
    return b"".join(out)


def test_a_map_or_zip_referred_to_many_times_is_used_up_once():
    data = _amplifying(200)  # 8 million references (64 MiB of pointers) if made each time
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointCorruptError, match="not DCP metadata"):
            unpack_metadata(data, "crafted")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, (peak, len(data))


def _run(url: str) -> tuple[nn.Module, CheckpointManager]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, CheckpointManager(url, model=model, optimizer=opt, keep_last=2)


def test_a_manifest_rewritten_in_place_with_its_mtime_set_back_is_read_again(tmp_path):
    """Step 2's manifest replaced in place (same inode and size) by one naming step 1's data,
    its mtime set back: the index's entry for it must not stand (collect would delete the
    data the manifest on disk names when step 1 goes)."""
    d = str(tmp_path / "run")
    model, mgr = _run(d)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.save(step)
    mgr.close()
    p1, p2 = (os.path.join(d, f"step-0000000{s}", "manifest.json") for s in (1, 2))
    st = os.stat(p2)
    old, txt = (Path(p).read_text() for p in (p2, p1))
    m1, m2 = json.loads(txt), json.loads(old)
    txt = txt.replace('"step": 1,', '"step": 2,').replace('"gen": 1,', '"gen": 2,')
    txt = txt.replace(f'"time": "{m1["time"]}"', f'"time": "{m2["time"]}"')
    assert len(txt) == len(old)
    shutil.copyfile(os.path.join(d, "step-00000001", ".metadata"), p2 + ".md")
    os.replace(p2 + ".md", os.path.join(d, "step-00000002", ".metadata"))
    with open(p2, "r+") as f:
        f.write(txt)
    os.utime(p2, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(p2).st_ino == st.st_ino and os.stat(p2).st_mtime_ns == st.st_mtime_ns
    model, mgr = _run(d)
    assert mgr.load() == 2
    mgr.save(3)  # retention deletes step 1: its data is step 2's now
    mgr.close()
    cmd = [sys.executable, "-m", "muon_ckpt.cli", "verify", d, "--step", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
