"""Run a test body on N real processes.

``run_on_ranks(fn, world_size, *args)`` starts ``world_size`` processes, each with a real
``torch.distributed`` process group (NCCL on ``cuda:<rank>`` when enough GPUs are present,
gloo on the CPU otherwise), calls ``fn(rank, world_size, *args)`` in every one and returns the
list of per-rank return values. A failing rank's traceback is raised in the parent as an
``AssertionError``; a hang is cut off after ``timeout`` seconds with every rank's Python stack
dumped, so a test never blocks CI.

``fn`` must be a module-level function (it is pickled by reference into the children); its
return value is pickled back by value (tensors included).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_CTX = None


def _context():
    # forkserver: children fork from a clean server that has already imported torch, which is
    # much faster than "spawn" and safe (the server itself never ran a torch op or a thread).
    # It imports what every rank imports next, too (DTensor and FSDP, the packages, the test
    # helpers): a rank then starts in about half the time, the suite's largest cost.
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    # An optimizer's first __init__ imports torch._dynamo (torch._disable_dynamo): 1.5-2.5 s
    # in every rank that builds one, when the server has not imported it.
    "torch._dynamo",
    "muon_ckpt.manager",
    "optim",
    "s3fs",  # (0.5-0.9 s in each rank that opens S3 storage; skipped where not installed)
    "tests.conftest",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_device() -> torch.device:
    """The device this rank computes on: ``cuda:<local rank>`` under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def eight_ranks_reason() -> str | None:
    """Why the 8-rank cases do not run here, or None when they do: on 8 GPUs (NCCL), or on
    gloo when MUON_CKPT_TEST_8_RANKS=1 (8 processes: slow on a 2-core CI machine, which runs
    the same cases at 1-4 ranks)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= 8:
        return None
    if os.environ.get("MUON_CKPT_TEST_8_RANKS") == "1":
        return None
    return "8 ranks need 8 GPUs (NCCL) or MUON_CKPT_TEST_8_RANKS=1 (gloo); 1-4 ranks run always"


def use_cuda(world_size: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


def _rank_env(rank: int, world_size: int, port: int) -> None:
    """This process as rank ``rank`` of ``world_size`` on 127.0.0.1:``port``, one thread."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)


def _init_group(rank: int, world_size: int) -> None:
    """NCCL on ``cuda:<rank>`` when there are enough GPUs, else gloo."""
    if use_cuda(world_size):
        torch.cuda.set_device(rank)
    backend = "nccl" if use_cuda(world_size) else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def _child(fn, rank, world_size, port, args, results, stack_file, timeout):
    _rank_env(rank, world_size, port)
    with open(stack_file, "w") as stacks:
        # If the parent's timeout is about to fire, leave every thread's stack behind.
        faulthandler.dump_traceback_later(max(timeout - 5, 1), file=stacks, exit=False)
        try:
            _init_group(rank, world_size)
            try:
                out = fn(rank, world_size, *args)
            finally:
                dist.destroy_process_group()
            # Plain pickle, not multiprocessing's: tensors travel by value, not as shared-memory
            # handles that die with this process.
            results.put((rank, True, pickle.dumps(out)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()


def _spawn(
    target: Callable[..., Any], fn: Callable[..., Any], world_size: int, args: Any, timeout: float
) -> tuple[list[Any], Any, list[str]]:
    """``world_size`` processes running ``target(fn, rank, ...)``, started: (them, the queue
    their results come back on, the files each leaves its stacks in before a timeout)."""
    ctx = _context()
    port = _free_port()
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="muon_ckpt_dist_")
    stack_files = [os.path.join(tmp, f"stack{r}.txt") for r in range(world_size)]
    procs = [
        ctx.Process(
            target=target,
            args=(fn, r, world_size, port, args, results, stack_files[r], timeout),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs, results, stack_files


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0
) -> list[Any]:
    procs, results, stack_files = _spawn(_child, fn, world_size, args, timeout)
    outs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(outs) + len(failures) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            dead = [r for r in dead if r not in outs and r not in failures]
            if dead:
                # A rank died without reporting (segfault, os._exit): the others would hang.
                for r in dead:
                    failures[r] = f"rank {r} exited with code {procs[r].exitcode} without a result"
                break
            continue
        if ok:
            outs[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
        if not ok:
            break  # one rank failed: the others are likely blocked in a collective
    for p in procs:
        p.join(timeout=10 if not failures else 2)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    try:
        _raise_failures(fn, world_size, outs, failures, stack_files, timeout)
    finally:
        shutil.rmtree(os.path.dirname(stack_files[0]), ignore_errors=True)
    return [outs[r] for r in range(world_size)]


def run_then_kill(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    kill_after: float | None = None,
    kill_when: Callable[[], bool] | None = None,
) -> list[Any] | None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks as ``run_on_ranks`` does;
    once every rank's ``fn`` has returned, SIGKILL them all: no ``close()``, no exit hooks, no
    process-group teardown (a crashed job). Returns what each ``fn`` returned; a rank that
    failed is raised as by ``run_on_ranks``. With ``kill_after``, they are killed that many
    seconds after they started, wherever they are (then None is returned); with
    ``kill_when``, as soon as it returns True (polled; a marker the ranks write, so that the
    kill never races the machine's speed), within ``timeout``."""
    procs, results, stack_files = _spawn(_child_then_wait, fn, world_size, args, timeout)
    outs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + (timeout if kill_after is None else kill_after)
    when = kill_when is not None
    if when:
        kill_after = 0.0  # (killed wherever they are: nothing is returned)
    try:
        while len(outs) + len(failures) < world_size and time.monotonic() < deadline:
            if when and kill_when():
                break
            try:
                rank, ok, payload = results.get(timeout=0.05 if when else 1.0)
            except queue.Empty:
                continue
            if ok:
                outs[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                break
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, 9)
            p.join()
    try:
        if when and not failures and not kill_when():
            raise AssertionError(f"{fn.__name__}: not ready to be killed within {timeout:.0f}s")
        if kill_after is None or failures:
            _raise_failures(fn, world_size, outs, failures, stack_files, timeout)
    finally:
        shutil.rmtree(os.path.dirname(stack_files[0]), ignore_errors=True)
    return None if kill_after is not None else [outs[r] for r in range(world_size)]


def _child_then_wait(fn, rank, world_size, port, args, results, stack_file, timeout):
    """``_child``, but a rank that is done reports and waits to be killed (``run_then_kill``)."""
    _rank_env(rank, world_size, port)
    with open(stack_file, "w") as stacks:
        faulthandler.dump_traceback_later(max(timeout - 5, 1), file=stacks, exit=False)
        try:
            _init_group(rank, world_size)
            out = fn(rank, world_size, *args)
            results.put((rank, True, pickle.dumps(out)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
            return
        finally:
            faulthandler.cancel_dump_traceback_later()
    threading.Event().wait()  # until the parent's SIGKILL


def _raise_failures(fn, world_size, outs, failures, stack_files, timeout) -> None:
    if failures or len(outs) < world_size:
        parts = [f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures.items())]
        missing = [r for r in range(world_size) if r not in outs and r not in failures]
        if missing and not failures:
            parts.append(f"timed out after {timeout:.0f}s waiting for ranks {missing}")
            for r in missing:
                try:
                    with open(stack_files[r]) as f:
                        parts.append(f"--- rank {r} stacks ---\n{f.read()}")
                except OSError:
                    pass
        raise AssertionError(
            f"distributed test {getattr(fn, '__name__', fn)} on {world_size} ranks:\n"
            + "\n".join(parts)
        )


def run_script(args: list[str], timeout: float = 300.0, env: dict | None = None):
    """Run a Python command in a fresh interpreter (used for kill/restart tests)."""
    import subprocess

    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=full_env
    )


def run_module(
    args: list[str], timeout: float = 300.0, env: dict | None = None, cwd: str | None = None
):
    """``run_script(["-m", module, *argv])``'s result, the module run as ``__main__`` in a
    process of its own forked from the ranks' forkserver, not in a fresh interpreter: torch,
    torch._dynamo and the packages are imported already (3-5 s of CPU a fresh one spends, with
    the collections at its exit), and torch runs one intra-op thread, as in the ranks. It
    ends as an interpreter does, the threads joined and the atexit hooks run, but leaves
    with ``os._exit`` (no module teardown); a signal that kills it is its returncode
    (negative). Not for what a fresh interpreter is the point of (how it exits or handles a
    signal, what it imports, its memory, its hash seed) nor for a launcher that starts the
    module again by name (torchrun, Lightning's DDP). ``env``: set in its environment (not
    what was imported already read)."""
    import subprocess

    assert args[0] == "-m", args
    tmp = tempfile.mkdtemp(prefix="muon_ckpt_module_")
    out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    where = (cwd or os.getcwd(), out, err, env or {})
    p = _context().Process(target=_module_child, args=(args[1], args[2:], *where))
    p.start()
    p.join(timeout)
    try:
        if p.is_alive():
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
        with open(out) as f, open(err) as g:
            return subprocess.CompletedProcess(
                [sys.executable, *args], p.exitcode, f.read(), g.read()
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _module_child(module: str, argv: list[str], cwd: str, out: str, err: str, env: dict) -> None:
    """``python -m module *argv`` in this forked process, its output to the files ``out`` and
    ``err`` (what C code writes too)."""
    import atexit
    import runpy

    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.update(env)
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:  # (an interpreter's exit: threads first, then the atexit hooks)
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
