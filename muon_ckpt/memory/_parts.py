"""Writing parts (this rank's own, from a save's snapshot) and moving them between ranks
(replicas after a save; a restore's fetch from a peer), each one committed by its manifest,
written last.

A part moves as its files' bytes: the sender offers its manifest, the receiver says whether
it takes it (room, budget), then the files follow in pieces of at most 64 MiB, each checked
against the manifest's CRC32C as it arrives; a part whose bytes do not match is not kept (it
is received to the end all the same, so both sides stay in step). Every rank that takes part
in an exchange runs the same list of transfers in the same order (``transfers``): no two
ranks wait on each other in a cycle.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import muon_ckpt._collective as coll
import muon_ckpt._dcp as _dcp
from muon_ckpt._errors import CheckpointError
from muon_ckpt._interrupts import Stop
from muon_ckpt._version import __version__
from muon_ckpt.memory._dirs import MAX_PART_MANIFEST, part_manifest
from muon_ckpt.save import FileRecords, StepWriter, WritePolicy
from muon_ckpt.state import HostStaging
from muon_ckpt.store import MANIFEST, FileEntry, Manifest, Storage, open_regular
from muon_ckpt.store.checksums import Checksum

__all__ = ["drop_part", "nbytes_of", "receive_part", "send_part", "write_own_part"]

_log = logging.getLogger("muon_ckpt")

PIECE = 64 << 20  # bytes per message of a part's file
_ITEM_OVERHEAD = 4096  # bytes a stored item takes beyond its tensor's (zip records)


def nbytes_of(sd: dict[str, Any]) -> int:
    """About the bytes a part of ``sd`` takes: its tensors' bytes, and some per item."""
    from muon_ckpt._tensors import local_tensor

    n = 0
    for v in sd.values():
        if isinstance(v, torch.Tensor):
            t = local_tensor(v)
            n += t.numel() * t.element_size()
        n += _ITEM_OVERHEAD
    return n + (1 << 20)


class _StagedPlanner:
    """Made lazily: DCP's default save planner whose items each wait for their copy."""

    @staticmethod
    def make(staging: HostStaging) -> Any:
        from muon_ckpt.save import StagedSavePlanner

        return StagedSavePlanner(staging)


def _private_dir(path: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    os.mkdir(path, 0o700)


def drop_part(path: str) -> None:
    """Remove a part: its manifest first (a crash half way leaves no committed part); a
    link in its place is removed, never followed."""
    if os.path.islink(path):
        os.unlink(path)
        return
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.unlink(os.path.join(path, MANIFEST))
    shutil.rmtree(path, ignore_errors=True)


def _commit(path: str, m: Manifest) -> None:
    """Make the part's files private, then write its manifest (0600) by a rename."""
    for name in m.files:
        os.chmod(os.path.join(path, name), 0o600)
    tmp = os.path.join(path, f"{MANIFEST}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(m.to_json())
    os.replace(tmp, os.path.join(path, MANIFEST))


def write_own_part(
    run_dir: str,
    rel: str,
    step: int,
    sd: dict[str, Any],
    staging: HostStaging,
    *,
    world_size: int,
    line: str | None,
    gen: int,
    retires: list[tuple[int, int]],
    memory: dict[str, Any],
    extra: dict[str, Any],
    io_threads: int,
    digests: bool = False,
    before_commit: Callable[[], None] | None = None,
    stop: Stop | None = None,
) -> Manifest:
    """Write this rank's flat state dict ``sd`` (a snapshot's host copies) as the part ``rel``
    of ``run_dir`` (a leftover there is replaced) and commit it, uncompressed (``digests``:
    each tensor's SHA-256 recorded, as the url's saves do); ``before_commit`` may still
    refuse it (a deferred snapshot whose source changed); once ``stop`` is set, no file
    starts."""
    path = os.path.join(run_dir, rel)
    drop_part(path)
    _private_dir(path)
    records = FileRecords()
    policy = WritePolicy(digests=digests)
    writer = StepWriter(Storage(run_dir), rel, records, io_threads, policy=policy, stop=stop)
    what = f"keeping step {step} in host memory ({path})"
    _dcp.save(sd, writer, _StagedPlanner.make(staging), None, what, alone=True)
    if before_commit is not None:
        before_commit()
    m = Manifest(
        step=step,
        world_size=world_size,
        files=dict(sorted(records.files.items())),
        time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__,
        muon_ckpt_version=__version__,
        extra={**extra, "memory": memory},
        line=line,
        gen=gen,
        retires=list(retires),
    )
    _commit(path, m)
    return m


def send_part(path: str | None, dst: int, group: Any) -> None:
    """Offer the part at ``path`` (None: nothing to offer) to rank ``dst``; send its files if
    taken."""
    header = None
    if path is not None:
        where = os.path.join(path, MANIFEST)
        try:  # gone since it was listed, or not a regular file now: offered as nothing
            with os.fdopen(open_regular(where, where), "rb") as f:
                header = f.read(MAX_PART_MANIFEST + 1)
        except (OSError, CheckpointError) as e:
            _log.warning("memory tier: %s is not sent to rank %d: %s", path, dst, e)
    with coll.communicating(f"sending a memory-tier part to rank {dst}"):
        dist.send_object_list([header], dst=dst, group=group)
        if header is None:
            return
        answer = [None]
        dist.recv_object_list(answer, src=dst, group=group)
        if answer[0] is not True:
            return
        m = part_manifest(header, os.path.join(str(path), MANIFEST))
        for name, entry in sorted(m.files.items()):
            _send_file(os.path.join(str(path), name), entry.size, dst, group)


def _send_file(where: str, size: int, dst: int, group: Any) -> None:
    """``size`` bytes of a file, in pieces; what cannot be read (gone, shrunk since its
    manifest, not a regular file: a FIFO would block the open, a symlink lead elsewhere) goes
    as zeros, which the receiver's check refuses: the stream stays in step."""
    try:
        fd: int | None = open_regular(where, where)
    except (OSError, CheckpointError) as e:
        _log.warning("memory tier: %s cannot be read: %s", where, e)
        fd = None
    try:
        for at in range(0, size, PIECE):
            n = min(PIECE, size - at)
            buf = bytearray(n)
            got = 0
            if fd is not None:
                with contextlib.suppress(OSError):
                    got = os.preadv(fd, [buf], at)
            if got != n:
                buf[got:] = bytes(n - got)
            dist.send(torch.frombuffer(buf, dtype=torch.uint8), dst=dst, group=group)
    finally:
        if fd is not None:
            os.close(fd)


def receive_part(
    run_dir: str,
    rel: str,
    src: int,
    group: Any,
    *,
    expect: Callable[[Manifest], str | None],
) -> tuple[Manifest | None, str | None]:
    """Take the part rank ``src`` offers into ``run_dir/rel`` (replacing what is there once
    it is complete and checked). ``expect(manifest)`` says why not to take it (None: take).
    Returns (its manifest, None), or (None, why it was not kept; None: nothing offered)."""
    header: list[Any] = [None]
    with coll.communicating(f"receiving a memory-tier part from rank {src}"):
        dist.recv_object_list(header, src=src, group=group)
        data = header[0]
        if data is None:
            return None, None
        where = f"the part rank {src} sent ({rel})"
        try:
            if not isinstance(data, bytes) or len(data) > MAX_PART_MANIFEST:
                raise CheckpointError(f"{where}: its manifest is not one")
            m: Manifest | None = part_manifest(data, where)
            why = expect(m)  # type: ignore[arg-type]
        except CheckpointError as e:
            m, why = None, str(e)
        dist.send_object_list([why is None], dst=src, group=group)
        if why is not None or m is None:
            return None, why
        path = os.path.join(run_dir, rel)
        incoming = f"{path}.incoming"
        problem = None
        try:
            drop_part(incoming)
            _private_dir(incoming)
        except OSError as e:
            problem = f"{incoming}: {e}"
        try:
            for name, entry in sorted(m.files.items()):
                problem = _receive_file(incoming, name, entry, src, group, problem)
            if problem is None:
                try:
                    _commit(incoming, m)
                    drop_part(path)
                    os.rename(incoming, path)
                except OSError as e:
                    problem = f"{path}: {e}"
        except BaseException:  # the sender gone, a timeout: nothing half received is left
            drop_part(incoming)
            raise
        if problem is not None:
            drop_part(incoming)
            return None, problem
        return m, None


def _receive_file(
    incoming: str, name: str, entry: FileEntry, src: int, group: Any, problem: str | None
) -> str | None:
    """One file of a part: every piece received (the stream stays in step whatever happens),
    written and checked while nothing has gone wrong (``problem``)."""
    fd = None
    where = os.path.join(incoming, name)
    if problem is None:
        try:
            fd = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            problem = f"{where}: {e}"
    check = Checksum.like(entry, where)
    try:
        for at in range(0, entry.size, PIECE):
            n = min(PIECE, entry.size - at)
            buf = torch.empty(n, dtype=torch.uint8)
            dist.recv(buf, src=src, group=group)
            if problem is None and fd is not None:
                view = memoryview(buf.numpy())
                check.update(view)
                try:
                    os.pwrite(fd, view, at)
                except OSError as e:
                    problem = f"{where}: {e}"
        if problem is None and (check.size != entry.size or check.hexdigest() != entry.digest):
            problem = (
                f"{where}: {entry.algorithm} {check.hexdigest()}, its manifest says "
                f"{entry.digest}: the copy is damaged and not kept"
            )
    finally:
        if fd is not None:
            os.close(fd)
    return problem
