"""What a failure of the storage is (``is_storage_failure``), and the error it becomes
(``storage_error``): the one place both are decided, for ``Storage`` and the readers and
writers that call the storage's clients through DCP."""

from __future__ import annotations

from muon_ckpt._collective import is_dist, rank
from muon_ckpt._errors import CheckpointStorageError
from muon_ckpt.store._retry import RequestFailed

__all__ = ["is_storage_failure", "storage_error"]

_STORAGE_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "fsspec")


def is_storage_failure(e: BaseException) -> bool:
    """Whether ``e`` comes from the storage (I/O, network, the storage client)."""
    if isinstance(e, (OSError, TimeoutError, ConnectionError)):
        return True
    return any(c.__module__.startswith(_STORAGE_MODULES) for c in type(e).__mro__[:-1])


def storage_error(e: BaseException, what: str) -> CheckpointStorageError:
    """The CheckpointStorageError for ``e``, raised while doing ``what`` (names the URL, and
    the rank in a process group)."""
    where = f" on rank {rank()}" if is_dist() and not isinstance(e, RequestFailed) else ""
    return CheckpointStorageError(
        f"{what} failed{where}: {type(e).__name__}: {e}. Check the URL and storage_options "
        "(endpoint_url, credentials) and that the storage is reachable; then retry"
    )
