"""Stored values as ``muon-ckpt inspect`` shows them: small ones in full, large tensors summarised
(min, max, mean), long objects cut. Read through the verifying reader, like every stored byte."""

from __future__ import annotations

import json
from typing import Any

import torch

from muon_ckpt.load import CheckpointReader
from muon_ckpt.store.dcp import tensor_entries

__all__ = ["layout_lines", "read_values", "value_text"]

SMALL_TENSOR = 16  # elements shown in full
SMALL_JSON = 1024  # characters of an object shown in full in --json output
TEXT_WIDTH = 60  # characters of a value in the table


def _describe(v: Any) -> dict[str, Any]:
    if isinstance(v, torch.Tensor):
        if v.numel() <= SMALL_TENSOR:
            return {"value": v.tolist()}
        x = v.double() if not v.dtype.is_complex else v.abs().double()
        return {
            "summary": {
                "min": float(x.min()),
                "max": float(x.max()),
                "mean": float(x.mean()),
            }
        }
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = None
    if text is not None and len(text) <= SMALL_JSON:
        return {"value": v}
    r = repr(v)
    if len(r) <= SMALL_JSON:
        return {"value": r}
    return {"value": r[:SMALL_JSON] + "...", "truncated": len(r)}


def read_values(reader: CheckpointReader, keys: list[str]) -> dict[str, dict[str, Any]]:
    """``key -> {"value": ...}`` or ``{"summary": {min, max, mean}}`` (large tensors) for
    ``keys`` (non-tensor values and tensors alike)."""
    entries = tensor_entries(reader.metadata)
    sd: dict[str, Any] = {}
    for k in keys:
        tm = entries.get(k)
        sd[k] = None if tm is None else torch.empty(tuple(tm.size), dtype=tm.properties.dtype)
    if sd:
        reader.load(sd)
    return {k: _describe(sd[k]) for k in keys}


def value_text(d: dict[str, Any]) -> str:
    """One table cell for ``read_values``' description."""
    if "summary" in d:
        s = d["summary"]
        return f"min {s['min']:.6g}, max {s['max']:.6g}, mean {s['mean']:.6g}"
    text = json.dumps(d["value"])
    return text if len(text) <= TEXT_WIDTH else text[: TEXT_WIDTH - 3] + "..."


def layout_lines(layout: dict[str, Any] | None) -> list[str]:
    """inspect's lines for a manifest's layout (``store.layout_of``): one per mesh and
    placements, naming the params laid out so."""
    if layout is None:
        return []
    meshes = layout["meshes"]
    groups: dict[tuple[Any, tuple[str, ...]], list[str]] = {}
    for fqn, e in layout["params"].items():
        pls = e.get("placements")
        key = (e.get("mesh"), tuple(map(str, pls)) if isinstance(pls, list) else ())
        groups.setdefault(key, []).append(str(fqn))
    out = []
    for (mi, pls), fqns in groups.items():
        m = meshes[mi] if isinstance(mi, int) and 0 <= mi < len(meshes) else None
        m = m if isinstance(m, dict) else {}
        shape = "x".join(map(str, m.get("shape") or [])) or "?"
        dims = ", ".join(map(str, m.get("dims") or []))
        shown = ", ".join(fqns[:3]) + (f", ... ({len(fqns)} in all)" if len(fqns) > 3 else "")
        out.append(f"layout: mesh {shape} ({dims}), placements ({', '.join(pls)}): {shown}")
    return out
