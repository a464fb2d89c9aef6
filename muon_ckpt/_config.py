"""CheckpointManager configuration, checked once, at construction, by a table of rules: each
names the field, what it must be, the value found and what to do."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from muon_ckpt._zstd import require_zstd

__all__ = ["ManagerConfig", "MemoryOptions", "read_threads"]

# "checksum": sizes and the manifest's checksums (CRC32C, or zlib crc32 in older manifests) of
# every file read; "crc32" is its name before CRC32C, still accepted; "size": sizes only.
VERIFY_MODES = ("checksum", "crc32", "size")
# How a save confirms that the storage holds what it wrote (``store.confirm_files``): its
# checksums read back ("crc32": the name of "checksum" before CRC32C), sizes only, or nothing.
CONFIRM_MODES = ("checksum", "crc32", "size", "off")
COMPRESSIONS = (None, "zstd")


def reads_back(confirm: str) -> bool:
    """Whether ``confirm`` (one of CONFIRM_MODES) reads every byte written back: a step so
    committed is known to verify, its references included."""
    return confirm in ("checksum", "crc32")


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
# written. docs/reference.md's options table is these rows (tests/manager/test_readme.py checks it,
# and the defaults against CheckpointManager's signature); CheckpointManager's docstring is
# built from them. MEMORY_OPTIONS is the same for MemoryOptions and the reference's table.
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
    "async_save": "`True`: `save()` returns after the snapshot; write and commit run in the "
    'background. `"deferred"`: the same, and `save()` only queues the copies of parameters and '
    "optimizer states; the next `optimizer.step()` waits for them",
    "max_staging_bytes": "bound on the host memory of a snapshot (None: no bound); a save that "
    "needs more runs synchronously",
    "collective_timeout": "seconds a rank waits for the others in `save()`/`load()` before it "
    "raises, naming the ranks that did not join",
    "storage_timeout": (
        "seconds one storage request may take, its retries included (None: the client's own "
        "timeout per attempt)"
    ),
    "lease_seconds": "the run's write lease expires this long after this job's last save",
    "confirm": "before a commit, each rank reads its files back and checks their CRC32C; "
    '`"size"`: sizes only; `"off"`',
    "dedup": "a save writes only the tensors whose bytes differ (SHA-256) from the step the "
    "run continues from and refers to the others; data files live in `<url>/data/`, shared "
    "by the steps (False: every step writes all of its state into its own directory)",
    "dedup_max_age": "a save refers only to data written by one of its last N saves; an "
    "unchanged tensor stored longer ago is written again (about 1/N of the unchanged state per "
    "save), so a damaged file reaches at most N steps; at most `keep_last - 1` saves where "
    "`keep_last` >= 2, so no data file is in every kept step; 1: every save writes every tensor",
    "compression": '`"zstd"`: tensors of 64 KiB and more are stored losslessly compressed '
    "(about 1.2x fp32, 1.45x bf16), by the writer threads; needs `muon-ckpt[zstd]`. Off by "
    "default: plain DCP readers (`dcp_to_torch_save`) cannot open a compressed step, and on a "
    'local disk it slows saves (docs/format.md, "Compressed items")',
    "read_once": "state several ranks load whole is read by one rank and sent to the others "
    "(None: when storage is remote or ranks span hosts)",
    "new_run": "a first `save()` without `load()` may start a new run where another run's "
    "steps are: they are deleted once its first step is committed",
    "certify_replicas": "before a commit, the ranks holding a replicated shard (a DTensor's "
    "`Replicate()` placement: HSDP, tensor parallelism) compare its CRC32C; a mismatch fails "
    "the save on every rank, nothing committed (one more pass over the replicated bytes)",
    "memory": "`MemoryOptions(interval=K, ...)`: also keep every K-th step in host memory that "
    "outlives the process, restored first by `load()` (see the memory tier, below); None: off",
}

MEMORY_OPTIONS: dict[str, str] = {
    "interval": "`save(step)` also keeps the step in the tier when `step % interval == 0` "
    "(written in the background; never counted as persisted); `load()` restores it first "
    "when it is the newest step",
    "dir": "the tier's directory on this rank (created 0700; None: "
    "`/dev/shm/muon-ckpt-<uid>`); each run has its own directory in it",
    "replicas": "copies of each rank's part kept by ranks on other nodes",
    "node_size": "consecutive ranks per node, for replicas (None: `LOCAL_WORLD_SIZE`)",
    "keep": "steps kept (older ones are deleted once a newer one is complete on every rank)",
    "flush": "`close()` saves the newest memory step to `url` when it is newer than the "
    "newest committed one: the bytes the tier holds of it (nothing when a part is damaged)",
}


# ---------------------------------------------------------------------- the rules
@dataclass(frozen=True)
class Rule:
    """``field`` must be ``expected``, which ``ok(value)`` tells; ``fix``: what to do when not."""

    field: str
    ok: Callable[[Any], bool]
    expected: str
    fix: str = ""


def check(owner: str, obj: object, rules: tuple[Rule, ...]) -> None:
    """The first rule ``obj`` breaks, as a ValueError naming ``owner`` + the field, what it
    must be, the value found and what to do."""
    for r in rules:
        v = getattr(obj, r.field)
        if not r.ok(v):
            fix = f"; {r.fix}" if r.fix else ""
            raise ValueError(f"{owner}{r.field} must be {r.expected}, got {v!r}{fix}")


def _ints(lo: int, hi: int | None = None, none: bool = False) -> Callable[[Any], bool]:
    return lambda v: (none and v is None) or (_is_int(v) and lo <= v and (hi is None or v <= hi))


def _seconds(none: bool = False, finite: bool = False) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        if none and v is None:
            return True
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        return number and v > 0 and not (finite and v == float("inf"))

    return ok


def _flag(none: bool = False) -> Callable[[Any], bool]:
    return lambda v: v is True or v is False or (none and v is None)


def _one_of(modes: tuple[str, ...]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in modes


def _options(v: Any) -> bool:
    return v is None or isinstance(v, dict)


def _resume_from(v: Any) -> bool:
    if v is None or (isinstance(v, str) and v):
        return True
    pair = isinstance(v, tuple) and len(v) == 2
    return pair and isinstance(v[0], str) and _is_int(v[1]) and v[1] >= 0


def _local_dir(v: Any) -> bool:
    return v is None or (isinstance(v, str) and bool(v) and "://" not in v)


_MEMORY_RULES = (
    Rule("interval", _ints(1), "an int >= 1", "memory=None turns the memory tier off"),
    Rule(
        "dir",
        _local_dir,
        "a local directory path or None",
        "a directory in host memory (tmpfs); None: /dev/shm/muon-ckpt-<uid>",
    ),
    Rule(
        "dir",
        lambda v: v is not None or os.path.isdir("/dev/shm"),
        "a directory path: this machine has no /dev/shm (the default for None)",
        "pass dir=, a directory in host memory (tmpfs) of your own",
    ),
    Rule("replicas", _ints(0), "an int >= 0", "0: no copies on other nodes"),
    Rule("node_size", _ints(1, none=True), "an int >= 1 or None", "None: LOCAL_WORLD_SIZE"),
    Rule("keep", _ints(1), "an int >= 1", "the newest complete step is always kept"),
    Rule("flush", _flag(), "True or False"),
)

_RULES = (
    Rule(
        "url",
        lambda v: isinstance(v, str) and bool(v),
        "a non-empty string (local path or fsspec URL)",
    ),
    Rule(
        "keep_last",
        _ints(1, none=True),
        "an int >= 1 (or None to keep every step)",
        "the newest committed step is never deleted",
    ),
    Rule("interval", _ints(1, none=True), "an int >= 1 (or None to save on every call)"),
    Rule(
        "storage_options",
        _options,
        "a dict of fsspec options or None",
        "pass them as {name: value}, e.g. {'endpoint_url': ...}",
    ),
    Rule(
        "resume_storage_options",
        _options,
        "a dict of fsspec options or None",
        "None: storage_options",
    ),
    Rule(
        "resume_from",
        _resume_from,
        "a URL string or a (url, step) pair with step >= 0",
        "or .../step-XXXXXXXX, or None",
    ),
    Rule(
        "io_threads",
        _ints(1, 64, none=True),
        "an int in [1, 64] or None",
        "None chooses from the storage and the cores",
    ),
    Rule("verify", _one_of(VERIFY_MODES), f"one of {VERIFY_MODES}"),
    Rule(
        "async_save",
        lambda v: v is True or v is False or (isinstance(v, str) and v == "deferred"),
        'False, True or "deferred"',
        'True saves in the background; "deferred" also defers the copies of the snapshot',
    ),
    Rule("collective_timeout", _seconds(finite=True), "a number of seconds > 0"),
    Rule(
        "max_staging_bytes",
        _ints(0, none=True),
        "an int >= 0 (bytes) or None for no bound",
    ),
    Rule(
        "storage_timeout", _seconds(none=True), "a number of seconds > 0", "None: the client's own"
    ),
    Rule("lease_seconds", _seconds(), "a number of seconds > 0"),
    Rule("confirm", _one_of(CONFIRM_MODES), f"one of {CONFIRM_MODES}"),
    Rule(
        "read_once", _flag(none=True), "None, True or False", "None: chosen per storage and hosts"
    ),
    Rule("new_run", _flag(), "True or False"),
    Rule("certify_replicas", _flag(), "True or False"),
    Rule("dedup", _flag(), "True or False", "False: every save writes every tensor"),
    Rule(
        "dedup_max_age",
        _ints(1),
        "an int >= 1 (saves)",
        "1 writes every tensor at every save; the default 10 writes unchanged ones every 10th",
    ),
    Rule(
        "compression",
        lambda v: v is None or _one_of(COMPRESSIONS[1:])(v),
        f"one of {COMPRESSIONS}",
        "None: tensors are stored as they are",
    ),
    Rule(
        "memory",
        lambda v: v is None or isinstance(v, MemoryOptions),
        "a muon_ckpt.MemoryOptions or None",
        "e.g. memory=MemoryOptions(interval=10)",
    ),
)


def _fspath(obj: object, name: str) -> None:
    """``obj.name`` as a str when it is an ``os.PathLike``."""
    v = getattr(obj, name)
    if isinstance(v, os.PathLike):
        object.__setattr__(obj, name, os.fspath(v))


# ---------------------------------------------------------------------- the options
@dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    """The memory tier of a CheckpointManager (``memory=``): recent steps kept in host memory
    that outlives the process, replicated to ranks on other nodes, restored first. Checked at
    construction: a bad value is a ValueError naming the field and the value."""

    interval: int
    dir: str | None = None
    replicas: int = 1
    node_size: int | None = None
    keep: int = 1
    flush: bool = True

    def __post_init__(self) -> None:
        _fspath(self, "dir")
        check("MemoryOptions.", self, _MEMORY_RULES)
        if self.dir is not None:
            object.__setattr__(self, "dir", os.path.abspath(self.dir))


MemoryOptions.__doc__ = (
    (MemoryOptions.__doc__ or "")
    + "\n\n    Args:\n"
    + "".join(f"        {k}: {text.replace('`', '``')}\n" for k, text in MEMORY_OPTIONS.items())
)


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """The options of CheckpointManager (``OPTIONS`` says what each means), checked once, at
    construction by ``_RULES``: a bad value is a ValueError naming the field and the value."""

    url: str
    keep_last: int | None = None
    interval: int | None = None
    storage_options: dict[str, Any] | None = None
    resume_from: str | tuple[str, int] | None = None
    io_threads: int | None = None
    verify: str = "checksum"
    async_save: bool | Literal["deferred"] = False
    max_staging_bytes: int | None = None
    storage_timeout: float | None = 60.0
    lease_seconds: float = 600.0
    confirm: str = "checksum"
    dedup: bool = True
    dedup_max_age: int = 10
    compression: str | None = None
    collective_timeout: float = 600.0
    resume_storage_options: dict[str, Any] | None = None
    read_once: bool | None = None
    new_run: bool = False
    certify_replicas: bool = False
    memory: MemoryOptions | None = None

    @property
    def deferred(self) -> bool:
        """Whether a save's copies of parameters and states finish after ``save()`` returns."""
        return self.async_save == "deferred"

    @property
    def write_threads(self) -> int:
        """Files a save writes in parallel per rank."""
        return WRITE_THREADS if self.io_threads is None else self.io_threads

    def read_threads(self, local: bool) -> int:
        """Threads a load from local (or remote) storage reads with (``read_threads``)."""
        return read_threads(self.io_threads, local)

    @property
    def dedup_bound(self) -> int:
        """How many consecutive saves hold a data file at most (the one that wrote it, then
        those that refer to it): ``dedup_max_age``, and at most ``keep_last - 1`` where
        ``keep_last`` >= 2, so that every data file is missing from a step retention keeps
        (one damaged file never leaves no step to load)."""
        n = self.keep_last
        return self.dedup_max_age if n is None or n < 2 else min(self.dedup_max_age, n - 1)

    def __post_init__(self) -> None:
        _fspath(self, "url")
        _fspath(self, "resume_from")
        rf = self.resume_from
        if isinstance(rf, (tuple, list)) and len(rf) == 2:  # a (url, step) pair, kept as one
            url = os.fspath(rf[0]) if isinstance(rf[0], os.PathLike) else rf[0]
            object.__setattr__(self, "resume_from", (url, rf[1]))
        check("", self, _RULES)
        if self.compression == "zstd":
            require_zstd()  # now, not at the first save: an ImportError saying what to install

    @property
    def resume_kwargs(self) -> dict[str, Any]:
        opts = self.resume_storage_options
        return dict((self.storage_options or {}) if opts is None else opts)

    @property
    def storage_kwargs(self) -> dict[str, Any]:
        return dict(self.storage_options or {})
