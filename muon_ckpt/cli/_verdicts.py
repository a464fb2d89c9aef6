"""What ``verify`` says of one step or memory-tier part: checked as a load would find it."""

from __future__ import annotations

from typing import Any

from muon_ckpt.cli._text import human

__all__ = ["verdict_lines", "verified"]


def verified(r: Any, *, json: bool, tiles: bool = True) -> dict[str, Any]:
    """``r`` (a ``store.Resolved``) checked as a load would find it (``load.verify_step``):
    status, files, bytes, problems, files not in its manifest."""
    from muon_ckpt.load import verify_step

    res = verify_step(r, progress=None if not json else False, tiles=tiles)
    return {
        "status": "deleted" if res.deleted else "ok" if res.ok else "failed",
        "files": res.checked,
        "bytes": res.bytes,
        "problems": res.problems,
        "unexpected": res.unexpected,
    }


def verdict_lines(what: str, x: dict[str, Any]) -> list[str]:
    """The text lines of one verified step or part ``what`` (``verified``'s result)."""
    if x["status"] == "skipped":
        return [f"{what}: skipped (not committed)"]
    if x["status"] == "deleted":
        return [f"{what}: deleted while being verified (retention, prune or an overwrite)"]
    if x["status"] == "newer":
        return [f"{what}: NOT VERIFIED (a newer muon-ckpt's; upgrade): {x['problems'][0]}"]
    if "files" not in x:  # the step could not be opened
        return [f"{what}: FAILED: {x['problems'][0]}"]
    lines = [f"{what}: {p}" for p in x["problems"]]
    lines += [f"{what}: note: {u} is not in the manifest" for u in x["unexpected"]]
    verdict = "OK" if x["status"] == "ok" else f"FAILED ({len(x['problems'])} problem(s))"
    if x.get("passed_over") is not None:  # is it damaged, or did the load meet a read fault?
        lines.insert(0, f"{what}: passed over by a load that could not read it: {x['passed_over']}")
        intact = "intact on the storage (the load met a read fault)"
        verdict += f", {intact}" if x["status"] == "ok" else ", damaged on the storage"
    return [*lines, f"{what}: {verdict}: {x['files']} files, {human(x['bytes'])} checked"]
