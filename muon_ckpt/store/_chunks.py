"""The DCP metadata's tensors checked once for every reader: each tensor's stored chunks tile
it exactly, and no tensor declares more bytes than its items store.

A reader allocates a tensor at its declared size (export, inspect) or writes a load's target
chunk by chunk; rows that no chunk covers would carry whatever memory held (or the target's
old values, in a load that reports success), rows two chunks cover would be written twice, and
a declared shape no stored byte backs would make a 100 KiB step allocate gigabytes. So, before
any read: every chunk lies inside its tensor, the chunks neither overlap nor leave a gap, each
non-empty chunk has a stored item of at least its bytes (a compressed item, ``_codec``: of
at least ``1 / MAX_RATIO`` of them, the most it expands to), and no two items share bytes of
a file. A tensor's declared bytes are then at most the bytes its items take in the files
(``MAX_RATIO`` times, compressed), which the manifest (or, for a plain DCP directory, the
listing) bounds.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt._shards import chunk_of
from muon_ckpt.store._chunklist import ChunkList
from muon_ckpt.store._codec import DESCRIPTOR, MAX_RATIO
from muon_ckpt.store._layouts import Layout, Layouts, rows_hold

__all__ = ["check_held_chunks", "check_tensors", "tiling_problem"]

MAX_DIMS = 64  # torch's own limit on a tensor's dimensions
# How many pieces the chunks' cuts may make of a tensor, per chunk: a sharded save's chunks
# form a grid (each mesh dimension cuts one tensor dimension across all the others), where
# pieces == chunks; a crafted list of chunks could make the check of a grid cost its square.
_PIECES_PER_CHUNK = 16
_MIN_PIECES = 1 << 12


def _dims(v: Any) -> tuple[int, ...] | None:
    """``v`` as a tuple of plain ints in [0, 2**63), or None."""
    if not isinstance(v, (tuple, list)) or len(v) > MAX_DIMS:
        return None
    out = tuple(v)
    if not all(type(n) is int and 0 <= n < 1 << 63 for n in out):
        return None
    return out


def _all_dims(chunks: list[Any], ndim: int) -> tuple[list[Any], list[Any]] | None:
    """Every chunk's offsets and sizes (two lists) as ``_dims`` would give them (or the
    ``torch.Size``s themselves: tuples of ints below 2**63), each of ``ndim`` values, checked
    for all chunks at once (a tensor of a 2,048-rank save has 2,048 of them); None when one is
    not, which the caller finds one by one."""
    cols = chunks.columns() if isinstance(chunks, ChunkList) and chunks.exact else None
    if cols is not None:  # (a tensor's chunks as the .metadata's columns, store._packed)
        offsets, sizes = cols
    elif not all(map(isinstance, chunks, itertools.repeat(ChunkStorageMetadata))):
        return None
    else:
        offsets = list(map(getattr, chunks, itertools.repeat("offsets"), _NONES))
        sizes = list(map(getattr, chunks, itertools.repeat("sizes"), _NONES))
    if set(map(type, offsets)) | set(map(type, sizes)) == {torch.Size}:
        shapes = set(sizes)  # (a few: equal sizes are most often one object, store._packed)
        if set(map(len, offsets)) | set(map(len, shapes)) != {ndim}:
            return None
        flat = itertools.chain(itertools.chain.from_iterable(offsets), *shapes)
        return None if min(flat, default=0) < 0 else (offsets, sizes)
    dims = offsets + sizes
    if not dims:
        return [], []
    if not all(issubclass(t, (tuple, list)) for t in set(map(type, dims))):
        return None
    if set(map(len, dims)) != {ndim}:
        return None
    flat = list(itertools.chain.from_iterable(dims))
    if flat and (set(map(type, flat)) != {int} or min(flat) < 0 or max(flat) >= 1 << 63):
        return None
    return list(map(tuple, offsets)), list(map(tuple, sizes))


_NONES = itertools.repeat(None)


def tiling_problem(
    size: Sequence[int],
    offsets: Sequence[Sequence[int]],
    sizes: Sequence[Sequence[int]],
    whole: bool = True,
) -> str | None:
    """None when the chunks (their ``offsets`` and ``sizes``, each of ``len(size)`` plain
    non-negative ints) tile a tensor of ``size`` exactly, else what is wrong, for an error
    message. Without ``whole`` they may leave gaps (a memory-tier part holds one rank's
    shards)."""
    if _slabs_tile(size, offsets, sizes, whole):
        return None
    chunks = list(zip(offsets, sizes))
    for o, k in chunks:
        if any(a + n > s for a, n, s in zip(o, k, size)):
            return f"has a chunk at {list(o)} of {list(k)}, outside its size {list(size)}"
    boxes = [(o, n) for o, n in chunks if all(n)]  # an empty chunk stores nothing
    if not math.prod(size):
        return None
    if len(boxes) == 1 and not any(boxes[0][0]) and tuple(boxes[0][1]) == tuple(size):
        return None  # the common case: one chunk, all of it
    # Cut every dimension where a chunk starts or ends: each chunk covers whole pieces of
    # the grid these cuts make; the chunks tile the tensor when each piece is covered once.
    cuts = [
        sorted({0, n, *(o[d] for o, _ in boxes), *(o[d] + k[d] for o, k in boxes)})
        for d, n in enumerate(size)
    ]
    pieces = math.prod(len(c) - 1 for c in cuts)
    if pieces > max(_PIECES_PER_CHUNK * len(boxes), _MIN_PIECES):
        return (
            f"has {len(boxes)} chunks that cut it into {pieces} pieces, not the grid of "
            "shards a save writes"
        )
    at = [{v: i for i, v in enumerate(c)} for c in cuts]
    step = [math.prod(len(c) - 1 for c in cuts[d + 1 :]) for d in range(len(size))]
    seen = bytearray(pieces)
    for o, k in boxes:
        spans = [range(at[d][a], at[d][a + n]) for d, (a, n) in enumerate(zip(o, k))]
        for piece in itertools.product(*spans):
            i = sum(p * s for p, s in zip(piece, step))
            if seen[i]:
                where = [cuts[d][p] for d, p in enumerate(piece)]
                return f"has chunks that overlap at element {where}"
            seen[i] = 1
    gap = seen.find(0)
    if gap >= 0 and whole:
        where = [cuts[d][(gap // s) % (len(cuts[d]) - 1)] for d, s in enumerate(step)]
        return f"has no chunk that stores element {where} (its chunks leave a gap)"
    return None


def _slabs_tile(
    size: Sequence[int], offsets: Sequence[Any], sizes: Sequence[Any], whole: bool
) -> bool:
    """True when every chunk spans the tensor but along one dimension, the same for all (the
    shards of a ``Shard(d)`` save: FSDP's rows), and in order along it each begins where the
    one before ends (``whole``: from 0 to the end; else it may also begin later). A few passes
    in C (maps, sets; a sort only where they are out of order), where the general check's
    grid costs a step in Python per chunk; False also for anything wrong, which the general
    check then names."""
    size = tuple(size)
    if not size or not offsets or not all(size):
        return False
    d = next((i for i, (k, n) in enumerate(zip(sizes[0], size)) if k != n), 0)
    shapes = set(sizes)  # (a few: the shards' own, the last's, the empty one)
    for j in range(len(size)):  # every other dimension: all of it
        at = operator.itemgetter(j)
        if j != d and (set(map(at, offsets)) != {0} or set(map(at, shapes)) != {size[j]}):
            return False
    along = operator.itemgetter(d)
    starts, lengths = list(map(along, offsets)), list(map(along, sizes))
    if max(starts) > size[d]:  # (an empty chunk stores nothing: inside is all it must be)
        return False
    if 0 in lengths:
        starts = list(itertools.compress(starts, lengths))
        lengths = list(itertools.compress(lengths, lengths))
    if not starts:
        return not whole
    if not all(map(operator.lt, starts, starts[1:])):
        starts, lengths = map(list, zip(*sorted(zip(starts, lengths))))
    ends = list(map(operator.add, starts, lengths))
    if whole:
        return starts[0] == 0 and starts[1:] == ends[:-1] and ends[-1] == size[d]
    return all(map(operator.le, ends[:-1], starts[1:])) and ends[-1] <= size[d]


def _corrupt(where: str, key: str, problem: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{where}: tensor {key[:200]!r} {problem}; the step cannot be trusted and is not read. "
        "Load another step (muon-ckpt ls lists them)"
    )


def check_tensors(md: Metadata, where: str, tiles: bool = True) -> None:
    """Every tensor of ``md`` is tiled exactly by its chunks (without ``tiles``: chunks inside
    it that do not overlap), each non-empty chunk stored in an item of at least its bytes (no
    storage transform: its expansion has no bound); every stored object has an item. Raises
    CheckpointCorruptError naming the first tensor that is not. (That no two items share
    bytes of a file, and each lies inside its file, is ``check_ranges``'s: it needs the
    files' sizes.) ``md.storage_data`` is a ``StorageIndex`` (``parse_metadata`` makes it):
    where each row is its key's next chunk's item (as a save stores them), one pass over
    the rows checks them all (``_layouts.rows_hold``); else, where its rows are in the
    metadata's order (``align``), a tensor's items are its rows in turn; else each is looked
    up, as DCP's dict would find it."""
    index: Any = md.storage_data
    layouts, ints = Layouts(), set(map(type, index.lengths)) <= {int}
    try:  # (each layout once, the rows in one pass: _layouts)
        state = md.state_dict_metadata
        want = {key: _layout(key, meta, where, tiles, layouts) for key, meta in state.items()}
        if rows_hold(index, want, ints):
            return
    except CheckpointCorruptError:
        pass  # (the checks one by one, below, name the first problem in the metadata's order)
    if not index.align(md.state_dict_metadata):
        index.unique()  # (each index once, as in DCP's dict)
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            if index.row(key, None) is None:
                raise _corrupt(where, key, "is an object with no stored item")
            continue
        if not isinstance(meta, TensorStorageMetadata):
            raise _corrupt(where, str(key), f"is described by a {type(meta).__name__}")
        _check_tensor(key, meta, index, where, tiles, layouts, ints)
    how = index.how or []
    for row in itertools.compress(range(len(how)), how):  # (the compressed items)
        info = index.info(row)
        ours = isinstance(info.transform_descriptors, (list, tuple))
        ours = ours and list(info.transform_descriptors) == [DESCRIPTOR]
        meta = md.state_dict_metadata.get(index.fqns[row])
        if ours and isinstance(meta, TensorStorageMetadata):
            continue
        raise CheckpointCorruptError(
            f"{where}: an item of {str(info.relative_path)[:200]!r} is stored with the DCP "
            f"storage transforms {str(info.transform_descriptors)[:200]}, which muon-ckpt "
            "does not read "
            + (
                "for a non-tensor value. Load another step (muon-ckpt ls lists them)"
                if ours
                else "(what they expand to has no bound; it reads only its own "
                f"[{DESCRIPTOR!r}]). Load it with torch.distributed.checkpoint if you trust it"
            )
        )


def _layout(key: str, meta: Any, where: str, tiles: bool, layouts: Layouts) -> Layout:
    """A key's layout (an object's: one item at no offset, of any length), checked."""
    if isinstance(meta, BytesStorageMetadata):
        return ([None], [0], True)
    if not isinstance(meta, TensorStorageMetadata):
        raise _corrupt(where, str(key), f"is described by a {type(meta).__name__}")
    size, itemsize = _header(key, meta, where)
    layout = layouts.get(size, meta.chunks, itemsize)
    if layout is None:
        cols = _checked_chunks(key, meta.chunks, size, where, tiles)
        layout = layouts.add(size, meta.chunks, cols, itemsize)
    return layout


def _header(key: str, meta: TensorStorageMetadata, where: str) -> tuple[tuple[int, ...], int]:
    """The tensor's size and item size, checked (and that its chunks are a list)."""
    props, size = meta.properties, _dims(meta.size)
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        raise _corrupt(where, key, "has no dtype")
    if size is None:
        raise _corrupt(where, key, f"has the size {str(meta.size)[:200]}")
    if not isinstance(meta.chunks, list):
        raise _corrupt(where, key, "has no list of chunks")
    return size, props.dtype.itemsize


def _check_tensor(
    key: str,
    meta: TensorStorageMetadata,
    index: Any,
    where: str,
    tiles: bool,
    layouts: Layouts,
    ints: bool,
) -> None:
    layout = _layout(key, meta, where, tiles, layouts)
    if _items_hold(key, meta.chunks, layout[1], index, ints):
        return
    size, itemsize = _header(key, meta, where)
    cols = _checked_chunks(key, meta.chunks, size, where, tiles)
    for offsets, sizes in zip(*cols):  # (one by one, to name the first that is not)
        if not all(sizes):
            continue
        row = index.row(key, offsets)
        if row is None:
            raise _corrupt(where, key, f"has no stored item for its chunk at {list(offsets)}")
        info = index.info(row)
        nbytes = math.prod(sizes) * itemsize
        most = MAX_RATIO if info.transform_descriptors else 1
        if type(info.length) is not int or info.length * most < nbytes:
            raise _corrupt(
                where,
                key,
                f"declares {nbytes} bytes for its chunk at {list(offsets)}, stored in "
                + (
                    f"a compressed item of {info.length} bytes (at most {most}x)"
                    if most > 1
                    else f"an item of {info.length} bytes"
                ),
            )


def _checked_chunks(
    key: str, chunks: list[Any], size: tuple[int, ...], where: str, tiles: bool
) -> tuple[list[Any], list[Any]]:
    """The chunks' offsets and sizes, each inside the tensor of ``size`` and tiling it
    (``tiles``; else apart); CheckpointCorruptError naming the first that is not."""
    cols = _all_dims(chunks, len(size))
    if cols is None:  # (one by one, to name the first bad chunk)
        for c in chunks:
            offsets = (
                _dims(getattr(c, "offsets", None)) if isinstance(c, ChunkStorageMetadata) else None
            )
            sizes = _dims(getattr(c, "sizes", None)) if offsets is not None else None
            if sizes is None or len(offsets) != len(size) or len(sizes) != len(size):
                raise _corrupt(
                    where, key, f"of {len(size)} dimensions has the chunk {str(c)[:200]}"
                )
        raise AssertionError("unreachable: every chunk checked out one by one")
    problem = tiling_problem(size, *cols, whole=tiles)
    if problem is not None:
        raise _corrupt(where, key, problem)
    return cols


def _items_hold(key: str, chunks: list[Any], full: list[int], index: Any, ints: bool) -> bool:
    """Whether every non-empty chunk has a stored item of at least its bytes (``full``;
    ``MAX_RATIO`` times, compressed), for all chunks at once, in C (maps); False for any
    doubt. Where the rows are aligned (``StorageIndex.align``), the tensor's rows are its
    chunks' in turn; ``ints``: every item's length is a plain int."""
    rows = index.group(key)  # (its chunks' rows, in order: align checked their offsets)
    if rows is None:
        cols = chunks.columns() if isinstance(chunks, ChunkList) else None
        offsets = cols[0] if cols else list(map(operator.attrgetter("offsets"), chunks))
        offsets = map(tuple, itertools.compress(offsets, full))  # (as _all_dims makes them)
        full = list(itertools.compress(full, full))
        rows = list(map(index.rows().get, zip(itertools.repeat(key), offsets)))
        if None in rows:
            return False
    lengths = map(index.lengths.__getitem__, rows)
    if not ints or index.how:
        lengths = list(lengths)
        if set(map(type, lengths)) - {int}:
            return False
    if index.how:
        packed = map(bool, map(index.how.__getitem__, rows))
        lengths = list(map(operator.mul, lengths, map(_RATIO.__getitem__, packed)))
    return all(map(operator.ge, lengths, full))


_RATIO = {False: 1, True: MAX_RATIO}


def check_held_chunks(sd: dict[str, Any], md: Metadata, where: str) -> None:
    """A checkpoint of one rank's own state (a memory-tier part, whose chunks need not tile
    the tensors): each tensor of ``sd`` it stores is stored as exactly the chunks this rank
    holds (a DTensor's local shards, a plain tensor whole), so that a load writes every
    element of this rank's targets and nothing else."""
    from torch.distributed.tensor import DTensor

    for key, v in sd.items():
        meta = md.state_dict_metadata.get(key)
        if not isinstance(v, torch.Tensor) or not isinstance(meta, TensorStorageMetadata):
            continue
        if isinstance(v, DTensor):
            c = chunk_of(v)
            want = [(tuple(c.offsets), tuple(c.sizes))]
        else:
            want = [((0,) * v.dim(), tuple(v.shape))]
        got = sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)
        if [w for w in want if all(w[1])] != [g for g in got if all(g[1])]:
            raise _corrupt(where, key, f"stores the chunks {got[:4]}, this rank holds {want[:4]}")
