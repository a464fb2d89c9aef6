"""The commands that read and tidy a run's steps: ls, inspect, verify, prune."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from muon_ckpt.cli._memory import cmd_ls_memory, cmd_prune_memory, cmd_verify_memory
from muon_ckpt.cli._text import human, json_doc, open_url, printable
from muon_ckpt.cli._verdicts import verdict_lines, verified

__all__ = ["cmd_inspect", "cmd_ls", "cmd_prune", "cmd_verify"]


def _url_or_memory(args: argparse.Namespace, command: str) -> bool:
    """Whether ``args`` ask for the memory tier (``--memory``); a url is needed otherwise."""
    if args.memory is not None:
        return True
    if not args.url:
        raise ValueError(f"muon-ckpt {command} needs a url (or --memory [DIR])")
    return False


def _open_run(args: argparse.Namespace, command: str) -> Any:
    """The storage of the run ``args.url`` names, for ``command`` (ls, prune): an error where
    the url does not exist, and where it is a step's directory, naming the run's url."""
    from muon_ckpt._errors import CheckpointNotFoundError
    from muon_ckpt.store import check_run_root

    st = open_url(args)
    st.check_root()
    if not st.exists():
        raise CheckpointNotFoundError(f"no run at {args.url!r}: it does not exist")
    check_run_root(
        st,
        args.url,
        lambda run, _: (
            f"give the run's url: muon-ckpt {command} {shlex.quote(run)} (inspect "
            "and verify take a step's directory)"
        ),
    )
    return st


def cmd_ls(args: argparse.Namespace) -> int:
    from muon_ckpt.store import Catalog

    if _url_or_memory(args, "ls"):
        return cmd_ls_memory(args)

    cat = Catalog(_open_run(args, "ls"))
    steps, ignored = cat.scan(detail=True), cat.ignored()
    lines = sorted(cat.records.gens.items(), key=lambda lg: lg[1])
    if args.json:
        doc = {"url": args.url, "steps": [s.as_dict() for s in steps], "ignored": ignored}
        doc["lines"] = [{"line": line, "gen": gen} for line, gen in lines]
        print(json_doc(doc))
        return 0
    for name in ignored:
        print(f"ignored: {printable(name)} (not a step directory name: step- and exactly 8 digits)")
    for line, gen in lines:  # (the memory tier's: store._records)
        print(
            f"line {printable(line)} (gen {gen}) is recorded: its memory-tier steps are "
            "restorable on the nodes that hold them"
        )
    if not steps:
        print(f"no step directories at {printable(args.url)}")
        return 0
    print(f"{'STEP':>10}  {'STATUS':<11}  {'SIZE':>10}  {'FILES':>5}  {'WORLD':>5}  TIME")
    for s in steps:
        status = "committed" if s.committed else s.status.upper()
        status = "PASSED-OVER" if s.passed_over is not None else status
        world = "-" if s.world_size is None else str(s.world_size)
        print(
            f"{s.step:>10}  {status:<11}  {human(s.size):>10}  {s.files:>5}  {world:>5}  "
            f"{printable(s.time or '-')}"
        )
    done = [s.step for s in steps if s.committed]
    corrupt = [s for s in steps if s.status == "corrupt" and s.passed_over is None]
    passed = [s for s in steps if s.passed_over is not None]
    tail = f"; newest committed: {done[-1]}" if done else ""
    bad = f"{len(corrupt)} CORRUPT, " if corrupt else ""
    bad += f"{len(passed)} passed over, " if passed else ""
    rest = len(steps) - len(done) - len(corrupt) - len(passed)
    print(f"{len(done)} committed, {bad}{rest} uncommitted{tail}")
    for s in corrupt:
        print(f"step {s.step}: CORRUPT: {printable(s.problem)}")
    for s in passed:
        print(f"step {s.step}: passed over: {printable(s.problem)}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    import fnmatch

    from muon_ckpt.cli._values import layout_lines, read_values, value_text
    from muon_ckpt.interop import section_of
    from muon_ckpt.load import CheckpointReader
    from muon_ckpt.store import layout_of, resolve

    r = resolve(open_url(args), args.step)
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
    layout = None
    if r.manifest is not None:
        layout = layout_of(r.manifest)
        head.update(
            world_size=r.manifest.world_size,
            time=r.manifest.time,
            files_bytes=r.manifest.total_bytes,
            layout=layout,
        )
    if args.json:
        print(json_doc({**head, "tensor_bytes": total, "keys": rows}))
        return 0
    desc = f"step {r.step} of {r.url}" if r.step is not None else r.url
    extra = ""
    if r.manifest is not None:
        extra = f", saved {r.manifest.time} by {r.manifest.world_size} rank(s)"
    print(printable(f"{desc} ({r.kind}{extra})"))
    for line in layout_lines(layout):
        print(printable(line))
    keys = [printable(x["key"]) for x in rows]
    width = max([len(k) for k in keys] + [3])
    print(f"{'KEY':<{width}}  {'SHAPE':<16}  {'DTYPE':<10}  {'BYTES':>10}  VALUE")
    for key, x in zip(keys, rows, strict=True):
        shape = "-" if x["shape"] is None else "(" + ", ".join(map(str, x["shape"])) + ")"
        value = printable(value_text(x)) if ("value" in x or "summary" in x) else ""
        line = f"{key:<{width}}  {shape:<16}  {x['dtype']:<10}  {human(x['bytes']):>10}"
        print(f"{line}  {value}".rstrip())
    print(f"{len(rows)} keys, {human(total)} of tensors")
    return 0


def _verify_steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One result per step: step, status (ok, failed, newer, skipped, deleted), files, bytes,
    problems and files not in the manifest. A step deleted while it is verified (retention,
    prune, an overwrite) is ``deleted``: gone, not damaged. A step of a newer format is
    ``newer``, a failure: this version cannot check it, and a load refuses the run. A step a
    load passed over is checked too (``passed_over``: why): is it damaged on the storage?"""
    from muon_ckpt._errors import (
        CheckpointCorruptError,
        CheckpointNotFoundError,
        CheckpointVersionError,
    )
    from muon_ckpt.store import MANIFEST, METADATA, Catalog, Status, resolve

    st = open_url(args)
    out: list[dict[str, Any]] = []
    listed = args.step is None and not st.exists(MANIFEST) and not st.exists(METADATA)
    passed: dict[int, str] = {}
    if listed:
        todo = []
        for s in Catalog(st).scan():  # a run root: every committed step
            if s.committed or s.passed_over is not None:
                todo.append(s.step)
                if s.passed_over is not None:
                    passed[s.step] = s.passed_over
            elif s.status == Status.CORRUPT:
                out.append({"step": s.step, "status": "failed", "problems": [s.problem]})
            elif s.status == Status.NEWER:
                out.append({"step": s.step, "status": "newer", "problems": [s.problem]})
            else:
                out.append({"step": s.step, "status": "skipped", "problems": []})
        if not todo and not out:
            resolve(st)  # raises the not-found error, with the steps that exist
    else:
        todo = [args.step]
    for step in todo:
        try:
            r = resolve(st, step)
        except CheckpointVersionError as e:
            out.append({"step": step, "status": "newer", "problems": [str(e)]})
            continue
        except CheckpointCorruptError as e:
            out.append({"step": step, "status": "failed", "problems": [str(e)]})
            continue
        except CheckpointNotFoundError:
            if not listed:
                raise  # the step or directory asked for is not there
            # Listed as committed a moment ago: deleted since (its manifest goes first).
            out.append({"step": step, "status": "deleted", "problems": []})
            continue
        out.append({"step": r.step, **verified(r, json=args.json)})
        if step in passed:
            out[-1]["passed_over"] = passed[step]
    return sorted(out, key=lambda x: x["step"] if x["step"] is not None else -1)


def cmd_verify(args: argparse.Namespace) -> int:
    if _url_or_memory(args, "verify"):
        return cmd_verify_memory(args)
    results = _verify_steps(args)
    failed = [x for x in results if x["status"] in ("failed", "newer")]
    if args.json:
        doc = {"url": args.url, "ok": not failed, "steps": results}
        print(json_doc(doc))
        return 1 if failed else 0
    for x in results:
        for line in verdict_lines(f"step {x['step']}", x):
            print(printable(line))
    return 1 if failed else 0


def cmd_prune(args: argparse.Namespace) -> int:
    from muon_ckpt._errors import CheckpointNotFoundError
    from muon_ckpt.store import Catalog, prune

    if _url_or_memory(args, "prune"):
        if args.keep is not None:
            raise ValueError("prune --memory clears the memory tier: --keep does not apply")
        return cmd_prune_memory(args)
    if args.keep is None:
        raise ValueError("muon-ckpt prune needs --keep N (committed steps to keep)")

    st = _open_run(args, "prune")
    if not Catalog(st).scan():  # a mistyped url: say so, as ls does, rather than "deleted 0"
        raise CheckpointNotFoundError(
            f"no run at {args.url!r}: no step directory (step-XXXXXXXX) there; nothing to "
            "prune (muon-ckpt ls shows what is there)"
        )
    res = prune(st, args.keep, dry_run=args.dry_run)
    if args.json:
        print(json_doc({"url": args.url, "dry_run": args.dry_run, **vars(res)}))
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
    if res.lines:
        print(f"{verb} the records of older memory-tier lines: {', '.join(res.lines)}")
    return 0
