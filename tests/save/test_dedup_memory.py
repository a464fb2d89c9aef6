"""Dedup with the memory tier: a memory step's bytes are never in the url, so a url step --
one saved after memory-only steps, or a memory step flushed at ``close()`` -- refers only to
data that a url step holds, and the url's retention keeps whatever a kept step refers to.

One process, local directories; exactness is bitwise.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable

import torch
from torch import nn

from muon_ckpt import CheckpointManager, MemoryOptions
from muon_ckpt.store import Catalog, Storage, data_ref, parse_data_dirname, verify
from muon_ckpt.store._resolve import resolve
from tests.save.test_dedup import _no_orphans, _same


class _Two(nn.Module):
    """``a``: never changes; ``b``: changed at memory-only steps; ``head``: every step."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Embedding(256, 64)  # 64 KiB each: referred to when unchanged
        self.b = nn.Embedding(256, 64)
        self.head = nn.Linear(64, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def _dirs_of(st: Storage, step: int) -> dict[str, int]:
    """key -> the step whose save wrote its bytes, for ``step`` in the url."""
    _, md = Catalog(st).checked(step)
    out = {}
    for idx, info in md.storage_data.items():
        ref = data_ref(info.relative_path)
        assert ref is not None, info.relative_path
        out[idx.fqn] = parse_data_dirname(ref[0])
    return out


def _loads_from_url(url: str, step: int, want: nn.Module) -> None:
    fresh = _Two()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    assert CheckpointManager(url, model=fresh).load() == step
    _same(fresh, want)


def _seven_steps(
    url: str, mem: str, at: Callable[[int], None] | None = None
) -> tuple[_Two, CheckpointManager]:
    """interval=3, memory every step, keep_last=1: steps 1 to 7 saved, each waited for
    (then ``at(step)``); ``b`` changes at memory-only steps 4 and 7, ``head`` at every
    step. The model and the manager, not closed."""
    m = _Two()
    mgr = CheckpointManager(
        url, model=m, interval=3, memory=MemoryOptions(interval=1, dir=mem), keep_last=1
    )
    for step in range(1, 8):
        with torch.no_grad():
            m.head.weight.fill_(float(step))
            if step in (4, 7):
                m.b.weight.add_(1.0)
        assert mgr.save(step)
        mgr.wait()
        if at is not None:
            at(step)
    return m, mgr


def test_url_steps_around_memory_only_steps_refer_only_to_url_data(tmp_path):
    """interval=3, memory every step, keep_last=1. ``b`` changes at memory-only steps 4 and
    7: url step 6 writes ``b`` (its base is url step 3, not memory step 5), refers ``a`` to
    step 3's data; ``close()`` flushes memory step 7 to the url, which writes ``b`` again
    and still refers ``a`` to step 3's data. Retention deleted steps 3 and 6 and kept step
    3's file that step 7 refers to; step 6's data went. Step 7 loads bitwise from the url
    alone; a manager that loads it from memory writes its next url step whole."""
    url, mem = str(tmp_path / "run"), str(tmp_path / "mem")

    def at(step: int) -> None:
        if step == 6:
            st = Storage(url)
            assert _dirs_of(st, 6) == {"model.a.weight": 3, "model.b.weight": 6, **_head(6)}

    m, mgr = _seven_steps(url, mem, at)
    mgr.close()  # memory_flush: step 7 to the url
    st = Storage(url)
    assert Catalog(st).committed_steps() == [7]
    assert _dirs_of(st, 7) == {"model.a.weight": 3, "model.b.weight": 7, **_head(7)}
    assert {parse_data_dirname(d) for d in st.listdir("data")} == {3, 7}
    _no_orphans(st)
    assert verify(resolve(st, 7)).ok
    shutil.move(mem, mem + "_moved")  # the url alone
    _loads_from_url(url, 7, m)
    shutil.move(mem + "_moved", mem)

    again = _Two()
    mgr = CheckpointManager(url, model=again, interval=3, memory=MemoryOptions(interval=1, dir=mem))
    assert mgr.load() == 7 and mgr.last_load_tier == "memory"
    _same(again, m)
    mgr.save(9)  # (the tier's parts are no base: everything written)
    mgr.close()
    assert set(_dirs_of(st, 9).values()) == {9}
    _no_orphans(st)
    _loads_from_url(url, 9, m)


def _head(step: int) -> dict[str, int]:
    return {"model.head.weight": step, "model.head.bias": step}


def test_the_flush_writes_a_tensor_again_where_the_url_file_it_would_refer_to_is_damaged(
    tmp_path, caplog
):
    """As above, but the file of step 3's save that holds ``a`` has a byte flipped before
    ``close()``: the flush refers to nothing the url no longer holds as written (the checks
    of every save's references): it writes ``a`` again from the memory step's part, with a
    WARNING naming the file, and step 7 loads bitwise from the url alone."""
    url, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    m, mgr = _seven_steps(url, mem)
    st = Storage(url)
    _, md = Catalog(st).checked(6)
    (info,) = [i for x, i in md.storage_data.items() if x.fqn == "model.a.weight"]
    path = tmp_path / "run" / "step-00000006" / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    mgr.close()  # memory_flush: step 7 to the url, ``a`` written again
    assert Catalog(st).committed_steps() == [7]
    assert _dirs_of(st, 7) == {"model.a.weight": 7, "model.b.weight": 7, **_head(7)}
    assert "written again from the saved state" in caplog.text
    _no_orphans(st)
    assert verify(resolve(st, 7)).ok
    shutil.move(mem, mem + "_moved")  # the url alone
    _loads_from_url(url, 7, m)
