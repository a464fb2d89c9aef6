"""A manager keeps nothing alive behind the caller's back: once it is closed (or dropped) and
the caller lets go of the model and optimizer, they are freed at once by reference counting,
with no garbage collection. On a GPU that is their device memory (parameters, states, the
staging's page-locked buffers): a reference cycle through the manager held gigabytes of it
until Python's occasional full collection, and the next model built beside them ran out of
memory (tests/gpu/test_offload_gpu.py saw the previous tests' models still allocated).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest

from muon_ckpt import CheckpointManager, MemoryOptions
from tests.conftest import tiny_run, tiny_train


@contextlib.contextmanager
def _refcounting_only(tmp_path) -> Iterator[None]:
    """Automatic collection off: only reference counting frees anything inside."""
    # A process's first optimizer and save import parts of torch lazily, and an import's
    # traceback keeps the frames of that call (the optimizer among them) in a cycle of its own.
    _saved(str(tmp_path / "warm-up"))
    gc.collect()  # (and what earlier tests left in cycles is not this test's)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _alive(refs: dict[str, weakref.ref]) -> list[str]:
    return [name for name, r in refs.items() if r() is not None]


def _watch(model, opt) -> dict[str, weakref.ref]:
    objs = {"model": model, "optimizer": opt, "a parameter": model.first.weight}
    return {name: weakref.ref(obj) for name, obj in objs.items()}


def _saved(url: str, **kw) -> None:
    """A run with one committed step at ``url`` (what a load reads)."""
    model, opt = tiny_run(0)
    tiny_train(model, opt, 1)
    with CheckpointManager(url, model=model, optimizer=opt, **kw) as mgr:
        assert mgr.save(1)
        mgr.wait()


@pytest.mark.parametrize("snapshot", [False, True, "deferred"], ids=["sync", "async", "deferred"])
@pytest.mark.parametrize("use", ["save", "load"])
def test_a_closed_manager_leaves_the_model_and_optimizer_to_reference_counting(
    tmp_path, snapshot, use
):
    with _refcounting_only(tmp_path):
        url = str(tmp_path / "run")
        if use == "load":
            _saved(url, async_save=snapshot)
        model, opt = tiny_run(1)
        tiny_train(model, opt, 1, seed=1)
        refs = _watch(model, opt)
        with CheckpointManager(url, model=model, optimizer=opt, async_save=snapshot) as mgr:
            if use == "load":
                assert mgr.load() == 1
            else:
                assert mgr.save(2)
            mgr.wait()
        del model, opt, mgr
        assert _alive(refs) == [], "held in a reference cycle after the manager was closed"


def test_a_manager_with_a_memory_tier_leaves_them_to_reference_counting_too(tmp_path):
    with _refcounting_only(tmp_path):
        url, mem = str(tmp_path / "run"), str(tmp_path / "mem")
        kw = dict(interval=2, memory=MemoryOptions(interval=1, dir=mem), async_save=True)
        model, opt = tiny_run(1)
        refs = _watch(model, opt)
        with CheckpointManager(url, model=model, optimizer=opt, **kw) as mgr:
            for s in (1, 2, 3):
                tiny_train(model, opt, 1, seed=s)
                mgr.save(s)
                mgr.wait()
        del model, opt, mgr
        assert _alive(refs) == [], "held in a reference cycle after the manager was closed"
        model, opt = tiny_run(2)
        refs = _watch(model, opt)
        with CheckpointManager(url, model=model, optimizer=opt, **kw) as mgr:
            assert mgr.load() == 3
        del model, opt, mgr
        assert _alive(refs) == [], "held in a reference cycle after the manager was closed"


def test_a_manager_dropped_without_close_after_a_load_leaves_them_too(tmp_path):
    with _refcounting_only(tmp_path):
        url = str(tmp_path / "run")
        _saved(url)
        model, opt = tiny_run(1)
        refs = _watch(model, opt)
        assert CheckpointManager(url, model=model, optimizer=opt).load() == 1
        del model, opt
        assert _alive(refs) == [], "held in a reference cycle by a manager nobody holds"
