"""``ls --memory``, ``verify --memory`` and ``prune --memory``: the memory tier of this node
(one directory)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from muon_ckpt.cli._text import human, json_doc, open_url, printable
from muon_ckpt.cli._verdicts import verdict_lines, verified

__all__ = ["cmd_ls_memory", "cmd_prune_memory", "cmd_verify_memory"]


def _runs(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The tier root and the run directories to look at (the url's only, when given)."""
    from muon_ckpt.memory import default_root, is_run_dirname, run_dirname

    root = os.path.abspath(args.memory or default_root())
    if not os.path.isdir(root):
        return root, []
    names = sorted(n for n in os.listdir(root) if is_run_dirname(n))
    if args.url:
        want = run_dirname(open_url(args).url_of())
        names = [n for n in names if n == want]
    return root, names


def _describe(root: str, name: str) -> dict[str, Any]:
    from muon_ckpt.memory import list_parts, read_run_file, unsafe_reason

    path = os.path.join(root, name)
    why = unsafe_reason(root) or unsafe_reason(path)
    run: dict[str, Any] = {"dir": path, "url": read_run_file(path), "problem": why, "steps": []}
    if why is not None:
        return run
    steps: dict[int, dict[str, Any]] = {}
    for p in list_parts(path):
        s = steps.setdefault(
            p.step,
            {"step": p.step, "own": [], "copies": [], "bytes": 0, "problems": [], "lines": set()},
        )
        if p.manifest is None:
            s["problems"].append(f"{'copy' if p.copy else 'rank'} {p.rank}: {p.problem}")
            continue
        s["copies" if p.copy else "own"].append(p.rank)
        s["bytes"] += p.manifest.total_bytes
        s["world_size"] = p.manifest.world_size
        s["lines"].add(p.manifest.line)
    for s in steps.values():
        s["lines"] = sorted(x or "-" for x in s["lines"])
    run["steps"] = [steps[k] for k in sorted(steps)]
    return run


def cmd_ls_memory(args: argparse.Namespace) -> int:
    root, names = _runs(args)
    runs = [_describe(root, n) for n in names]
    if args.json:
        print(json_doc({"memory_dir": root, "runs": runs}))
        return 0
    if not runs:
        print(f"no memory-tier runs in {printable(root)}")
        return 0
    for run in runs:
        print(f"{printable(run['dir'])}: {printable(run['url'] or '(url unknown)')}")
        if run["problem"] is not None:
            print(f"  not read: {printable(run['problem'])}")
            continue
        if not run["steps"]:
            print("  no parts")
        for s in run["steps"]:
            own = ",".join(map(str, s["own"])) or "-"
            copies = ",".join(map(str, s["copies"])) or "-"
            print(
                f"  step {s['step']:>8}  parts of ranks {own}  replicas of ranks {copies}  "
                f"{human(s['bytes'])}  world {s.get('world_size', '-')}  "
                f"line {','.join(s['lines']) or '-'}"
            )
            for problem in s["problems"]:
                print(f"    unusable: {printable(problem)}")
    print("(this node's memory tier only; a step restores when every rank's part is on some node)")
    return 0


def _verify_run(root: str, name: str, json: bool) -> dict[str, Any]:
    """Every part of one run directory checked as a restore would find it: its manifest (a
    part's, of this version), then as a step is (``verified``), its chunks one rank's shards."""
    from muon_ckpt.memory import list_parts, read_run_file, unsafe_reason
    from muon_ckpt.store import Resolved, Storage

    path = os.path.join(root, name)
    why = unsafe_reason(root) or unsafe_reason(path)
    run: dict[str, Any] = {"dir": path, "url": read_run_file(path), "problem": why, "parts": []}
    if why is not None:
        return run
    st = Storage(path)
    for p in sorted(list_parts(path), key=lambda p: (p.step, p.rank, p.copy)):
        part = {"step": p.step, "rank": p.rank, "copy": p.copy, "dir": p.dirname}
        if p.manifest is None:
            part.update(status="failed", problems=[p.problem])
        else:
            r = Resolved(st, tuple(p.dirname.split("/")), p.step, p.manifest)
            part.update(verified(r, json=json, tiles=False))
        run["parts"].append(part)
    return run


def cmd_verify_memory(args: argparse.Namespace) -> int:
    """Exit 1 when any part, or a run directory, would not be restored from."""
    if args.step is not None:
        raise ValueError("verify --memory checks every part of the tier: --step does not apply")
    root, names = _runs(args)
    runs = [_verify_run(root, n, args.json) for n in names]
    failed = any(r["problem"] is not None for r in runs) or any(
        p["status"] == "failed" for r in runs for p in r["parts"]
    )
    if args.json:
        print(json_doc({"memory_dir": root, "ok": not failed, "runs": runs}))
        return 1 if failed else 0
    if not runs:
        print(f"no memory-tier runs in {printable(root)}")
    for run in runs:
        print(f"{printable(run['dir'])}: {printable(run['url'] or '(url unknown)')}")
        if run["problem"] is not None:
            print(f"  FAILED: not read: {printable(run['problem'])}")
            continue
        if not run["parts"]:
            print("  no parts")
        for p in run["parts"]:
            whose = f"replica of rank {p['rank']}" if p["copy"] else f"rank {p['rank']}"
            for line in verdict_lines(f"step {p['step']} {whose}", p):
                print(f"  {printable(line)}")
    return 1 if failed else 0


def cmd_prune_memory(args: argparse.Namespace) -> int:
    import shutil

    from muon_ckpt.memory import unsafe_reason

    root, names = _runs(args)
    removed, refused = [], []
    for name in names:
        path = os.path.join(root, name)
        why = unsafe_reason(root) or unsafe_reason(path)
        if why is not None:
            refused.append((path, why))
            continue
        if not args.dry_run:
            shutil.rmtree(path)
        removed.append(path)
    if args.json:
        doc = {
            "memory_dir": root,
            "dry_run": args.dry_run,
            "removed": removed,
            "refused": [{"dir": p, "why": w} for p, w in refused],
        }
        print(json_doc(doc))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(removed)} memory-tier run(s) in {printable(root)}")
    for p in removed:
        print(f"  {printable(p)}")
    for p, why in refused:
        print(f"not touched: {printable(p)}: {printable(why)}")
    return 0
