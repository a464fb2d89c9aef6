"""What the command prints, and how it reads its options: escaping of everything that comes
from a checkpoint, strict JSON, byte counts, errors in the command line's words, ``KEY=VALUE``
storage options, the storage a command opens."""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable
from typing import Any

__all__ = ["human", "json_doc", "one_line", "open_url", "printable", "storage_options"]


def printable(text: Any) -> str:
    """``text`` with every character a terminal would act on escaped as Python writes it
    (``\\x1b``, ``\\r``, ``\\n``, ``\\u202e``): names, times, values and messages that come
    from a checkpoint must not clear the screen, move the cursor or reorder a row (a bidi
    override). Everything the text commands print from a checkpoint goes through it; --json
    output is escaped by JSON."""
    s = str(text)
    if s.isprintable():  # (the common case: no copy)
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)


def json_doc(doc: Any) -> str:
    """``doc`` as one JSON document (RFC 8259): a non-finite float (an ``extra`` value such as
    a best loss of inf, a NaN in a tensor) is written as the string ``"inf"``, ``"-inf"`` or
    ``"nan"``, not as JavaScript's ``Infinity``/``NaN``, which strict parsers reject."""
    return json.dumps(_finite(doc), indent=1, allow_nan=False)


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def storage_options(pairs: list[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; VALUE is parsed as JSON when it can be (numbers, true, {...})."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option must be KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def open_url(args: argparse.Namespace) -> Any:
    from muon_ckpt.store import open_storage

    return open_storage(args.url, storage_options(args.storage_option))


def human(n: int | None) -> str:
    from muon_ckpt._progress import human_bytes

    return "-" if n is None else human_bytes(n)


def _include(m: re.Match[str]) -> str:
    return "--include " + " ".join(re.findall(r"'([^']*)'", m.group(1)))


# The library's messages advise in its Python API; on the command line the same advice is a
# flag. Each row rewrites one spelling of that API, never a whole message, so the library's
# wording stays its own (tests/cli/test_cli_messages.py meets each row through a real error).
_AS_FLAGS: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    (re.compile(r"\bCall load\(\) for"), "Leave --step out for"),
    (re.compile(r"\bload\(step=\.\.\.\)"), "give --step"),
    (re.compile(r"--step/step="), "--step"),
    (re.compile(r"\bstorage_options\b"), "--storage-option"),
    (re.compile(r"\binclude=\(([^)]*)\)"), _include),
    (re.compile(r"\btied=\{'([^']*)': '([^']*)'\}"), r"--tied \1=\2"),
    (re.compile(r"\btied="), "--tied"),
    (re.compile(r"\brename="), "--rename-map"),
)


def _as_flags(text: str) -> str:
    """``text``, a library's message, with its advice in the command's flags
    (``load(step=...)`` -> ``--step``, ``storage_options`` -> ``--storage-option``, ...)."""
    for pattern, flag in _AS_FLAGS:
        text = pattern.sub(flag, text)
    return text


def one_line(e: BaseException) -> str:
    """``e`` as the command's one error line: its type, and its message on one line, escaped
    and in the command's words (``_as_flags``)."""
    msg = printable(_as_flags(" ".join(str(e).split()))) or repr(e)
    return f"{type(e).__name__}: {msg}"
