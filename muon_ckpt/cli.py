"""The ``muon-ckpt`` command: ls, inspect, verify, export, prune, demo.

Imports are lazy (torch is only imported by the commands that need it) so ``--help`` is fast.
Errors print one line ``muon-ckpt: error: ...`` and exit 1; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["main"]


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
        print(json.dumps(doc, indent=1))
        return 0
    for name in ignored:
        print(f"ignored: {name} (not a step directory name: step- and exactly 8 digits)")
    if not steps:
        print(f"no step directories at {args.url}")
        return 0
    print(f"{'STEP':>10}  {'STATUS':<11}  {'SIZE':>10}  {'FILES':>5}  {'WORLD':>5}  TIME")
    for s in steps:
        status = "committed" if s.committed else s.status.upper()
        world = "-" if s.world_size is None else str(s.world_size)
        print(
            f"{s.step:>10}  {status:<11}  {_human(s.size):>10}  {s.files:>5}  {world:>5}  "
            f"{s.time or '-'}"
        )
    done = [s.step for s in steps if s.committed]
    corrupt = [s for s in steps if s.status == "corrupt"]
    tail = f"; newest committed: {done[-1]}" if done else ""
    bad = f"{len(corrupt)} CORRUPT, " if corrupt else ""
    print(f"{len(done)} committed, {bad}{len(steps) - len(done) - len(corrupt)} uncommitted{tail}")
    for s in corrupt:
        print(f"step {s.step}: CORRUPT: {s.problem}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    import fnmatch

    from muon_ckpt.store import resolve

    r = resolve(_open(args), args.step)
    md = r.metadata()  # every file present at its size, the metadata's checksum checked
    rows = []
    for key, m in sorted(md.state_dict_metadata.items()):
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
    total = sum(r_["bytes"] or 0 for r_ in rows)
    head = {"url": r.url, "kind": r.kind, "step": r.step}
    if r.manifest is not None:
        head.update(
            world_size=r.manifest.world_size,
            time=r.manifest.time,
            files_bytes=r.manifest.total_bytes,
        )
    if args.json:
        print(json.dumps({**head, "tensor_bytes": total, "keys": rows}, indent=1))
        return 0
    desc = f"step {r.step} of {r.url}" if r.step is not None else r.url
    extra = ""
    if r.manifest is not None:
        extra = f", saved {r.manifest.time} by {r.manifest.world_size} rank(s)"
    print(f"{desc} ({r.kind}{extra})")
    width = max([len(x["key"]) for x in rows] + [3])
    print(f"{'KEY':<{width}}  {'SHAPE':<16}  {'DTYPE':<10}  {'BYTES':>10}")
    for x in rows:
        shape = "-" if x["shape"] is None else "(" + ", ".join(map(str, x["shape"])) + ")"
        print(f"{x['key']:<{width}}  {shape:<16}  {x['dtype']:<10}  {_human(x['bytes']):>10}")
    print(f"{len(rows)} keys, {_human(total)} of tensors")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from muon_ckpt._errors import CheckpointCorruptError
    from muon_ckpt.store import MANIFEST, METADATA, Catalog, resolve, verify

    st = _open(args)
    bad = 0
    if args.step is None and not st.exists(MANIFEST) and not st.exists(METADATA):
        todo = []
        for s in Catalog(st).scan():  # a run root: every committed step
            if s.committed:
                todo.append(s.step)
            elif s.status == "corrupt":
                print(f"step {s.step}: FAILED: {s.problem}")
                bad += 1
            else:
                print(f"step {s.step}: skipped (not committed)")
        if not todo and not bad:
            resolve(st)  # raises the not-found error, with the steps that exist
    else:
        todo = [args.step]
    for step in todo:
        try:
            r = resolve(st, step)
            res = verify(r, progress=None)
        except CheckpointCorruptError as e:
            print(f"step {step}: FAILED: {e}")
            bad += 1
            continue
        for p in res.problems:
            print(f"step {r.step}: {p}")
        for u in res.unexpected:
            print(f"step {r.step}: note: {u} is not in the manifest")
        verdict = "OK" if res.ok else f"FAILED ({len(res.problems)} problem(s))"
        print(f"step {r.step}: {verdict}: {res.checked} files, {_human(res.bytes)} checked")
        bad += not res.ok
    return 1 if bad else 0


def cmd_export(args: argparse.Namespace) -> int:
    from muon_ckpt.interop import export_safetensors

    s = export_safetensors(
        args.url,
        args.out,
        step=args.step,
        include=tuple(args.include),
        dtype=args.dtype,
        storage_options=_storage_options(args.storage_option),
        progress=None,
        verify=args.verify,
    )
    where = f"step {s.step}" if s.step is not None else args.url
    print(f"exported {where}: {s.tensors} tensors, {_human(s.bytes)} -> {s.out}")
    if s.skipped:
        print(f"not exported (non-tensor values): {len(s.skipped)} keys, e.g. {s.skipped[0]}")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from muon_ckpt.store import prune

    res = prune(_open(args), args.keep, dry_run=args.dry_run)
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
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("export", parents=[remote], help="export full tensors to safetensors")
    s.add_argument("out", help="output .safetensors file (path or URL)")
    s.add_argument("--step", type=int, help="step to export (default: newest committed)")
    s.add_argument(
        "--include",
        nargs="+",
        default=["model", "optim"],
        choices=["model", "optim", "extra"],
        help="sections to export (default: model optim)",
    )
    s.add_argument("--dtype", help="cast floating tensors, e.g. bf16, float16, float32")
    s.add_argument(
        "--verify",
        choices=["crc32", "size"],
        default="crc32",
        help="check sizes and checksums of the files read (default), or sizes only",
    )
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("prune", parents=[remote], help="delete old committed steps")
    s.add_argument("--keep", type=int, required=True, help="committed steps to keep (>= 1)")
    s.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    s.set_defaults(func=cmd_prune)

    s = sub.add_parser(
        "demo", parents=[common], help="train, SIGKILL, resume, and check bitwise equality"
    )
    add_demo_arguments(s)
    s.set_defaults(func=cmd_demo)
    return p


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or repr(e)
    return f"{type(e).__name__}: {msg}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
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
