"""What a checkpoint url may be, and the filesystem it opens (``open_fs``): a scheme followed
by ``://`` (``check_url``) whose filesystem is installed, storage options it accepts
(``bad_options`` names a typo), a remote path without a character its filesystem parses out
of a key (``_check_chars``: ``?``, ``#``, ``*``, ``[``), and on a flat key space (object
stores, ``memory://``) a key without empty, ``.`` or ``..`` components (``_check_key``)."""

from __future__ import annotations

import re
from typing import Any

import fsspec
from fsspec.core import split_protocol, url_to_fs

__all__ = ["OBJECT_STORES", "bad_options", "check_url", "open_fs"]

# Object stores: no directories (and creating one may create a bucket).
OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"}
_FLAT = OBJECT_STORES | {"memory"}  # a path is a key: nothing resolves '.', '..' or '//'

# A scheme of 2+ characters followed by ':' but not '://' ("s3:/ckpt", "gs:bucket").
_HALF_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)(.*)$")


def check_url(field: str, url: str) -> None:
    """A ValueError for a url whose scheme lacks its '//' (``s3:/ckpt``), naming ``field``."""
    m = _HALF_URL.match(url)
    if m is not None:
        scheme, rest = m.groups()
        raise ValueError(
            f"{field} {url!r} is not a valid URL: the scheme {scheme!r} must be followed by "
            f"'://' (did you mean {scheme}://{rest.lstrip('/')}?). A local path whose first "
            f"part holds ':' can be written ./{url}"
        )


def open_fs(url: str, options: dict[str, Any], timeout: float | None) -> tuple[Any, str, str]:
    """(filesystem, root without a trailing '/', protocol) of ``url``; a ValueError naming
    what to change for a scheme that cannot be opened, options it refuses, or a key that
    is not plain."""
    options = _timeout_options(url, options, timeout)
    try:
        fs, root = url_to_fs(url, **options)
    except TypeError as e:
        raise bad_options(url, options, e) from e
    except (ValueError, ImportError) as e:
        scheme = url.split("://", 1)[0] if "://" in url else "file"
        known = sorted(fsspec.available_protocols())
        raise ValueError(
            f"url {url!r}: cannot open scheme {scheme!r} ({e}). Use a local path or an "
            f"fsspec URL whose filesystem is installed (e.g. pip install 'muon-ckpt[s3]' "
            f"for s3://); known schemes: {', '.join(known[:20])}, ..."
        ) from e
    root = root.rstrip("/") or "/"
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol not in ("file", "local"):
        _check_chars(url, protocol)
    if protocol in _FLAT:
        _check_key(url, protocol, root)
    return fs, root, protocol


def bad_options(url: str, options: dict[str, Any], e: TypeError) -> ValueError:
    """The ValueError for storage options the filesystem does not accept (a typo)."""
    m = re.search(r"unexpected keyword argument '([^']+)'", str(e))
    which = f"the option {m.group(1)!r}" if m else f"one of {sorted(options)}"
    return ValueError(
        f"url {url!r}: storage_options: {which} is not accepted ({e}); check the spelling "
        "against the filesystem's documentation (s3fs: key, secret, token, endpoint_url, "
        "client_kwargs, config_kwargs, ...)"
    )


# What a remote filesystem parses out of a path instead of keeping it in the key: fsspec
# reads '*', '?' and '[' as a pattern of names (in rm, copy, expand_path: a delete of the
# run's steps would reach other keys); s3fs cuts '?versionId=...' off every key, gcsfs
# '#<generation>' and '?generation=...', adlfs '?versionid=...'.
_PARSED = {
    "?": "s3fs and gcsfs read what follows '?' as an object version (versionId, generation), "
    "so the run's files would go to another key, and fsspec reads '?' as a pattern of names",
    "#": "gcsfs reads what follows '#' as an object generation, so the run's files would go "
    "to another key",
    "*": "fsspec reads '*' as a pattern of names: deleting the run's old steps would delete "
    "every key it matches",
    "[": "fsspec reads '[' as a pattern of names: deleting the run's old steps would delete "
    "every key it matches",
}


def _check_chars(url: str, scheme: str) -> None:
    """A ValueError for a remote url with a character its filesystem parses out of a key
    (``_PARSED``): ``s3://b/run7?versionId=abc`` wrote the run's lease over the object
    ``run7``."""
    path = url.split("://", 1)[-1]
    found = [c for c in _PARSED if c in path]
    if not found:
        return
    c = min(found, key=path.index)
    plain = url[: len(url) - len(path) + path.index(c)].rstrip("/")
    fix = f"use {plain}" if c in "?#" else "use a name without '*', '?', '[' or '#'"
    raise ValueError(
        f"url {url!r}: the object key has {c!r}: {_PARSED[c]}. A url of {scheme}:// "
        f"names one prefix, plainly (no version, query or pattern); {fix}"
    )


def _check_key(url: str, scheme: str, root: str) -> None:
    """A ValueError for a url of a flat key space whose key has an empty, ``.`` or ``..``
    component (``runs//run7``, ``runs/./run7``): the store keeps it in the key as it is,
    where it names no directory, some S3-compatible stores rewrite or refuse it, and
    another tool, or the url spelled plainly, looks under another key."""
    names = root.strip("/").split("/") if root.strip("/") else []
    odd = [n for n in names if n in ("", ".", "..")]
    if not odd:
        return
    kept: list[str] = []
    for n in names:
        if n == "..":
            if len(kept) <= 1:  # (not above the bucket)
                kept = []
                break
            kept.pop()
        elif n not in ("", "."):
            kept.append(n)
    what = "an empty component ('//')" if "" in odd else f"a {odd[0]!r} component"
    plain = "/".join(kept)
    why = f"it is another key than {plain!r}" if kept else "'..' leads above the bucket"
    fix = f"{scheme}://{plain}" if kept else "a prefix inside the bucket"
    raise ValueError(
        f"url {url!r}: the object key has {what}, which {scheme}:// keeps as it is ({why}; "
        "it names no directory); S3-compatible stores may rewrite or refuse it, and other "
        f"tools look under another key. Write the key plainly: use {fix}"
    )


def _timeout_options(url: str, options: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """``options`` with ``timeout`` as the connect and read timeout of the S3 client, unless
    the user set those (other schemes: as given)."""
    if timeout is None or split_protocol(url)[0] not in ("s3", "s3a"):
        return options
    cfg = dict(options.get("config_kwargs") or {})
    cfg.setdefault("connect_timeout", timeout)
    cfg.setdefault("read_timeout", timeout)
    return {**options, "config_kwargs": cfg}
