"""A save's last two acts on rank 0: the commit (every rank's files, once the replicas agree,
as the step's manifest) and the tidy after it (retention, retired steps deleted); and, where
the broadcast of the commit's outcome failed, that outcome decided from the storage
(``settle``), so no rank reports a committed step as failed."""

from __future__ import annotations

import logging
from typing import Any

import muon_ckpt._collective as coll
from muon_ckpt._config import reads_back
from muon_ckpt._errors import CheckpointCollectiveError, CheckpointError
from muon_ckpt.save._replicas import differing
from muon_ckpt.save._spec import WriteSpec
from muon_ckpt.save._writer import StepWriter
from muon_ckpt.store import (
    MANIFEST,
    METADATA,
    FileEntry,
    confirm_files,
    data_ref,
    step_dirname,
    write_dirname,
)

__all__ = ["commit", "publish", "settle", "tidy"]

_log = logging.getLogger("muon_ckpt")
_COMMIT_REQUESTS = 6  # requests rank 0's commit sends one after another (listing ... swap)


def _outcome_key(w: WriteSpec) -> str:
    return f"{w.step}/{w.admission.plan.gen}:"


def commit_posted(
    w: WriteSpec, writer: StepWriter, dirname: str, gathered: list[Any], seconds: float
) -> None:
    """Rank 0: ``commit``, its end posted in the store for ranks whose broadcast fails."""
    try:
        commit(w, writer, dirname, gathered, seconds)
    finally:
        coll.post("commit", _outcome_key(w), w.group)


def settle(w: WriteSpec, err: CheckpointCollectiveError) -> None:
    """The broadcast of the commit's outcome failed (``err``): once rank 0's commit has ended
    (its post, bounded by the commit's own requests), the manifest of this save's generation on
    the storage decides. Committed: a WARNING and the save stands; else ``err``, which says so."""
    bound = (w.config.storage_timeout or w.config.collective_timeout) * _COMMIT_REQUESTS
    coll.posted("commit", _outcome_key(w), bound, w.group)
    st, step, gen = w.catalog.storage, w.step, w.admission.plan.gen
    try:
        names = dict.fromkeys((step_dirname(step), write_dirname(step, w.admission.plan.beside)))
        committed = any(_holds(w, n, gen) for n in names)
    except Exception as e:
        raise CheckpointError(
            f"{err}; whether step {step} was committed could not be read from "
            f"{st.url_of(step_dirname(step), MANIFEST)} ({type(e).__name__}: {e}): check with "
            "steps() before saving it again"
        ) from err
    if not committed:
        raise CheckpointCollectiveError(f"{err}; step {step} is not committed") from err
    _log.warning(
        "step %d was committed (its manifest is on the storage) though the ranks could not "
        "agree on it afterwards: %s",
        step,
        err,
    )


def _holds(w: WriteSpec, name: str, gen: int) -> bool:
    try:
        return w.catalog.manifest(w.step, name).gen == gen
    except FileNotFoundError:  # (CheckpointNotFoundError)
        return False


def commit(
    w: WriteSpec, writer: StepWriter, dirname: str, gathered: list[Any], seconds: float
) -> None:
    """Rank 0: every rank's files (or its failure) committed as the step's manifest, once
    the replicas agree; a copy's ``.metadata`` written first, as DCP's finish writes it."""
    w.check_stop()
    files: dict[str, FileEntry] = {}
    data_gens: dict[str, int] = {}
    for part, err, part_gens, _, _ in gathered:
        if err is not None:
            raise err
        files.update(part)
        data_gens.update(part_gens)
    bad = differing(w.step, [sums for *_, sums, _ in gathered])
    if bad is not None:
        raise bad
    storage, config = w.catalog.storage, w.config
    if w.parts is not None:
        writer.finish(*w.parts.metadata([s for *_, s in gathered]))
        md = {METADATA: writer.fs.records.files[METADATA]}
        confirm_files(storage, dirname, md, config.confirm, writer.thread_count)
        files.update(md)
    listed = {ref[0] for n in files if (ref := data_ref(n)) is not None}
    keys = len(w.snap.sd) if w.parts is None else w.parts.keys
    extra: dict[str, Any] = {"io_threads": config.write_threads, "keys": keys, **w.handoff.about}
    m = w.catalog.commit(
        w.step,
        w.world_size,
        files,
        extra,
        plan=w.admission.plan,
        line=w.admission.line,
        data=w.data_dir,
        compressed=writer.compressed,
        data_gens={d: g for d, g in data_gens.items() if d in listed},
    )
    _log.info(
        "committed step %d to %s: %d files, %d bytes, written in %.2f s (%d bytes new; "
        "the rest unchanged since earlier steps)",
        w.step,
        storage.url_of(step_dirname(w.step)),
        len(m.files),
        m.total_bytes,
        seconds,
        m.written_bytes,
    )


def tidy(w: WriteSpec) -> bool:
    """Rank 0, after the commit: retention and the retired steps deleted (a failure is a
    WARNING: the step is committed); whether there was any to apply."""
    step, plan, keep_last = w.step, w.admission.plan, w.config.keep_last
    others = w.catalog.records.others(w.admission.line)  # (records a commit removes)
    if keep_last is None and not plan.retires and not plan.drop and not others:
        return False
    _retain(w, step, plan.gen, keep_last, plan.drop)
    return True


def publish(w: WriteSpec) -> None:
    """Rank 0, after the save's last change: the run's index written (a failure is a
    WARNING: an index that is not current is only not used)."""
    try:
        w.catalog.publish()
    except Exception as e:
        _log.warning("%s: the run's index was not written: %s", w.catalog.storage.url, e)


def _retain(w: WriteSpec, step: int, gen: int, keep_last: int | None, drop: list[int]) -> None:
    try:
        # The step just committed was read back whole (its references included)
        checked = (step, gen) if reads_back(w.config.confirm) else w.verified
        replaced, deleted = w.catalog.tidy(keep_last, step, drop, checked)
    except Exception as e:  # the step is committed: a failed clean-up does not undo that
        _log.warning("retention after step %d failed (steps kept): %s", step, e)
        return
    if replaced:
        _log.warning(
            "%s: deleted steps %s, replaced by this run's line (a rewind or a new run)",
            w.catalog.storage.url,
            replaced,
        )
    if deleted:
        _log.info("retention (keep_last=%d) deleted steps %s", keep_last, deleted)
