"""Storage problems are found at construction and raised as CheckpointErrors: a half URL, an option typo, missing credentials, an unreachable or stalling endpoint, a missing
bucket (never created)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from muon_ckpt import CheckpointError, CheckpointManager, CheckpointStorageError
from muon_ckpt.store._retry import ATTEMPTS
from tests.conftest import _free_port


def test_half_url_is_a_value_error_not_a_local_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"did you mean s3://ckpt/run\?"):
        CheckpointManager("s3:/ckpt/run")
    with pytest.raises(ValueError, match=r"did you mean gs://bucket/run\?"):
        CheckpointManager("gs:bucket/run")
    assert os.listdir(tmp_path) == []  # nothing written to ./s3:/ckpt/run


def test_storage_option_typo_is_named_at_construction(s3_bucket):
    bucket, opts = s3_bucket
    with pytest.raises(ValueError, match=r"the option 'endpont_url' is not accepted"):
        CheckpointManager(f"s3://{bucket}/run", storage_options={**opts, "endpont_url": "x"})


def test_missing_credentials_are_found_at_construction(s3_bucket, monkeypatch):
    bucket, opts = s3_bucket
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_creds = {k: v for k, v in opts.items() if k not in ("key", "secret")}
    with pytest.raises(CheckpointStorageError, match=r"no credentials .*key=, secret="):
        CheckpointManager(f"s3://{bucket}/run", storage_options=no_creds)


def _requests_sent(caplog: pytest.LogCaptureFixture) -> int:
    """HTTP requests botocore sent while ``caplog`` listened (one log line per attempt)."""
    return sum(r.getMessage().startswith("Sending http request") for r in caplog.records)


def test_unreachable_endpoint_fails_fast_at_construction(s3_bucket, caplog):
    """One attempt, no retry storm (which took 5-6 s): counted in requests sent."""
    bucket, opts = s3_bucket
    dead = f"http://127.0.0.1:{_free_port()}"
    reach = r"cannot reach the storage at .*check"
    with (
        caplog.at_level(logging.DEBUG, "botocore.endpoint"),
        pytest.raises(CheckpointStorageError, match=reach),
    ):
        CheckpointManager(f"s3://{bucket}/run", storage_options={**opts, "endpoint_url": dead})
    assert _requests_sent(caplog) == 1


def test_missing_bucket_is_reported_and_never_created(s3_server, s3_bucket):
    import s3fs

    from tests.conftest import s3_options

    _, opts = s3_bucket
    with pytest.raises(CheckpointStorageError, match=r"bucket 'no-such-bucket-17' does not exist"):
        CheckpointManager("s3://no-such-bucket-17/run", storage_options=opts)
    assert not s3fs.S3FileSystem(**s3_options(s3_server)).exists("no-such-bucket-17")


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An HTTP endpoint that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    for c in conns:
        c.close()
    srv.close()


def test_a_stalled_storage_is_bounded_by_storage_timeout(silent_endpoint, s3_bucket, caplog):
    """The probe of an endpoint that accepts connections but never answers: each attempt cut
    by its read timeout (the error says so) and retried within storage_timeout (only an
    endpoint that refuses connections, or an unknown host, is given up at once)."""
    bucket, opts = s3_bucket
    t0 = time.monotonic()
    opts = {**opts, "endpoint_url": silent_endpoint}
    with (
        caplog.at_level(logging.DEBUG, "botocore.endpoint"),
        pytest.raises(CheckpointStorageError) as ei,
    ):
        CheckpointManager(f"s3://{bucket}/run", storage_options=opts, storage_timeout=1.0)
    # Each attempt's read timeout is a third of the budget, and at least two were sent
    # (below): the wait was theirs; no attempt starts that the budget's rest cannot hold
    assert time.monotonic() - t0 >= 2 * 1.0 / 3
    assert 2 <= _requests_sent(caplog) <= ATTEMPTS, _requests_sent(caplog)
    assert isinstance(ei.value, CheckpointError) and silent_endpoint in str(ei.value)
    assert "ReadTimeout" in str(ei.value), ei.value


def test_storage_timeout_and_lease_are_validated():
    with pytest.raises(ValueError, match="storage_timeout must be a number of seconds > 0"):
        CheckpointManager("/tmp/x", storage_timeout=0)
    with pytest.raises(ValueError, match="lease_seconds must be a number of seconds > 0"):
        CheckpointManager("/tmp/x", lease_seconds="1")
    with pytest.raises(ValueError, match="confirm must be one of"):
        CheckpointManager("/tmp/x", confirm="md5")
