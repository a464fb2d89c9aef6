"""The export command: one safetensors file of keys as stored, or the Hugging Face layout."""

from __future__ import annotations

import argparse
import json
from typing import Any

from muon_ckpt.cli._text import human, json_doc, printable, storage_options

__all__ = ["cmd_export"]


def _pairs(pairs: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        a, sep, b = pair.partition("=")
        if not sep or not a or not b:
            raise ValueError(f"{flag} must be DROPPED=KEPT (two tensor names), got {pair!r}")
        out[a] = b
    return out


def _rename_map(path: str | None) -> dict[str, str] | None:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        try:
            m = json.load(f)
        except ValueError as e:
            raise ValueError(f"--rename-map {path}: not JSON ({e})") from e
    if not isinstance(m, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in m.items()
    ):
        raise ValueError(
            f"--rename-map {path} must hold a JSON object of regex -> replacement, e.g. "
            '{"layers\\.(\\d+)\\.(.*)": "model.layers.\\1.\\2"}; '
            f"found a {type(m).__name__}"
        )
    return m


def _torchtitan(args: argparse.Namespace) -> int:
    from muon_ckpt.interop import export_torchtitan

    include = args.include or ["model", "optim", "extra"]
    if sorted(include) not in (["model"], ["extra", "model", "optim"]):
        raise ValueError(
            f"--torchtitan exports every section, or with --include model the weights only; "
            f"got --include {' '.join(include)}"
        )
    used = [
        f
        for f, v in (
            ("--dtype", args.dtype),
            ("--max-shard-size", args.max_shard_size),
            ("--rename-map", args.rename_map),
            ("--tied", args.tied),
        )
        if v is not None
    ]
    if used:
        raise ValueError(f"{', '.join(used)} do not apply to --torchtitan exports")
    s = export_torchtitan(
        args.url,
        args.torchtitan,
        step=args.step,
        model_only=include == ["model"],
        storage_options=storage_options(args.storage_option),
        verify=args.verify,
    )
    doc = {"out": s.step_dir, "step": s.step, "tensors": s.tensors, "objects": s.objects}
    doc.update(sections=s.sections, defaults=s.defaults)
    if args.json:
        print(json_doc(doc))
        return 0
    print(
        printable(
            f"exported step {s.step}: {s.tensors} tensors, {s.objects} values -> {s.step_dir}"
        )
    )
    print(printable(f"  torchtitan sections: {', '.join(s.sections)}"))
    for key, value in s.defaults.items():
        print(printable(f"  not in the step, written as {value!r}: {key}"))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from muon_ckpt.interop import export_hf, export_safetensors

    outs = [o for o in (args.out, args.hf, args.torchtitan) if o is not None]
    if len(outs) != 1:
        raise ValueError(
            "export needs one output: OUT (one safetensors file, keys as stored), --hf DIR "
            "(the Hugging Face layout) or --torchtitan DIR (a torchtitan step); got "
            f"{ {0: 'neither', 2: 'both', 3: 'all three'}[len(outs)] }"
        )
    if args.torchtitan is not None:
        return _torchtitan(args)
    args.include = args.include or ["model"]
    hf_only = {"--max-shard-size": args.max_shard_size, "--rename-map": args.rename_map}
    hf_only["--tied"] = args.tied
    used = [flag for flag, v in hf_only.items() if v is not None]
    if args.hf is None and used:
        raise ValueError(f"{', '.join(used)} apply to --hf exports only")
    common: dict[str, Any] = {
        "step": args.step,
        "include": tuple(args.include),
        "dtype": args.dtype,
        "storage_options": storage_options(args.storage_option),
        "progress": False if args.json else None,
        "verify": args.verify,
    }
    doc: dict[str, Any]
    if args.hf is not None:
        h = export_hf(
            args.url,
            args.hf,
            max_shard_size=args.max_shard_size or "5GB",
            rename=_rename_map(args.rename_map),
            tied=_pairs(args.tied, "--tied"),
            **common,
        )
        doc = {"out": h.out_dir, "step": h.step, "tensors": h.tensors, "bytes": h.bytes}
        doc.update(files=h.files, tied=h.tied, skipped=h.skipped)
    else:
        s = export_safetensors(args.url, args.out, **common)
        doc = {"out": s.out, "step": s.step, "tensors": s.tensors, "bytes": s.bytes}
        doc["skipped"] = s.skipped
    if args.json:
        print(json_doc(doc))
        return 0
    where = f"step {doc['step']}" if doc["step"] is not None else args.url
    out = f"{doc['tensors']} tensors, {human(doc['bytes'])} -> {doc['out']}"
    print(printable(f"exported {where}: {out}"))
    for section, files in doc.get("files", {}).items():
        shards = f"{len(files) - 1} shards + {files[-1]}" if len(files) > 1 else files[0]
        print(printable(f"  {section}: {shards}"))
    if doc["skipped"]:
        print(
            f"not exported (non-tensor values): {len(doc['skipped'])} keys, "
            f"e.g. {printable(doc['skipped'][0])}"
        )
    return 0
