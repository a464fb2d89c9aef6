"""Open a checkpoint root and find its problems at once: ``open_storage``.

At construction, not at the first save an hour later: a malformed URL (``s3:/x``, an unknown
scheme, an object key with an empty, ``.`` or ``..`` component: ``Storage``) or storage
options the filesystem does not accept are a ``ValueError``; missing
credentials, an unreachable endpoint, a missing bucket or a refused access are a
``CheckpointStorageError`` naming what to fix. The probe is one cheap request (S3: HEAD of the
bucket) with a retry budget of its own (``_retry``: at most ``_PROBE_TIMEOUT`` seconds, less
when ``storage_timeout`` is; an endpoint that refuses connections is not tried again), so a
transient error does not end a job at its start. A missing bucket is never created.
A run's url that is a step's directory (``check_run_root``) is a ``ValueError`` too: a run
written inside another run's step is deleted with it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Any

from muon_ckpt._errors import CheckpointError, CheckpointStorageError
from muon_ckpt.store._catalog import Catalog
from muon_ckpt.store._layout import MANIFEST, METADATA, parse_step_dirname
from muon_ckpt.store._retry import Budget, own_retries
from muon_ckpt.store._storage import DEFAULT_TIMEOUT, Storage, is_storage_failure
from muon_ckpt.store._url import bad_options, check_url

__all__ = ["check_run_root", "open_run", "open_storage"]

_PROBE_TIMEOUT = 5.0  # seconds: the probe's budget, its retries included
# Options a local path takes (fsspec's own, and the local filesystem's): anything else in
# storage_options was meant for a remote filesystem, whose URL this is not.
_LOCAL_OPTIONS = frozenset(
    {"auto_mkdir", "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}
)


def _check_options(field: str, url: str, storage: Storage, options: dict[str, Any]) -> None:
    """Options that cannot be what the user meant: remote options with a local path, an
    endpoint without a scheme."""
    if storage.is_local:
        foreign = sorted(set(options) - _LOCAL_OPTIONS)
        if foreign:
            raise ValueError(
                f"{field} {url!r} is a local path, but storage_options has {foreign}: options "
                "of a remote filesystem (s3fs, gcsfs, ...). Give the remote URL "
                "(s3://bucket/prefix, gs://...), or drop those options"
            )
    endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get(
        "endpoint_url"
    )
    if isinstance(endpoint, str) and "://" not in endpoint:
        raise ValueError(
            f"storage_options endpoint_url {endpoint!r} (for {field} {url!r}) has no scheme: "
            f"write http://{endpoint} or https://{endpoint}"
        )


def _endpoint(tester: Storage | None, options: dict[str, Any]) -> str:
    """The endpoint the probe's request went to, for its error: the S3 client's own (from
    storage_options, AWS_ENDPOINT_URL or the AWS config), else the one the options name."""
    named = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
    try:  # s3fs made its client for the request that failed
        used = tester.fs.s3.meta.endpoint_url if tester is not None else None
    except Exception:  # not s3fs, or no client: nothing more is known
        used = None
    return str(used or named or "the filesystem's default endpoint")


def _explain(
    e: BaseException, url: str, bucket: str, options: dict[str, Any], endpoint: str
) -> Exception:
    last = getattr(e, "last", e)  # (a request that ran out of its budget: its last failure)
    name = type(last).__name__
    if isinstance(e, TypeError):
        return bad_options(url, options, e)
    if name == "NoCredentialsError" or "credentials" in str(last).lower():
        return CheckpointStorageError(
            f"{url!r}: no credentials for the storage ({name}: {e}); pass them in "
            "storage_options (key=, secret=), the environment (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY) or a profile"
        )
    if isinstance(last, FileNotFoundError):
        return CheckpointStorageError(
            f"{url!r}: the bucket {bucket!r} does not exist at {endpoint}; create it first "
            "(muon-ckpt never creates buckets) or fix the URL"
        )
    if isinstance(last, PermissionError):
        return CheckpointStorageError(
            f"{url!r}: access to the bucket {bucket!r} is denied ({e}); check the credentials "
            "and the bucket's policy"
        )
    if "Connect" in name or "Endpoint" in name or "Timeout" in name:
        return CheckpointStorageError(
            f"{url!r}: cannot reach the storage at {endpoint} ({name}: {e}); check the "
            "endpoint (endpoint_url in storage_options, else AWS_ENDPOINT_URL or the AWS "
            "config) and the network"
        )
    return CheckpointStorageError(f"{url!r}: the storage refused a first request ({name}: {e})")


def open_storage(
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    field: str = "url",
    timeout: float | None = DEFAULT_TIMEOUT,
    probe: bool = True,
) -> Storage:
    """The Storage of checkpoint root ``url``, checked: ValueError for a malformed URL or
    options (naming ``field``), CheckpointStorageError when the storage cannot be used
    (``probe``: one request to the bucket of an object store)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{field} must be a non-empty string, got {url!r}")
    check_url(field, url)
    options = dict(storage_options or {})
    try:
        storage = Storage(url, options, timeout=timeout)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from e
    _check_options(field, url, storage, options)
    if probe and storage.object_store:
        bucket = storage.root.strip("/").split("/", 1)[0]
        tester = None
        try:
            bound = min(_PROBE_TIMEOUT, timeout or _PROBE_TIMEOUT)
            tester = Storage(url, options, timeout=bound)  # (a filesystem of its own)
            own_retries(tester.fs, Budget(bound, reconnect=False))
            if hasattr(tester.fs, "call_s3"):
                tester.fs.call_s3("head_bucket", Bucket=bucket)
            else:
                tester.fs.info(bucket)
        except CheckpointError:
            raise
        except Exception as e:
            if isinstance(e, TypeError) or is_storage_failure(e):
                raise _explain(e, url, bucket, options, _endpoint(tester, options)) from e
            raise
    try:
        storage.check_root()
    except CheckpointStorageError:
        raise
    except CheckpointError as e:
        raise ValueError(f"{field} must be a directory or bucket prefix, got {url!r}: {e}") from e
    return storage


def check_run_root(storage: Storage, url: str, fix: Callable[[str, int | None], str]) -> None:
    """A ValueError when ``url`` is a step's directory, not a run's root: its last component
    is a step directory's name (``step-XXXXXXXX``, ``overwrite-step-...``) and it holds no
    step directory (a run's root may have any name), or it holds a step's ``manifest.json``
    or DCP's ``.metadata``. The message ends with ``fix(run url, step)`` (step: None when
    the name is not a step's). One listing of the root."""
    base = posixpath.basename(url.rstrip("/"))
    step = parse_step_dirname(base.removeprefix("overwrite-"))
    names = storage.list_dirs()
    steps = [n for n, d in names.items() if d and parse_step_dirname(n) is not None]
    own = [n for n in (MANIFEST, METADATA) if n in names]
    if not own and (step is None or steps):
        return
    which = f"step {step}" if step is not None else f"a checkpoint (it holds {own[0]})"
    run = url.rstrip("/")[: -len(base)].rstrip("/") or ("/" if url.startswith("/") else ".")
    raise ValueError(f"{url!r} is the directory of {which}, not a run; {fix(run, step)}")


def _manager_fix(run: str, step: int | None) -> str:
    source = f"({run!r}, {step})" if step is not None else "<this url>"
    return (
        "a run written inside it would be deleted with it by the run that holds it. To "
        f"resume that run, give its url ({run!r}); to start a new run from this step, give "
        f"a new url and resume_from={source}. Nothing was written"
    )


def open_run(
    url: str,
    options: dict[str, Any],
    *,
    timeout: float | None,
    lease_seconds: float,
    resume_from: str | tuple[str, int] | None = None,
    resume_options: dict[str, Any] | None = None,
) -> tuple[Catalog, tuple[Catalog, int | None] | None]:
    """The catalog of run root ``url``, and of ``resume_from`` with the step it names (a
    ``.../step-XXXXXXXX`` URL names one; None: its newest), each storage checked
    (``open_storage``)."""
    catalog = Catalog(
        open_storage(url, options, field="url", timeout=timeout), lease_seconds=lease_seconds
    )
    check_run_root(catalog.storage, url, _manager_fix)
    if resume_from is None:
        return catalog, None
    rf_url, rf_step = (resume_from, None) if isinstance(resume_from, str) else resume_from
    base = posixpath.basename(rf_url.rstrip("/"))
    if rf_step is None and parse_step_dirname(base) is not None:
        rf_step = parse_step_dirname(base)
        rf_url = rf_url.rstrip("/")[: -len(base)].rstrip("/") or "/"
    opts = options if resume_options is None else resume_options
    storage = open_storage(rf_url, opts, field="resume_from", timeout=timeout)
    return catalog, (Catalog(storage), rf_step)
