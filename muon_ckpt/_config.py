"""CheckpointManager configuration: checked once, at construction, naming the field and value."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from muon_ckpt._zstd import require_zstd

__all__ = ["ManagerConfig", "read_threads"]

# "checksum": sizes and the manifest's checksums (CRC32C, or zlib crc32 in older manifests) of
# every file read; "crc32" is its name before CRC32C, still accepted; "size": sizes only.
VERIFY_MODES = ("checksum", "crc32", "size")
CONFIRM_MODES = ("checksum", "crc32", "size", "off")  # as muon_ckpt.store.CONFIRM_MODES
COMPRESSIONS = (None, "zstd")
SNAPSHOT_MODES = ("blocking", "deferred")  # when a save's copies of parameters finish


def checks_content(verify: str) -> bool:
    """Whether ``verify`` (one of VERIFY_MODES) checks checksums, not just sizes."""
    return verify != "size"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Files a rank writes in parallel when ``io_threads`` is None (the save benchmarks' setting).
WRITE_THREADS = 4


def read_threads(io_threads: int | None, local: bool = True) -> int:
    """The threads a load reads with: ``io_threads``, or when None, from local storage, half
    the cores this process may run on, at least 4 and at most 8 (a process that may run on
    every core of its host shares them with the other ranks there: ``LOCAL_WORLD_SIZE``, set
    by torchrun; one pinned to some of them has those to itself); from remote storage 4
    (each remote reading thread holds up to about three 128 MiB blocks; more were not
    measured). On the 16-core GPU host, 4 GiB of 16 and 64 MiB tensors loaded from local files
    into CUDA tensors 1.1-1.3x faster with 8 threads than with 4, and no faster with 12 or 16
    (docs/benchmarks.md)."""
    if io_threads is not None:
        return io_threads
    if not local:
        return WRITE_THREADS
    host = os.cpu_count() or 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cores = host
    if cores >= host:  # not pinned: shared with the host's other ranks
        ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
        cores //= max(1, int(ranks)) if ranks.isdigit() else 1
    return min(8, max(4, cores // 2))


# Every argument of CheckpointManager and what it means: the one place these words are
# written. README's options table is these rows (tests/test_readme.py checks it, and the
# defaults against CheckpointManager's signature); CheckpointManager's docstring is built
# from them.
OPTIONS: dict[str, str] = {
    "url": "run root: local path, `file://`, `memory://`, `s3://`, `gs://`, any fsspec URL; "
    "each step is `<url>/step-<8 digits>/`",
    "model": "its `state_dict()` is saved and loaded in place (DTensors reshard); keys are "
    "FQNs without `_orig_mod.` (`torch.compile`) or `module.` (DDP); a module's "
    "`get_extra_state()` loads through its `set_extra_state()`",
    "optimizer": "any `torch.optim.Optimizer`; its state is keyed by parameter name, never "
    "by position",
    "extra": "`{name: obj}` with `state_dict()`/`load_state_dict()` (a scheduler); the same "
    "on every rank (each save checks) and saved once",
    "rank_extra": "like `extra`, but each rank's own (its data position, RNG state); loaded "
    "back by the same rank, at the same world size",
    "keep_last": "keep the N newest committed steps (None: all); older ones are deleted "
    "after each commit, never the newest",
    "interval": "`save(step)` saves when `step % interval == 0` (None: every call)",
    "storage_options": "fsspec options: credentials, `endpoint_url`, ...",
    "resume_from": "a URL, `(url, step)` or `.../step-XXXXXXXX` to load while `url` has no "
    "committed step (start a run from another one)",
    "resume_storage_options": "fsspec options for `resume_from` (None: `storage_options`)",
    "io_threads": "files written in parallel per rank, and reading threads (1-64); None: 4 "
    "files; 4 threads from remote storage, half this rank's cores (4 to 8) from local storage",
    "verify": 'a load checks size and CRC32C of every byte it reads; `"size"`: sizes only',
    "async_save": "`save()` returns after the snapshot; write and commit run in the background",
    "max_staging_bytes": "bound on the host memory of a snapshot (None: no bound); a save that "
    "needs more runs synchronously",
    "collective_timeout": "seconds a rank waits for the others in `save()`/`load()` before it "
    "raises, naming the ranks that did not join",
    "storage_timeout": "seconds one storage request may take (None: the client's own)",
    "lease_seconds": "the run's write lease expires this long after this job's last save",
    "confirm": "before a commit, each rank reads its files back and checks their CRC32C; "
    '`"size"`: sizes only; `"off"`',
    "dedup": "a save writes only the tensors whose bytes differ (SHA-256) from the step the "
    "run continues from and refers to the others; data files live in `<url>/data/`, shared "
    "by the steps (False: every step writes all of its state into its own directory)",
    "compression": '`"zstd"`: tensors of 64 KiB and more are stored losslessly compressed '
    "(about 1.2x fp32, 1.45x bf16), by the writer threads; needs `muon-ckpt[zstd]`. Off by "
    "default: plain DCP readers (`dcp_to_torch_save`) cannot open a compressed step, and on a "
    'local disk it slows saves (docs/format.md, "Compressed items")',
    "read_once": "state several ranks load whole is read by one rank and sent to the others "
    "(None: when storage is remote or ranks span hosts)",
    "new_run": "a first `save()` without `load()` may start a new run where another run's "
    "steps are: they are deleted once its first step is committed",
    "snapshot": '`"deferred"` (with `async_save`): `save()` only queues the copies of parameters '
    "and optimizer states; the next `optimizer.step()` waits for them",
    "memory_interval": "`save(step)` also keeps every K-th step in host memory that outlives "
    "the process (the memory tier, written in the background; never counted as persisted); "
    "`load()` restores it first when it is the newest step (None: off)",
    "memory_dir": "the memory tier's directory on this rank (created 0700; None: "
    "`/dev/shm/muon-ckpt-<uid>`); each run has its own directory in it",
    "replicas": "copies of each rank's memory-tier part kept by ranks on other nodes",
    "node_size": "consecutive ranks per node, for replicas (None: `LOCAL_WORLD_SIZE`)",
    "memory_keep": "memory-tier steps kept (older ones are deleted once a newer one is "
    "complete on every rank)",
    "memory_flush": "`close()` saves the newest memory-tier step to `url` when it is newer than "
    "the newest committed one (the state must still be that step's)",
}


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """The options of CheckpointManager (``OPTIONS`` says what each means), checked once, at
    construction: a bad value is a ValueError naming the field and the value."""

    url: str
    keep_last: int | None = None
    interval: int | None = None
    storage_options: dict[str, Any] | None = None
    resume_from: str | tuple[str, int] | None = None
    io_threads: int | None = None
    verify: str = "checksum"
    async_save: bool = False
    max_staging_bytes: int | None = None
    storage_timeout: float | None = 60.0
    lease_seconds: float = 600.0
    confirm: str = "checksum"
    dedup: bool = True
    compression: str | None = None
    collective_timeout: float = 600.0
    resume_storage_options: dict[str, Any] | None = None
    read_once: bool | None = None
    new_run: bool = False
    snapshot: str = "blocking"
    memory_interval: int | None = None
    memory_dir: str | None = None
    replicas: int = 1
    node_size: int | None = None
    memory_keep: int = 1
    memory_flush: bool = True

    @property
    def write_threads(self) -> int:
        """Files a save writes in parallel per rank."""
        return WRITE_THREADS if self.io_threads is None else self.io_threads

    def read_threads(self, local: bool) -> int:
        """Threads a load from local (or remote) storage reads with (``read_threads``)."""
        return read_threads(self.io_threads, local)

    def __post_init__(self) -> None:
        if isinstance(self.url, os.PathLike):
            object.__setattr__(self, "url", os.fspath(self.url))
        if not isinstance(self.url, str) or not self.url:
            raise ValueError(
                f"url must be a non-empty string (local path or fsspec URL), got {self.url!r}"
            )
        if self.keep_last is not None and (not _is_int(self.keep_last) or self.keep_last < 1):
            raise ValueError(
                f"keep_last must be an int >= 1 (or None to keep every step), got "
                f"{self.keep_last!r}; the newest committed step is never deleted"
            )
        if self.interval is not None and (not _is_int(self.interval) or self.interval < 1):
            raise ValueError(
                f"interval must be an int >= 1 (or None to save on every call), got "
                f"{self.interval!r}"
            )
        for name in ("storage_options", "resume_storage_options"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, dict):
                raise ValueError(
                    f"{name} must be a dict of fsspec options or None, got {type(v).__name__} {v!r}"
                )
        rf = self.resume_from
        if isinstance(rf, os.PathLike):
            object.__setattr__(self, "resume_from", os.fspath(rf))
            rf = self.resume_from
        if rf is not None and not (isinstance(rf, str) and rf):
            ok = (
                isinstance(rf, (tuple, list))
                and len(rf) == 2
                and isinstance(rf[0], (str, os.PathLike))
                and _is_int(rf[1])
                and rf[1] >= 0
            )
            if not ok:
                raise ValueError(
                    f"resume_from must be a URL string or a (url, step) pair with step >= 0, "
                    f"got {rf!r}"
                )
            object.__setattr__(self, "resume_from", (os.fspath(rf[0]), int(rf[1])))
        n = self.io_threads
        if n is not None and (not _is_int(n) or not 1 <= n <= 64):
            raise ValueError(f"io_threads must be an int in [1, 64] or None, got {n!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if not isinstance(self.async_save, bool):
            raise ValueError(f"async_save must be True or False, got {self.async_save!r}")
        t = self.collective_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"collective_timeout must be a number of seconds > 0, got {t!r}")
        m = self.max_staging_bytes
        if m is not None and (not _is_int(m) or m < 0):
            raise ValueError(
                f"max_staging_bytes must be an int >= 0 (bytes) or None for no bound, got {m!r}"
            )
        for name in ("storage_timeout", "lease_seconds"):
            v = getattr(self, name)
            if not (v is None and name == "storage_timeout") and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
            ):
                raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
        if self.read_once not in (None, True, False):
            raise ValueError(f"read_once must be None, True or False, got {self.read_once!r}")
        if self.snapshot not in SNAPSHOT_MODES:
            raise ValueError(f"snapshot must be one of {SNAPSHOT_MODES}, got {self.snapshot!r}")
        if self.snapshot == "deferred" and not self.async_save:
            raise ValueError(
                "snapshot='deferred' needs async_save=True: a synchronous save writes the "
                "state before it returns, so there is nothing to defer"
            )
        if not isinstance(self.new_run, bool):
            raise ValueError(f"new_run must be True or False, got {self.new_run!r}")
        if self.confirm not in CONFIRM_MODES:
            raise ValueError(f"confirm must be one of {CONFIRM_MODES}, got {self.confirm!r}")
        if not isinstance(self.dedup, bool):
            raise ValueError(f"dedup must be True or False, got {self.dedup!r}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        if self.compression == "zstd":
            require_zstd()  # now, not at the first save: an ImportError saying what to install
        self._check_memory()

    def _check_memory(self) -> None:
        mi = self.memory_interval
        if mi is not None and (not _is_int(mi) or mi < 1):
            raise ValueError(
                f"memory_interval must be an int >= 1 (or None: no memory tier), got {mi!r}"
            )
        d = self.memory_dir
        if isinstance(d, os.PathLike):
            object.__setattr__(self, "memory_dir", os.fspath(d))
            d = self.memory_dir
        if d is not None and (not isinstance(d, str) or not d or "://" in d):
            raise ValueError(f"memory_dir must be a local directory path or None, got {d!r}")
        if d is not None:
            object.__setattr__(self, "memory_dir", os.path.abspath(d))
        elif mi is not None and not os.path.isdir("/dev/shm"):
            raise ValueError(
                "memory_interval is set but this machine has no /dev/shm: pass memory_dir, a "
                "directory in host memory (tmpfs) of your own"
            )
        if not _is_int(self.replicas) or self.replicas < 0:
            raise ValueError(f"replicas must be an int >= 0, got {self.replicas!r}")
        n = self.node_size
        if n is not None and (not _is_int(n) or n < 1):
            raise ValueError(f"node_size must be an int >= 1 or None, got {n!r}")
        if not _is_int(self.memory_keep) or self.memory_keep < 1:
            raise ValueError(f"memory_keep must be an int >= 1, got {self.memory_keep!r}")
        if not isinstance(self.memory_flush, bool):
            raise ValueError(f"memory_flush must be True or False, got {self.memory_flush!r}")

    @property
    def resume_kwargs(self) -> dict[str, Any]:
        opts = self.resume_storage_options
        return dict((self.storage_options or {}) if opts is None else opts)

    @property
    def storage_kwargs(self) -> dict[str, Any]:
        return dict(self.storage_options or {})
