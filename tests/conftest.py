"""Shared fixtures: a real S3 endpoint (moto server on 127.0.0.1) and the storage matrix.

``s3_server``: one moto server per session, on a free port. ``s3_bucket``: a fresh bucket per
test, yielding ``(bucket, storage_options)``. ``storage_url``: parametrized over a local
directory, ``memory://`` and moto S3; yields ``(url, storage_options)``. Processes started by
``run_on_ranks`` get the url and options as arguments (``memory://`` lives in one process
only, so multi-process tests use local and S3).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

# One intra-op thread, as in the rank processes (tests/_dist.py) and the scripts the tests
# start: a reference computed in the test process then sums in the same order as they do,
# whatever the host's core count (a 16-core host splits reductions differently).
torch.set_num_threads(1)

# A suite started in the background of a shell without job control (`cmd &` in a script)
# inherits SIGINT ignored, and so would every child it starts: the tests that interrupt a
# child would see nothing raised. Each child is to meet Ctrl-C as a user's process does.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# moto needs credentials to exist; they are never sent anywhere but 127.0.0.1.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


# The slowest test files, slowest first (a worker's seconds on 2 idle cores): the suite starts
# with them, and README's `-n 2` hands out the rest (--dist worksteal, pyproject.toml) while
# they run, so that one worker is not left alone with a long module at the end. A module
# stays whole on one worker but for a steal (its module-scoped fixtures run once).
SLOWEST_FIRST = (
    "store/test_fault_matrix.py",  # (two tests of 40 s)
    "manager/test_interrupt_storm.py",  # (one of 20 s, one of 50 s on S3)
    "manager/test_run_edges.py",
    "store/test_faults.py",
    "store/test_fault_ranks.py",
    "integrations/test_integration_meshes.py",
    "integrations/test_integration_transformers.py",
    "integrations/test_integration_lightning.py",
    "benchmarks/test_benchmarks_cpu.py",
    "memory/test_memory_tier.py",
    "manager/test_manager_errors.py",
    "save/test_async_save.py",
    "store/test_lines.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {f"tests/{name}": i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))


def share_botocore_models() -> None:
    """One botocore loader per process, as the clients of one botocore session share theirs:
    s3fs starts a session per filesystem (a manager opens two), and each one parsed the S3
    service model again, 0.15 s of CPU. What the clients load and send is unchanged. The
    models are read here, once: in the ranks' forkserver, for every rank it forks."""
    import botocore.session

    if not hasattr(botocore.session.create_loader, "cache_info"):
        cached = functools.lru_cache(maxsize=None)(botocore.session.create_loader)
        botocore.session.create_loader = cached
        # (a client makes no connection, nor thread, before its first request)
        botocore.session.get_session().create_client(
            "s3", region_name="us-east-1", aws_access_key_id="-", aws_secret_access_key="-"
        )


if "botocore.session" in sys.modules:  # (the ranks' forkserver, which preloads s3fs first)
    share_botocore_models()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server running for the whole session."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    share_botocore_models()
    import logging

    import moto.backends

    # It lists the folders of its own package to route each request (1 ms a request).
    listed = tuple(moto.backends.list_of_moto_modules())
    moto.backends.list_of_moto_modules = lambda: listed
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = _free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "skip_instance_cache": True,
    }


@pytest.fixture
def s3_bucket(s3_server: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh, empty bucket: ``(bucket name, storage_options)``."""
    import s3fs

    opts = s3_options(s3_server)
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    fs = s3fs.S3FileSystem(**opts)
    fs.mkdir(bucket)
    yield bucket, opts
    with contextlib.suppress(FileNotFoundError):
        fs.rm(bucket, recursive=True)


@pytest.fixture(params=["local", "memory", "s3"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[str, dict]]:
    """``(url, storage_options)`` of an empty checkpoint root on each backend."""
    kind = request.param
    if kind == "local":
        yield str(tmp_path / "ckpt"), {}
    elif kind == "memory":
        import fsspec

        root = f"/muon-ckpt-test-{uuid.uuid4().hex[:12]}"
        yield f"memory://{root}/run", {}
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)
    else:
        bucket, opts = request.getfixturevalue("s3_bucket")
        yield f"s3://{bucket}/run", opts


# ---------------------------------------------------------------------- single-process helpers
def tiny_run(seed: int = 0, *, hidden: int = 6, rename: str | None = None):
    """A small model (two Linear layers) and a Muon with a Muon group and an AdamW group.

    ``rename``: register the first layer under this name instead of ``"first"``.
    """
    import torch
    from torch import nn

    from optim.muon import Muon

    torch.manual_seed(seed)
    model = nn.Module()
    model.add_module(rename or "first", nn.Linear(4, hidden))
    model.add_module("second", nn.Linear(hidden, 3))
    mats = [p for p in model.parameters() if p.ndim == 2]
    vecs = [p for p in model.parameters() if p.ndim < 2]
    opt = Muon([{"params": mats, "lr": 0.02}, {"params": vecs, "use_muon": False, "lr": 1e-3}])
    return model, opt


def tiny_train(model, opt, steps: int, seed: int = 0) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def tiny_snapshot(model, opt) -> dict:
    """Clones of every parameter and optimizer state, keyed by FQN."""
    out = {}
    for n, p in model.named_parameters():
        out[n] = p.detach().clone()
        for k, v in opt.state.get(p, {}).items():
            out[f"{n}:{k}"] = v.detach().clone()
    return out


def assert_same(a: dict, b: dict) -> None:
    """The same keys, and bitwise the same tensors (equal values otherwise)."""
    import torch

    assert sorted(a) == sorted(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k
