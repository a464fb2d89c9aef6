"""Urls spelled with ``//``, ``/./``, ``..`` or a trailing slash go to the keys they name.

Before the fix a save's data went to the url's own keys (``runs//run7/data/...``) while the
size check, the read-back and every read looked at the keys normalised in the text
(``runs/run7/data/...``): every save with dedup on failed with a CheckpointCorruptError
that blamed the storage, and the data it left was never collected. A step's references are
now resolved on the components, the root never rewritten, and an object store's url whose
key has an empty, ``.`` or ``..`` component is refused when the manager is made, naming the
plain url. Locally the operating system resolves those, the same way for writes and reads:
each shape saves, loads bitwise, finds the steps saved through the plain path, and keeps
only the data its steps refer to.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from muon_ckpt import CheckpointManager
from muon_ckpt.store import DATA, MANIFEST, Manifest, Storage, data_ref, step_dirname
from tests._ckpt import TinyNet, make_muon, muon_state_sd, train


def _model() -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = TinyNet()
    model.register_buffer("frozen", torch.randn(64, 64))  # 16 KiB: later steps refer to it
    return model, make_muon(model)


def _save_three(url: str, opts: dict[str, Any]) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 1-3 with keep_last=1 (dedup on, the default); the state saved at each."""
    model, opt = _model()
    want = {}
    with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts, keep_last=1) as m:
        for step in (1, 2, 3):
            train(model, opt, 1, seed=step)
            m.save(step)
            want[step] = muon_state_sd(model, opt)  # (clones)
            want[step]["frozen"] = model.frozen.clone()
    return want


def _check_run(url: str, opts: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    """Step 3 alone, loading bitwise through ``url``; the run's data is exactly what it
    refers to (step 2's went with it, step 1's frozen tensor stays)."""
    model, opt = _model()
    mgr = CheckpointManager(url, model=model, optimizer=opt, storage_options=opts)
    assert mgr.steps() == [3]
    assert mgr.load() == 3
    got = muon_state_sd(model, opt)
    got["frozen"] = model.frozen
    assert sorted(got) == sorted(want)
    assert all(
        torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v for k, v in want.items()
    )
    st = Storage(url, opts)
    m = Manifest.from_json(st.read_bytes(step_dirname(3), MANIFEST), url)
    named = {ref[0] for n in m.files if (ref := data_ref(n)) is not None}
    assert len(named) == 2, named  # its own, and step 1's for the frozen tensor
    assert set(st.listdir(DATA)) == named


@pytest.mark.s3
@pytest.mark.parametrize(
    ("key", "what"),
    [
        ("runs//run7", "an empty component ('//')"),
        ("runs/./run7", "a '.' component"),
        ("runs/x/../run7", "a '..' component"),
        ("/runs/run7", "an empty component ('//')"),
    ],
)
def test_an_object_store_key_that_is_not_plain_is_refused(s3_bucket, key, what):
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/{key}"
    model, opt = _model()
    with pytest.raises(ValueError) as e:
        CheckpointManager(url, model=model, optimizer=opt, storage_options=opts)
    msg = str(e.value)
    assert url in msg and what in msg and f"use s3://{bucket}/runs/run7" in msg, msg
    assert Storage(f"s3://{bucket}", opts).walk_files() == {}  # nothing written


@pytest.mark.s3
@pytest.mark.parametrize(
    ("tail", "plain"),
    [
        ("run7?versionId=abc", "run7"),  # s3fs cuts it off every key: the lease went to run7
        ("run7/?versionId=abc", "run7"),
        ("run7#1712", "run7"),  # gcsfs reads a generation there
        ("run*", None),  # fsspec reads a pattern: deleting old steps would match other runs
        ("runs/[ab]/run7", None),
    ],
)
def test_a_key_with_what_the_filesystem_parses_out_is_refused(s3_bucket, tail, plain):
    """A url pasted with a version (``?versionId=``, ``#generation``) or holding a pattern
    character is refused when the manager is made, naming why and the plain url; the
    bucket's other object named like the run is untouched."""
    import s3fs

    bucket, opts = s3_bucket
    fs = s3fs.S3FileSystem(**opts)
    fs.pipe(f"{bucket}/run7", b"another object of the bucket")
    url = f"s3://{bucket}/{tail}"
    model, opt = _model()
    with pytest.raises(ValueError) as e:
        CheckpointManager(url, model=model, optimizer=opt, storage_options=opts)
    msg = str(e.value)
    assert url in msg, msg
    fix = f"use s3://{bucket}/{plain}" if plain else "use a name without '*', '?', '['"
    assert fix in msg, msg
    fs.invalidate_cache()
    assert fs.find(bucket) == [f"{bucket}/run7"]
    assert fs.cat(f"{bucket}/run7") == b"another object of the bucket"


@pytest.mark.parametrize("tail", ["run?", "run*", "r[0]"])
def test_a_pattern_character_in_a_memory_url_is_refused(tail):
    with pytest.raises(ValueError, match=r"pattern of names"):
        Storage(f"memory://bucket/{tail}")


def test_a_key_above_the_bucket_is_refused():
    with pytest.raises(ValueError, match=r"'\.\.' leads above the bucket.*a prefix inside"):
        Storage("memory://bucket/../run7")


@pytest.mark.s3
def test_a_trailing_slash_is_the_plain_url(s3_bucket):
    bucket, opts = s3_bucket
    want = _save_three(f"s3://{bucket}/runs/run7/", opts)
    _check_run(f"s3://{bucket}/runs/run7", opts, want[3])
    keys = Storage(f"s3://{bucket}", opts).walk_files()
    assert keys and all(k.startswith("runs/run7/") for k in keys), sorted(keys)[:5]


@pytest.mark.parametrize("shape", ["a//run7", "a/./run7", "a/run7/", "a/x/../run7"])
def test_a_local_path_of_any_shape_saves_loads_and_collects(tmp_path, shape):
    os.makedirs(tmp_path / "a" / "x")
    url = f"{tmp_path}/{shape}"
    want = _save_three(url, {})
    _check_run(url, {}, want[3])
    _check_run(str(tmp_path / "a" / "run7"), {}, want[3])


def test_a_dot_dot_after_a_linked_directory_is_resolved_where_the_system_does(tmp_path):
    """``x`` links elsewhere: ``a/x/../run7`` is ``elsewhere/run7`` for the operating system.
    The references used to be resolved in the text (``a/run7``): no save committed."""
    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "elsewhere" / "deep")
    os.symlink(tmp_path / "elsewhere" / "deep", tmp_path / "a" / "x")
    url = f"{tmp_path}/a/x/../run7"
    want = _save_three(url, {})
    _check_run(url, {}, want[3])
    _check_run(str(tmp_path / "elsewhere" / "run7"), {}, want[3])
    assert not os.path.exists(tmp_path / "a" / "run7")


def _tree(root: str) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root)
        for f in files
    }


@pytest.mark.parametrize("where", ["step-00000002", "overwrite-step-00000002", "copy", "dcp"])
def test_a_steps_directory_is_refused_as_a_runs_url(tmp_path, where):
    """Run A's step directory (the form ``resume_from`` takes), a name of A's own kind, a
    copy of a step under another name, a plain DCP checkpoint: a manager there would write a
    run inside A's step, which A's retention deletes. Refused when it is made, naming the
    run's url and ``resume_from``; nothing written. A run root named like a step (it holds
    steps) stays a run."""
    import shutil

    from muon_ckpt.store import step_dirname

    a = str(tmp_path / "runA")
    _save_three(a, {})
    url = os.path.join(a, where)
    if where in ("copy", "dcp"):
        url = str(tmp_path / where)
        shutil.copytree(os.path.join(a, step_dirname(3)), url)
        if where == "dcp":
            os.remove(os.path.join(url, MANIFEST))
    before = _tree(str(tmp_path))
    model, opt = _model()
    with pytest.raises(ValueError) as e:
        CheckpointManager(url, model=model, optimizer=opt)
    msg = str(e.value)
    assert f"{url!r} is the directory of " in msg and "not a run" in msg, msg
    if where.endswith("step-00000002"):
        assert f"resume_from=({a!r}, 2)" in msg and f"give its url ({a!r})" in msg, msg
    else:
        assert "(it holds " in msg, msg
    assert _tree(str(tmp_path)) == before
    renamed = str(tmp_path / "step-00000009")  # a run's root may have any name
    os.rename(a, renamed)
    model, opt = _model()
    assert CheckpointManager(renamed, model=model, optimizer=opt).load() == 3
