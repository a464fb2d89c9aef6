"""The keywords of before 0.3 still work until 0.4 (docs/changelog.md): each one used is one
DeprecationWarning, pointing at the caller's line and naming the new spelling, and the manager
is configured as with the new spelling; an option given in both spellings is a TypeError; the
old spellings' own errors stay. The only module of the suite that may use them (pyproject.toml
makes their warning an error everywhere else)."""

from __future__ import annotations

import warnings

import pytest

from muon_ckpt import CheckpointManager, MemoryOptions
from tests._ckpt import train
from tests._memtier import _assert_same, _fresh, _state

pytestmark = pytest.mark.filterwarnings(r"default:CheckpointManager\(:DeprecationWarning")


def _old(tmp_path, **kw):
    """A manager made with ``kw``, and the DeprecationWarnings that made it."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        mgr = CheckpointManager(str(tmp_path / "run"), **kw)
    assert all(w.category is DeprecationWarning for w in got), got
    assert all(w.filename == __file__ for w in got), [w.filename for w in got]  # the caller
    return mgr, [str(w.message) for w in got]


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        ({"memory_interval": 4}, {"interval": 4}, "pass memory=MemoryOptions(interval=4)"),
        ({"memory_dir": "DIR"}, {"dir": "DIR"}, "pass memory=MemoryOptions(dir='DIR')"),
        ({"replicas": 0}, {"replicas": 0}, "pass memory=MemoryOptions(replicas=0)"),
        ({"node_size": 8}, {"node_size": 8}, "pass memory=MemoryOptions(node_size=8)"),
        ({"memory_keep": 2}, {"keep": 2}, "pass memory=MemoryOptions(keep=2)"),
        ({"memory_flush": False}, {"flush": False}, "pass memory=MemoryOptions(flush=False)"),
    ],
)
def test_each_old_memory_keyword_warns_once_and_configures_the_same_tier(tmp_path, old, new, says):
    old = {k: str(tmp_path / v) if k == "memory_dir" else v for k, v in old.items()}
    new = {k: str(tmp_path / v) if k == "dir" else v for k, v in new.items()}
    says = says.replace("'DIR'", repr(str(tmp_path / "DIR")))
    base = {} if "memory_interval" in old else {"memory_interval": 1}
    mgr, msgs = _old(tmp_path, **base, **old)
    (name,) = old
    ours = [m for m in msgs if m.startswith(f"CheckpointManager({name}=")]
    assert len(ours) == 1 and len(msgs) == 1 + len(base), msgs
    assert f"{name} is deprecated since muon-ckpt 0.3 and removed in 0.4; {says}" in ours[0]
    want = MemoryOptions(**{"interval": 1, **new})
    assert mgr.config.memory == want
    mgr.close()


def test_old_memory_keywords_without_an_interval_leave_the_tier_off(tmp_path):
    mgr, msgs = _old(tmp_path, memory_keep=3, replicas=2)
    assert mgr.config.memory is None and mgr._saves.memory is None and len(msgs) == 2
    mgr, msgs = _old(tmp_path, memory_interval=None)
    assert mgr.config.memory is None and len(msgs) == 1
    assert msgs[0].endswith("; pass memory=None"), msgs


def test_a_bad_old_memory_value_is_refused_even_with_the_tier_off(tmp_path):
    """As before 0.3: ``replicas=-1`` was a ValueError although no tier was asked for."""
    refused = pytest.raises(ValueError, match=r"MemoryOptions\.replicas must be an int >= 0")
    with pytest.warns(DeprecationWarning, match=r"replicas is deprecated"), refused:
        CheckpointManager(str(tmp_path / "run"), replicas=-1)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"MemoryOptions\.dir"):
        CheckpointManager(str(tmp_path / "run"), memory_dir="s3://bucket/tier")


@pytest.mark.parametrize(
    ("async_save", "snapshot", "want", "says"),
    [
        (True, "deferred", "deferred", 'pass async_save="deferred"'),
        (True, "blocking", True, "pass nothing: async_save=True takes a blocking snapshot"),
        (False, "blocking", False, "pass nothing"),
    ],
)
def test_snapshot_folds_into_async_save(tmp_path, async_save, snapshot, want, says):
    model, opt = _fresh()
    mgr, msgs = _old(tmp_path, model=model, optimizer=opt, async_save=async_save, snapshot=snapshot)
    assert mgr.config.async_save == want and mgr.config.deferred == (want == "deferred")
    assert len(msgs) == 1 and msgs[0].startswith(f"CheckpointManager(snapshot={snapshot!r})")
    assert says in msgs[0]
    mgr.close()


def test_a_deferred_save_asked_for_the_old_way_holds_the_state_of_the_save_call(tmp_path):
    """The old spelling drives a real deferred save: the next step runs at once, and the step
    loads back bitwise as it was at ``save()``."""
    model, opt = _fresh()
    train(model, opt, 1)
    mgr, _ = _old(tmp_path, model=model, optimizer=opt, async_save=True, snapshot="deferred")
    assert mgr._sources.deferred and mgr._hook is not None
    want = _state(model, opt)
    assert mgr.save(1)
    train(model, opt, 1, seed=1)  # waits for the save's copies, then changes the state
    assert mgr.wait() == 1
    mgr.close()
    model2, opt2 = _fresh(seed=1)
    with CheckpointManager(str(tmp_path / "run"), model=model2, optimizer=opt2) as mgr2:
        assert mgr2.load() == 1
    _assert_same(want, _state(model2, opt2))


def test_the_old_snapshot_errors_stay(tmp_path):
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="needs async_save=True"):
        CheckpointManager(str(tmp_path / "a"), snapshot="deferred")
    with pytest.raises(ValueError, match=r"snapshot must be one of .*async_save="):
        CheckpointManager(str(tmp_path / "c"), snapshot="lazy")


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"memory_keep": 2}, r"both memory= and memory_keep="),
        (
            {"memory_interval": 1, "memory_dir": "d"},
            r"both memory= and memory_interval=, memory_dir=",
        ),
        (
            {"async_save": "deferred", "snapshot": "deferred"},
            r'both async_save="deferred" and snapshot=',
        ),
        (
            {"async_save": "deferred", "snapshot": "blocking"},
            r'both async_save="deferred" and snapshot=',
        ),
    ],
)
def test_one_option_in_both_spellings_is_a_type_error(tmp_path, kw, says):
    if "async_save" not in kw:
        kw = {**kw, "memory": MemoryOptions(interval=1, dir=str(tmp_path / "mem"))}
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match=says):
            CheckpointManager(str(tmp_path / "run"), **kw)
    assert got == []  # refused before anything warns
    assert not (tmp_path / "run").exists()


def test_a_run_configured_the_old_way_saves_and_restores_from_memory(tmp_path):
    """Not only the config: the old keywords drive a real memory save and restore."""
    kw = {"interval": 5, "memory_interval": 1, "memory_dir": str(tmp_path / "mem")}
    model, opt = _fresh()
    mgr, _ = _old(tmp_path, model=model, optimizer=opt, **kw)
    mgr.load()
    for s in (5, 6):  # 5: url and memory; 6: memory only
        mgr.save(s)
        mgr.wait()
    want = _state(model, opt)
    mgr._saves.memory.mark = None  # (keep step 6 in memory only)
    mgr.close()
    model2, opt2 = _fresh(seed=1)
    mgr2, msgs = _old(tmp_path, model=model2, optimizer=opt2, memory_flush=False, **kw)
    assert len(msgs) == 3
    assert mgr2.load() == 6 and mgr2.last_load_tier == "memory"
    _assert_same(want, _state(model2, opt2))
    mgr2.close()
