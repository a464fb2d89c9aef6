"""The ``muon-ckpt`` command: ls, inspect, verify, export, prune, demo.

Imports are lazy (torch is only imported by the commands that need it) so ``--help`` is fast.
Errors print one line ``muon-ckpt: error: ...`` and exit 1; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from muon_ckpt._version import __version__

__all__ = ["main"]


def _printable(text: Any) -> str:
    """``text`` with every character a terminal would act on escaped as Python writes it
    (``\\x1b``, ``\\r``, ``\\n``, ``\\u202e``): names, times, values and messages that come
    from a checkpoint must not clear the screen, move the cursor or reorder a row (a bidi
    override). Everything the text commands print from a checkpoint goes through it; --json
    output is escaped by JSON."""
    s = str(text)
    if s.isprintable():  # (the common case: no copy)
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)


def _json(doc: Any) -> str:
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


def _storage_options(pairs: list[str] | None) -> dict[str, Any]:
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


def _open(args: argparse.Namespace) -> Any:
    from muon_ckpt.store import open_storage

    return open_storage(args.url, _storage_options(args.storage_option))


def _human(n: int | None) -> str:
    from muon_ckpt._progress import human_bytes

    return "-" if n is None else human_bytes(n)


# ---------------------------------------------------------------------------- commands
def cmd_ls(args: argparse.Namespace) -> int:
    from muon_ckpt._errors import CheckpointNotFoundError
    from muon_ckpt.store import Catalog

    st = _open(args)
    st.check_root()
    if not st.exists():
        raise CheckpointNotFoundError(f"{args.url!r} does not exist")
    cat = Catalog(st)
    steps, ignored = cat.scan(detail=True), cat.ignored()
    if args.json:
        doc = {"url": args.url, "steps": [s.as_dict() for s in steps], "ignored": ignored}
        print(_json(doc))
        return 0
    for name in ignored:
        print(
            f"ignored: {_printable(name)} (not a step directory name: step- and exactly 8 digits)"
        )
    if not steps:
        print(f"no step directories at {_printable(args.url)}")
        return 0
    print(f"{'STEP':>10}  {'STATUS':<11}  {'SIZE':>10}  {'FILES':>5}  {'WORLD':>5}  TIME")
    for s in steps:
        status = "committed" if s.committed else s.status.upper()
        world = "-" if s.world_size is None else str(s.world_size)
        print(
            f"{s.step:>10}  {status:<11}  {_human(s.size):>10}  {s.files:>5}  {world:>5}  "
            f"{_printable(s.time or '-')}"
        )
    done = [s.step for s in steps if s.committed]
    corrupt = [s for s in steps if s.status == "corrupt"]
    tail = f"; newest committed: {done[-1]}" if done else ""
    bad = f"{len(corrupt)} CORRUPT, " if corrupt else ""
    print(f"{len(done)} committed, {bad}{len(steps) - len(done) - len(corrupt)} uncommitted{tail}")
    for s in corrupt:
        print(f"step {s.step}: CORRUPT: {_printable(s.problem)}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    import fnmatch

    from muon_ckpt.cli._values import read_values, value_text
    from muon_ckpt.interop._export import section_of
    from muon_ckpt.load import CheckpointReader
    from muon_ckpt.store import resolve

    r = resolve(_open(args), args.step)
    # Sizes and the metadata's checksum are checked; values are read through the verifying
    # reader (verify="size": inspect reads a few items, not every byte of every file).
    reader = CheckpointReader(r, verify="size")
    rows = []
    for key, m in sorted(reader.metadata.state_dict_metadata.items()):
        if args.keys and not fnmatch.fnmatchcase(key, args.keys):
            continue
        size = getattr(m, "size", None)
        if size is None:
            rows.append({"key": key, "shape": None, "dtype": "object", "bytes": None})
            continue
        dtype = m.properties.dtype
        nbytes = int(size.numel()) * dtype.itemsize
        rows.append(
            {
                "key": key,
                "shape": list(size),
                "dtype": str(dtype).removeprefix("torch."),
                "bytes": nbytes,
            }
        )
    # Values: every non-tensor value (hyperparameters, extra state) and the tensors of extra
    # (rank_extra's too).
    shown = [x["key"] for x in rows if x["shape"] is None or section_of(x["key"]) == "extra"]
    values = read_values(reader, shown)
    for x in rows:
        x.update(values.get(x["key"], {}))
    total = sum(r_["bytes"] or 0 for r_ in rows)
    head = {"url": r.url, "kind": r.kind, "step": r.step}
    if r.manifest is not None:
        head.update(
            world_size=r.manifest.world_size,
            time=r.manifest.time,
            files_bytes=r.manifest.total_bytes,
        )
    if args.json:
        print(_json({**head, "tensor_bytes": total, "keys": rows}))
        return 0
    desc = f"step {r.step} of {r.url}" if r.step is not None else r.url
    extra = ""
    if r.manifest is not None:
        extra = f", saved {r.manifest.time} by {r.manifest.world_size} rank(s)"
    print(_printable(f"{desc} ({r.kind}{extra})"))
    keys = [_printable(x["key"]) for x in rows]
    width = max([len(k) for k in keys] + [3])
    print(f"{'KEY':<{width}}  {'SHAPE':<16}  {'DTYPE':<10}  {'BYTES':>10}  VALUE")
    for key, x in zip(keys, rows, strict=True):
        shape = "-" if x["shape"] is None else "(" + ", ".join(map(str, x["shape"])) + ")"
        value = _printable(value_text(x)) if ("value" in x or "summary" in x) else ""
        line = f"{key:<{width}}  {shape:<16}  {x['dtype']:<10}  {_human(x['bytes']):>10}"
        print(f"{line}  {value}".rstrip())
    print(f"{len(rows)} keys, {_human(total)} of tensors")
    return 0


def _verify_steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One result per step: step, status (ok, failed, skipped, deleted), files, bytes,
    problems and files not in the manifest. A step deleted while it is verified (retention,
    prune, an overwrite) is ``deleted``: gone, not damaged."""
    from muon_ckpt._errors import CheckpointCorruptError, CheckpointNotFoundError
    from muon_ckpt.store import MANIFEST, METADATA, Catalog, resolve, verify

    st = _open(args)
    out: list[dict[str, Any]] = []
    listed = args.step is None and not st.exists(MANIFEST) and not st.exists(METADATA)
    if listed:
        todo = []
        for s in Catalog(st).scan():  # a run root: every committed step
            if s.committed:
                todo.append(s.step)
            elif s.status == "corrupt":
                out.append({"step": s.step, "status": "failed", "problems": [s.problem]})
            else:
                out.append({"step": s.step, "status": "skipped", "problems": []})
        if not todo and not out:
            resolve(st)  # raises the not-found error, with the steps that exist
    else:
        todo = [args.step]
    for step in todo:
        try:
            r = resolve(st, step)
            res = verify(r, progress=None if not args.json else False)
        except CheckpointCorruptError as e:
            out.append({"step": step, "status": "failed", "problems": [str(e)]})
            continue
        except CheckpointNotFoundError:
            if not listed:
                raise  # the step or directory asked for is not there
            # Listed as committed a moment ago: deleted since (its manifest goes first).
            out.append({"step": step, "status": "deleted", "problems": []})
            continue
        status = "deleted" if res.deleted else "ok" if res.ok else "failed"
        out.append(
            {
                "step": r.step,
                "status": status,
                "files": res.checked,
                "bytes": res.bytes,
                "problems": res.problems,
                "unexpected": res.unexpected,
            }
        )
    return sorted(out, key=lambda x: x["step"] if x["step"] is not None else -1)


def cmd_verify(args: argparse.Namespace) -> int:
    results = _verify_steps(args)
    failed = [x for x in results if x["status"] == "failed"]
    if args.json:
        doc = {"url": args.url, "ok": not failed, "steps": results}
        print(_json(doc))
        return 1 if failed else 0
    for x in results:
        step = x["step"]
        if x["status"] == "skipped":
            print(f"step {step}: skipped (not committed)")
            continue
        if x["status"] == "deleted":
            print(f"step {step}: deleted while being verified (retention, prune or an overwrite)")
            continue
        if "files" not in x:  # the step could not be opened
            print(f"step {step}: FAILED: {x['problems'][0]}")
            continue
        for p in x["problems"]:
            print(f"step {step}: {p}")
        for u in x["unexpected"]:
            print(f"step {step}: note: {u} is not in the manifest")
        verdict = "OK" if x["status"] == "ok" else f"FAILED ({len(x['problems'])} problem(s))"
        print(f"step {step}: {verdict}: {x['files']} files, {_human(x['bytes'])} checked")
    return 1 if failed else 0


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


def cmd_export(args: argparse.Namespace) -> int:
    from muon_ckpt.interop import export_hf, export_safetensors

    if (args.out is None) == (args.hf is None):
        raise ValueError(
            "export needs one output: OUT (one safetensors file, keys as stored) or --hf DIR "
            f"(the Hugging Face layout); got {'both' if args.out else 'neither'}"
        )
    hf_only = {"--max-shard-size": args.max_shard_size, "--rename-map": args.rename_map}
    hf_only["--tied"] = args.tied
    used = [flag for flag, v in hf_only.items() if v is not None]
    if args.hf is None and used:
        raise ValueError(f"{', '.join(used)} apply to --hf exports only")
    common: dict[str, Any] = {
        "step": args.step,
        "include": tuple(args.include),
        "dtype": args.dtype,
        "storage_options": _storage_options(args.storage_option),
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
        print(_json(doc))
        return 0
    where = f"step {doc['step']}" if doc["step"] is not None else args.url
    out = f"{doc['tensors']} tensors, {_human(doc['bytes'])} -> {doc['out']}"
    print(_printable(f"exported {where}: {out}"))
    for section, files in doc.get("files", {}).items():
        shards = f"{len(files) - 1} shards + {files[-1]}" if len(files) > 1 else files[0]
        print(_printable(f"  {section}: {shards}"))
    if doc["skipped"]:
        print(
            f"not exported (non-tensor values): {len(doc['skipped'])} keys, "
            f"e.g. {_printable(doc['skipped'][0])}"
        )
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from muon_ckpt.store import prune

    res = prune(_open(args), args.keep, dry_run=args.dry_run)
    if args.json:
        print(_json({"url": args.url, "dry_run": args.dry_run, **vars(res)}))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(res.deleted)} step(s): {', '.join(map(str, res.deleted)) or '-'}")
    print(f"kept {len(res.kept)} committed step(s): {', '.join(map(str, res.kept)) or '-'}")
    if res.leftovers:
        print(
            f"uncommitted leftovers (not touched; a save may still be running): "
            f"{', '.join(map(str, res.leftovers))}"
        )
    if res.corrupt:
        print(f"CORRUPT steps (invalid manifest; not touched): {', '.join(map(str, res.corrupt))}")
    if res.newer:
        print(
            "steps of a newer muon-ckpt (not touched; upgrade to manage them): "
            f"{', '.join(map(str, res.newer))}"
        )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from muon_ckpt.demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(
            url=args.url,
            steps=args.steps,
            nproc=args.nproc,
            offload=args.offload,
            interval=args.interval,
            seed=args.seed,
            storage_options=_storage_options(args.storage_option),
        )
    )


# ---------------------------------------------------------------------------- parser
def add_demo_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--url", default="./checkpoints", help="checkpoint directory or URL")
    s.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    s.add_argument("--nproc", type=int, default=2, help="local processes (default 2)")
    s.add_argument("--offload", action="store_true", help="CPU offload of optimizer states")
    s.add_argument("--interval", type=int, default=5, help="save every K steps (default 5)")
    s.add_argument("--seed", type=int, default=0, help="seed of data, model and the kill step")
    s.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec storage option for a remote --url (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's default must not override `muon-ckpt --debug COMMAND`.
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors"
    )
    remote = argparse.ArgumentParser(add_help=False, parents=[common])
    remote.add_argument("url", help="run root, step directory or DCP directory (path or URL)")
    remote.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec storage option for remote URLs (repeatable; VALUE may be JSON)",
    )
    p = argparse.ArgumentParser(
        prog="muon-ckpt", description="Inspect, verify, export and prune muon-ckpt checkpoints."
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.add_argument("--version", action="version", version=f"muon-ckpt {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("ls", parents=[remote], help="list steps, committed or not")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("inspect", parents=[remote], help="keys, shapes, dtypes and bytes")
    s.add_argument("--step", type=int, help="step to inspect (default: newest committed)")
    s.add_argument("--keys", metavar="GLOB", help="only keys matching this glob")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("verify", parents=[remote], help="check files against the manifest")
    s.add_argument("--step", type=int, help="step to verify (default: every committed step)")
    s.add_argument("--json", action="store_true", help="machine-readable output (exit 1 still)")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser(
        "export", parents=[remote], help="export to safetensors, or to the Hugging Face layout"
    )
    s.add_argument("out", nargs="?", help="output .safetensors file, keys as stored (or --hf)")
    s.add_argument(
        "--hf",
        metavar="DIR",
        help="write DIR in the Hugging Face layout: model*.safetensors (+ index), plain FQNs",
    )
    s.add_argument("--step", type=int, help="step to export (default: newest committed)")
    s.add_argument(
        "--include",
        nargs="+",
        default=["model"],
        choices=["model", "optim", "extra"],
        help="sections to export (default: model; with --hf: model and/or optim)",
    )
    s.add_argument("--dtype", help="cast floating tensors, e.g. bf16, float16, float32")
    s.add_argument("--max-shard-size", help="--hf: bytes per shard: 5GB (default), 500MB, 100KB")
    s.add_argument(
        "--rename-map", metavar="FILE", help="--hf: JSON object of regex -> replacement names"
    )
    s.add_argument(
        "--tied",
        action="append",
        metavar="DROPPED=KEPT",
        help="--hf: a tied weight, written once as KEPT (repeatable)",
    )
    s.add_argument(
        "--verify",
        choices=["checksum", "crc32", "size"],
        default="checksum",
        help="check sizes and checksums of the files read (default), or sizes only",
    )
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("prune", parents=[remote], help="delete old committed steps")
    s.add_argument("--keep", type=int, required=True, help="committed steps to keep (>= 1)")
    s.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_prune)

    s = sub.add_parser(
        "demo", parents=[common], help="train, SIGKILL, resume, and check bitwise equality"
    )
    add_demo_arguments(s)
    s.set_defaults(func=cmd_demo)
    return p


def _one_line(e: BaseException) -> str:
    msg = _printable(" ".join(str(e).split())) or repr(e)
    return f"{type(e).__name__}: {msg}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        # The reader went away (`muon-ckpt ls | head`): stop quietly, as cat or ls do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    except KeyboardInterrupt:
        print("muon-ckpt: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(f"muon-ckpt: error: {_one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
