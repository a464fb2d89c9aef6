"""What the write of one step to the url takes (``WriteSpec``: the options and the step as the
coordinator hands it over, ``Handoff``; or a memory step's files, ``Prebuilt``) and what it did
(``Written``): a write's inputs and its results as two types."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from muon_ckpt._config import ManagerConfig
from muon_ckpt._errors import CheckpointError
from muon_ckpt._interrupts import Stop
from muon_ckpt.save._dedup import DedupBase
from muon_ckpt.save._line import Admission
from muon_ckpt.save._snapshot import Snapshot
from muon_ckpt.save._writer import StepWriter, WritePolicy
from muon_ckpt.store import Catalog, data_dirname

__all__ = ["Handoff", "Prebuilt", "WriteSpec", "Written"]


class Prebuilt(Protocol):
    """A step's files written and checksummed elsewhere (the memory tier's parts), which a
    save copies instead of writing a snapshot: each rank copies its own, rank 0 writes the
    step's ``.metadata`` from every rank's share of it."""

    keys: int  # this rank's keys (the manifest's "keys", as len(sd) of a snapshot)
    about: dict[str, Any]  # what the parts' manifests say of the state (``Handoff.about``)

    def copy(self, writer: StepWriter) -> Any:
        """This rank's files copied (``writer.prepare`` with all their items first, then
        ``writer.copy_file`` each); its share of the metadata."""
        ...

    def metadata(self, shares: list[Any]) -> tuple[Any, list[Any]]:
        """Rank 0: the step's DCP metadata and each rank's write results, from the shares."""
        ...


@dataclass(frozen=True)
class Handoff:
    """A step as the save coordinator hands it to a writer (the url's or the memory tier's):
    its snapshot, its admission, and what the manifest's ``extra`` says of the state
    (``state.describe``: the optimizer's type, the layout, the update rules)."""

    step: int
    snap: Snapshot  # host tensors (or the live ones, for a synchronous save) and objects
    admission: Admission  # rank 0's plan, the line, the save's id, what it may refer to
    about: dict[str, Any] = field(default_factory=dict)


@dataclass
class WriteSpec:
    """What the write of one step to the url takes: the manager's options, the step handed
    over (its snapshot is written, or ``parts`` copied as they are). Its results are a
    ``Written``."""

    catalog: Catalog
    config: ManagerConfig
    handoff: Handoff
    world_size: int  # ranks that took the snapshot (the process group it needs)
    group: Any = None  # process group of the collectives (None: the default group)
    verified: tuple[int, int] | None = None  # the newest step known to verify: retention keeps it
    gate: threading.Event | None = None  # tests: the write starts once this is set
    parts: Prebuilt | None = None  # files copied as they are instead of the snapshot written
    stop: Stop = field(default_factory=Stop)  # Ctrl-C: no new file, no commit

    def check_stop(self) -> None:  # (before the read-back, and before the commit)
        if self.stop.is_set:
            raise CheckpointError(f"step {self.step} is not committed: stopped by Ctrl-C")

    @property
    def step(self) -> int:
        return self.handoff.step

    @property
    def snap(self) -> Snapshot:
        return self.handoff.snap

    @property
    def admission(self) -> Admission:
        return self.handoff.admission

    @property
    def policy(self) -> WritePolicy:
        return WritePolicy.of(self.config)

    @property
    def data_dir(self) -> str | None:
        """With dedup, the directory under <url>/data/ the data files go to (format 3); else
        None: the step's own directory (format 2)."""
        if not self.config.dedup:
            return None
        return data_dirname(self.step, self.admission.save_id)

    @property
    def base(self) -> DedupBase | None:
        """What the run holds that the save refers to when unchanged (with dedup)."""
        return self.admission.base if self.config.dedup else None


@dataclass
class Written:
    """What the write of one step did on this rank (filled as it goes: a failed one keeps
    what it measured)."""

    committed_at: float | None = None  # time.perf_counter() once the step was committed
    gen: int | None = None  # once committed: its generation (the plan its job committed by)
    written_bytes: int = 0  # bytes of the files this rank wrote
    referred_bytes: int = 0  # bytes of the unchanged tensors it referred to instead
    next_base: DedupBase | None = None  # once committed with dedup: the next save's base
    timings: dict[str, float] = field(default_factory=dict)
