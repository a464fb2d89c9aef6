"""A load's storage requests do not grow with the run, and what a process read is not read
again: a load into a run of 2 and of 50 kept steps makes the same requests (locally: opens
and listings under the root; on S3, moto behind a counting proxy), the save after it reads
no manifest the load read, and a step another process wrote again under the same number
since is read again, never taken from memory.

A long run is made by ``synthetic_steps`` (copies of step 1's manifest and metadata, each
naming a data directory of its own), then one real save and ``close()``, as a job ending
after a save leaves it; a new manager (a restarted job) is then counted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from muon_ckpt import CheckpointManager
from muon_ckpt.store import MANIFEST, Manifest, Storage, step_dirname
from tests._ckpt import TinyNet, make_muon, train
from tests._dist import run_on_ranks
from tests._faults import FaultProxy
from tests.store._requests import LocalCounter, ProxyCounter, synthetic_steps

_LOCAL = LocalCounter()

# The most requests of each kind a load of the newest step may make, whatever the run's length.
S3_LOAD_MAX = {"LIST": 4, "HEAD": 1, "GET": 14}


def _model() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = make_muon(model)
    train(model, opt, 1)
    return model, opt


def _long_run(url: str, opts: dict[str, Any], steps: int) -> int:
    """A run of ``steps`` committed steps ended by a job that saved its newest; returns it."""
    model, opt = _model()
    with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as m:
        m.save(1)
    synthetic_steps(url, opts, steps - 1)
    with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as m:
        assert m.load() == steps - 1
        train(model, opt, 1)
        m.save(steps)
    return steps


def _s3(s3_server: str, s3_bucket: tuple[str, dict]) -> tuple[FaultProxy, str, dict]:
    bucket, opts = s3_bucket
    proxy = FaultProxy(s3_server).start()
    return proxy, bucket, {**opts, "endpoint_url": proxy.url}


def test_local_load_requests_flat(tmp_path: Any) -> None:
    counts = {}
    for n in (2, 50):
        root = str(tmp_path / f"run{n}")
        newest = _long_run(root, {}, n)
        model, opt = _model()
        with CheckpointManager(root, model=model, optimizer=opt) as m:
            _LOCAL.root = root
            _LOCAL.clear()
            try:
                assert m.load() == newest
                counts[n] = _LOCAL.read()
            finally:
                _LOCAL.root = None
    assert counts[2] == counts[50], counts


@pytest.mark.timeout(600)
def test_s3_load_requests_flat(s3_server: str, s3_bucket: tuple[str, dict]) -> None:
    proxy, bucket, opts = _s3(s3_server, s3_bucket)
    counts, manifests = {}, {}
    try:
        for n in (2, 50):
            url = f"s3://{bucket}/run{n}"
            newest = _long_run(url, opts, n)
            model, opt = _model()
            counter = ProxyCounter(proxy.control_url, paths=True)
            with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as m:
                counter.clear()
                assert m.load() == newest
                counts[n] = counter.read()
                manifests[n] = [p for p in counter.paths("GET") if p.endswith(MANIFEST)]
    finally:
        proxy.stop()
    assert counts[2] == counts[50], counts
    assert len(manifests[50]) == 1 and step_dirname(50) in manifests[50][0], manifests
    for kind, most in S3_LOAD_MAX.items():
        assert counts[50].get(kind, 0) <= most, (kind, counts)


@pytest.mark.timeout(600)
def test_s3_save_after_a_load_reads_no_manifest_the_load_read(
    s3_server: str, s3_bucket: tuple[str, dict]
) -> None:
    proxy, bucket, opts = _s3(s3_server, s3_bucket)
    try:
        url = f"s3://{bucket}/run"
        newest = _long_run(url, opts, 20)
        model, opt = _model()
        counter = ProxyCounter(proxy.control_url, paths=True)
        with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as m:
            counter.clear()
            assert m.load() == newest
            loaded = {p for p in counter.paths("GET") if p.endswith(MANIFEST)}
            train(model, opt, 1)
            counter.clear()
            m.save(newest + 1)
            again = [p for p in counter.paths("GET") if p.endswith(MANIFEST)]
            assert m.steps()[-1] == newest + 1
    finally:
        proxy.stop()
    assert loaded, loaded
    # (the save reads back the manifest it wrote: that one is new)
    assert not loaded & set(again), (sorted(loaded), again)


def _overwrite(rank: int, world: int, url: str, opts: dict, step: int) -> tuple[int, dict]:
    """Another job: loads ``step``, trains on and saves it again over itself; returns the
    new commit's generation and the model's state it saved."""
    model, opt = _model()
    with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as m:
        assert m.load() == step
        train(model, opt, 3, seed=7)
        m.save(step, overwrite=True)
    data = Storage(url, opts).read_bytes(step_dirname(step), MANIFEST)
    return Manifest.from_json(data, "").gen, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(600)
def test_s3_a_step_rewritten_by_another_process_is_read_again(
    s3_server: str, s3_bucket: tuple[str, dict]
) -> None:
    """A manager that loaded step N sees step N as another job saved it again since (its
    generation, its state): its next save's generation is above it, and a load reads it."""
    proxy, bucket, opts = _s3(s3_server, s3_bucket)
    try:
        url = f"s3://{bucket}/run"
        newest = _long_run(url, opts, 6)
        model, opt = _model()
        with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as m:
            assert m.load() == newest
            before = m.step_info(newest).gen
            gen, state = run_on_ranks(_overwrite, 1, url, opts, newest)[0]
            assert gen > before
            assert m.step_info(newest).gen == gen  # (not the one this process read)
            assert m.load() == newest
            for k, v in model.state_dict().items():  # (the other job's state, bitwise)
                assert torch.equal(v, state[k]), k
            train(model, opt, 1)
            m.save(newest + 1)
            info = m.step_info(newest + 1)
            assert info is not None and info.gen is not None and info.gen > gen, (info, gen)
    finally:
        proxy.stop()


@pytest.mark.parametrize("store", ["local", "s3"])
def test_an_index_that_does_not_parse_or_is_missing_is_read_past(store, tmp_path, request):
    """The index is a cache: one that does not parse, or none (deleted, or never written by
    an older version), and a load reads the manifests as without it and loads the same."""
    from muon_ckpt.store import INDEX

    if store == "local":
        url, opts = str(tmp_path / "run"), {}
    else:
        bucket, opts = request.getfixturevalue("s3_bucket")
        url = f"s3://{bucket}/run"
    newest = _long_run(url, opts, 5)
    st = Storage(url, opts)
    for damage in (b'{"format": "muon-ckpt-index", "version": 1, "steps": [{"dir"', None):
        if damage is None:
            st.rm(INDEX)
        else:
            st.write_bytes(damage, INDEX)
        model, opt = _model()
        with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as m:
            assert m.steps() == list(range(1, newest + 1))
            assert m.load() == newest
            assert [i.gen for i in map(m.step_info, m.steps())] == [
                Manifest.from_json(st.read_bytes(step_dirname(s), MANIFEST), "").gen
                for s in m.steps()
            ]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("store", ["local", "s3"])
def test_the_first_save_after_a_load_is_flat(store, tmp_path, request):
    """The first save of a restarted job (lease taken over, run listed, data collected)
    makes the same requests with 2 and 50 steps kept: what the load found in the index
    stands (its steps by their manifests' stamps, the data directories found all live by
    the steps naming them), so no other manifest is read and no data directory listed."""
    proxy = None
    if store == "s3":
        proxy, bucket, opts = _s3(
            request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        )
    counts = {}
    try:
        for n in (2, 50):
            if proxy is None:
                url, opts, counter = str(tmp_path / f"run{n}"), {}, _LOCAL
                _LOCAL.root = url
            else:
                url, counter = f"s3://{bucket}/run{n}", ProxyCounter(proxy.control_url)
            newest = _long_run(url, opts, n)
            model, opt = _model()
            with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as m:
                assert m.load() == newest
                train(model, opt, 1)
                counter.clear()
                m.save(newest + 1)
                counts[n] = counter.read()
                assert m.steps()[-1] == newest + 1
    finally:
        _LOCAL.root = None
        if proxy is not None:
            proxy.stop()
    assert counts[2] == counts[50], counts
