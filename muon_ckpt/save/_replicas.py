"""Certified replicas: before a commit, the holders of each replicated shard compare its
checksum, and a mismatch fails the save on every rank.

DCP writes a replicated shard once, from one of its holders; a replica silently corrupted
(a bit flipped in one device's memory) would otherwise be written, or hidden, unnoticed.
Each rank computes the CRC32C (the manifests' algorithm, ``store.write_algorithm``) of every
shard it holds that the mesh replicates: a DTensor with ``Replicate()`` over a mesh dim of
more than one rank (HSDP's replicate dim, tensor parallelism's replicated params) or on a
submesh (under FSDP x TP, a param TP leaves alone is sharded over the dp slice only, and
each tp rank holds the same shards), model and optimizer state alike, from the copy the
save writes. Rank 0 compares them with the files'
records before the commit (``differing``). Plain tensors every rank holds are not compared:
DCP's convention is that they may differ (DDP's BatchNorm statistics) and one is written.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from muon_ckpt._errors import CheckpointError
from muon_ckpt._shards import shard_box
from muon_ckpt.store.checksums import crc_function, crc_hex, write_algorithm

__all__ = ["differing", "replica_checksums"]

Shard = tuple[str, tuple[int, ...]]  # (key, offsets of the shard in the full tensor)


def _replicated(v: Any, world: int) -> bool:
    """Whether other ranks of the save's ``world`` hold ``v``'s shard too: ``Replicate()``
    over a mesh dim of more than one rank, or a mesh of fewer ranks than the save's (a param
    tensor parallelism leaves alone, on the data-parallel slice of each tp rank: the ranks at
    its coordinates on the other slices hold the same shard)."""
    if not isinstance(v, DTensor):
        return False
    mesh = v.device_mesh
    if mesh.size() < world:
        return True
    return any(isinstance(pl, Replicate) and mesh.shape[i] > 1 for i, pl in enumerate(v.placements))


def replica_checksums(
    step: int, sd: dict[str, Any], world: int
) -> tuple[dict[Shard, str], CheckpointError | None]:
    """(key, offsets) -> the checksum of this rank's copy, for each replicated shard of
    ``sd`` (a save's snapshot, its copies landed; ``world``: the save's ranks) that is not
    empty; or the failure (no collective here: every rank goes on to the gather where rank 0
    raises it for all)."""
    try:
        return _checksums(sd, world), None
    except Exception as e:
        return {}, CheckpointError(f"saving step {step}: checksumming its replicas: {e!r}")


def _checksums(sd: dict[str, Any], world: int) -> dict[Shard, str]:
    crc = crc_function(write_algorithm())
    out: dict[Shard, str] = {}
    for key, v in sd.items():
        if not _replicated(v, world):
            continue
        t = v.to_local().detach()
        if t.numel() == 0:
            continue
        t = t.cpu().contiguous().reshape(-1).view(torch.uint8)
        out[(key, shard_box(v)[0])] = crc_hex(crc(0, t.numpy()))
    return out


def differing(step: int, per_rank: list[dict[Shard, str]]) -> CheckpointError | None:
    """Rank 0: the error that refuses ``step`` when the holders of a replicated shard hold
    different bytes (``per_rank``: each rank's ``replica_checksums``), naming the shards and
    which rank holds which; None when every replica agrees."""
    held: dict[Shard, dict[str, list[int]]] = {}
    for rank, sums in enumerate(per_rank):
        for shard, crc in sums.items():
            held.setdefault(shard, {}).setdefault(crc, []).append(rank)
    bad = {s: by for s, by in held.items() if len(by) > 1}
    if not bad:
        return None
    shown = []
    for (key, offsets), by in sorted(bad.items())[:6]:
        # (the fewest holders first: with three or more replicas, the odd one out)
        ranks = sorted(by.items(), key=lambda kv: (len(kv[1]), kv[1]))
        held_by = ", ".join(f"rank {r}: {c}" for c, rs in ranks for r in rs)
        shown.append(f"{key!r} at {list(offsets)} ({held_by})")
    more = f"; ... ({len(bad)} in all)" if len(bad) > 6 else ""
    return CheckpointError(
        f"saving step {step}: the replicas of {len(bad)} replicated shard(s) differ, so a "
        f"replica holds corrupted data (a silent data corruption on that rank's device) or "
        f"the ranks diverged: {'; '.join(shown)}{more}. Step {step} is not committed and the "
        "newest committed step is unchanged; the rank whose checksum differs from the "
        "others' holds the odd copy: check that device, then resume from the last step"
    )
