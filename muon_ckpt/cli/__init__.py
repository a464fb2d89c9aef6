"""The ``muon-ckpt`` command: ls, inspect, verify, export, prune, demo.

Imports are lazy (torch is only imported by the commands that need it) so ``--help`` is fast.
Errors print one line ``muon-ckpt: error: ...`` and exit 1; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from muon_ckpt._errors import passes_interrupts
from muon_ckpt._version import __version__
from muon_ckpt.cli._export import cmd_export
from muon_ckpt.cli._steps import cmd_inspect, cmd_ls, cmd_prune, cmd_verify
from muon_ckpt.cli._text import one_line, storage_options

__all__ = ["main"]


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
            storage_options=storage_options(args.storage_option),
        )
    )


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

    # ls, verify and prune: the url is optional with --memory (this node's memory tier).
    maybe_url = argparse.ArgumentParser(add_help=False, parents=[common])
    maybe_url.add_argument(
        "url", nargs="?", help="run root (path or URL); with --memory: only this run's tier"
    )
    maybe_url.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec storage option for remote URLs (repeatable; VALUE may be JSON)",
    )
    maybe_url.add_argument(
        "--memory",
        nargs="?",
        const="",
        metavar="DIR",
        help="the memory tier on this node instead: memory_dir DIR (default "
        "/dev/shm/muon-ckpt-<uid>)",
    )

    s = sub.add_parser("ls", parents=[maybe_url], help="list steps, committed or not")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("inspect", parents=[remote], help="keys, shapes, dtypes and bytes")
    s.add_argument("--step", type=int, help="step to inspect (default: newest committed)")
    s.add_argument("--keys", metavar="GLOB", help="only keys matching this glob")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser(
        "verify",
        parents=[maybe_url],
        help="check every step (or, with --memory, every part of this node's memory tier) as a "
        "load would: files, checksums, metadata, every stored item",
    )
    s.add_argument(
        "--step", type=int, help="step to verify (default: every committed step; not --memory)"
    )
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

    s = sub.add_parser(
        "prune",
        parents=[maybe_url],
        help="delete old committed steps; with --memory, clear this node's memory tier",
    )
    s.add_argument("--keep", type=int, help="committed steps to keep (>= 1; not with --memory)")
    s.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_prune)

    s = sub.add_parser(
        "demo", parents=[common], help="train, SIGKILL, resume, and check bitwise equality"
    )
    add_demo_arguments(s)
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(passes_interrupts(args.func)(args) or 0)  # (Ctrl-C: exit 130)
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
        print(f"muon-ckpt: error: {one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
