"""A save's last two acts on rank 0: the commit (every rank's files, once the replicas agree,
as the step's manifest) and the tidy after it (retention, retired steps deleted)."""

from __future__ import annotations

import logging
from typing import Any

from muon_ckpt._config import reads_back
from muon_ckpt.save._replicas import differing
from muon_ckpt.save._spec import WriteSpec
from muon_ckpt.save._writer import StepWriter
from muon_ckpt.store import METADATA, FileEntry, confirm_files, data_ref, step_dirname

__all__ = ["commit", "tidy"]

_log = logging.getLogger("muon_ckpt")


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


def tidy(w: WriteSpec) -> None:
    """Rank 0, after the commit: retention and the retired steps deleted (a failure is a
    WARNING: the step is committed)."""
    step, plan, keep_last = w.step, w.admission.plan, w.config.keep_last
    try:
        # The step just committed was read back whole (its references included)
        checked = (step, plan.gen) if reads_back(w.config.confirm) else w.verified
        replaced, deleted = w.catalog.tidy(keep_last, step, plan.drop, checked)
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
