"""PyTorch Lightning: a ``Trainer.fit`` with Muon (CPU offload on) saved by ``MuonCheckpoint``,
SIGKILLed after a save and restarted with the same script, ends bitwise where an uninterrupted
fit ends: weights, Muon and AdamW state, lr scheduler, global step, epoch, and the batches it
trains after the restart (a resumable dataloader's position). The job:
tests/integrations/_lightning_job.py.
"""

from __future__ import annotations

import signal

import pytest
import torch

from muon_ckpt import MemoryOptions
from tests._dist import run_module, run_script

# As in the job, _lightning_job.py beside this file (imported by the tests that need it).
EVERY, STEPS = 3, 12


@pytest.fixture(scope="module")
def pl():
    """Lightning, imported by the tests that use it (not at collection: ~2 s per worker)."""
    return pytest.importorskip("pytorch_lightning")


def _job(url, out, *args):
    # (DDP on 2 devices: Lightning starts the script again by name, from a fresh interpreter)
    run = run_script if "--devices" in args else run_module
    r = run(["-m", "tests.integrations._lightning_job", str(url), str(out), *args], timeout=240)
    return r, (torch.load(out, weights_only=False) if r.returncode == 0 else None)


def test_fit_killed_after_a_save_resumes_bitwise(tmp_path, pl):
    from tests.integrations import _lightning_job

    assert (_lightning_job.EVERY, _lightning_job.STEPS) == (EVERY, STEPS)
    r, ref = _job(tmp_path / "ref", tmp_path / "ref.pt")
    assert r.returncode == 0, r.stderr
    url = tmp_path / "run"
    r, _ = _job(url, tmp_path / "killed.pt", "--kill-at", "8")
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert sorted(p.name for p in url.glob("step-*")) == ["step-00000003", "step-00000006"]
    r, got = _job(url, tmp_path / "resumed.pt")
    assert r.returncode == 0, r.stderr

    assert got["resumed"] == 6  # the newest committed step: mid-epoch 1, after its first batch
    assert got["seen"] == ref["seen"][6:]  # the same batches, from the same position on
    assert (got["global_step"], got["epoch"]) == (ref["global_step"], ref["epoch"]) == (STEPS, 3)
    assert got["lr"] == ref["lr"] and got["sched"] == ref["sched"]
    assert got["steps"] == ref["steps"] == [9, 12]  # keep_last=2
    for name, p in ref["params"].items():
        assert torch.equal(got["params"][name], p), name
        assert ref["states"][name].keys() == got["states"][name].keys(), name
        for k, v in ref["states"][name].items():
            assert torch.equal(got["states"][name][k], v), (name, k)


def _ref(tmp_path_factory, *flags):
    tmp = tmp_path_factory.mktemp("ref")
    r, out = _job(tmp / "run", tmp / "ref.pt", "--shuffle", *flags)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def shuffled_ref(tmp_path_factory, pl):
    """An uninterrupted fit of the module with dropout over a shuffled loader, its dataset
    adding noise from the global RNG to each sample it fetches (a random augmentation)."""
    return _ref(tmp_path_factory, "--augment")


@pytest.mark.parametrize(
    ("every", "kill_at", "resumed"),
    [(EVERY, 8, 6), (5, 7, 5)],
    ids=["mid-epoch", "at-an-epochs-end"],
)
def test_dropout_a_shuffled_loader_and_augmentation_resume_bitwise(
    tmp_path, shuffled_ref, every, kill_at, resumed
):
    """RNG states in rank_extra and a resumable shuffled loader, as the README says: the
    resumed fit trains on the same batches with the same augmentation noise and dropout
    masks, bitwise, although Lightning makes the loader's iterator (which draws from the
    global RNG) after the load; a callback's NumPy state comes back through
    MuonCheckpoint's blob."""
    _check_resume(tmp_path, shuffled_ref, ("--augment", "--every", str(every)), kill_at, resumed)


def test_a_loader_making_its_iterator_at_its_first_batch_resumes_bitwise(
    tmp_path, tmp_path_factory, pl
):
    """A loader whose ``__iter__`` is a generator draws from the global RNG as its first
    batch is fetched, not when Lightning asks for its iterator: dropout and the shuffled
    order still resume bitwise (a dataset drawing the global RNG then does not:
    docs/integrations.md)."""
    _check_resume(tmp_path, _ref(tmp_path_factory, "--lazy"), ("--lazy",), 8, 6)


def _check_resume(tmp_path, ref, flags, kill_at, resumed):
    url = tmp_path / "run"
    shuffle = ("--shuffle", *flags)
    r, _ = _job(url, tmp_path / "killed.pt", "--kill-at", str(kill_at), *shuffle)
    assert r.returncode == -signal.SIGKILL, r.stderr
    r, got = _job(url, tmp_path / "resumed.pt", *shuffle)
    assert r.returncode == 0, r.stderr

    assert got["resumed"] == resumed
    assert got["seen"] == ref["seen"][resumed:]
    assert [s for s, _ in got["losses"]] == [s for s, _ in ref["losses"][resumed:]]
    for (step, a), (_, b) in zip(got["losses"], ref["losses"][resumed:], strict=True):
        assert torch.equal(a, b), step
    assert got["counter"] == ref["counter"] and ref["counter"][0] == STEPS
    assert (got["global_step"], got["epoch"]) == (ref["global_step"], ref["epoch"])
    assert got["sched"] == ref["sched"]
    for name, p in ref["params"].items():
        assert torch.equal(got["params"][name], p), name
        for k, v in ref["states"][name].items():
            assert torch.equal(got["states"][name][k], v), (name, k)


def test_a_fit_saved_on_two_ranks_resumes_on_one(tmp_path, pl):
    """DDP over 2 CPU processes saves; a fit on 1 process resumes that step elastically:
    weights, optimizer, loops and scheduler from the step, each rank's own state (callbacks,
    dataloader position) fresh, with a WARNING; it trains on to its end."""
    url = tmp_path / "run"
    r, two = _job(url, tmp_path / "two.pt", "--devices", "2", "--steps", str(2 * EVERY))
    assert r.returncode == 0, r.stderr
    from muon_ckpt import CheckpointManager

    info = CheckpointManager(str(url)).step_info()
    assert (info.step, info.world_size) == (2 * EVERY, 2)
    r, one = _job(url, tmp_path / "one.pt")
    assert r.returncode == 0, r.stderr
    assert "saved on another number of ranks" in r.stderr
    assert one["resumed"] == 2 * EVERY and one["began"]["global_step"] == 2 * EVERY
    for name, p in two["params"].items():  # the weights the two ranks ended with
        assert torch.equal(one["began"]["params"][name], p), name
    assert one["global_step"] == STEPS and one["steps"] == [3 * EVERY, STEPS]


def _trainer(pl, ckpt, steps):
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_ckpt_path_at_a_muon_url_fails_naming_what_to_use(tmp_path, pl):
    from muon_ckpt.integrations.lightning import MuonCheckpoint
    from tests.integrations._lightning_job import Net, ResumableLoader, data

    torch.manual_seed(0)
    url = str(tmp_path / "run")
    ckpt = MuonCheckpoint(url, every_n_train_steps=EVERY)
    trainer = _trainer(pl, ckpt, EVERY)
    trainer.fit(Net(offload=True), ResumableLoader(data()))
    assert ckpt.manager is None and ckpt.resumed_step is None  # closed at the end of the fit
    for path in (url, f"{url}/step-00000003"):
        again = MuonCheckpoint(url, every_n_train_steps=EVERY)
        with pytest.raises(ValueError, match=r"Leave ckpt_path out.*resumes its url's newest"):
            _trainer(pl, again, 2 * EVERY).fit(Net(True), ResumableLoader(data()), ckpt_path=path)
    # Resuming through the callback alone works, with offload on; the fit goes on to its end.
    again = MuonCheckpoint(url, every_n_train_steps=EVERY)
    trainer = _trainer(pl, again, 2 * EVERY)
    trainer.fit(Net(offload=True), ResumableLoader(data()))
    assert again.resumed_step == EVERY and trainer.global_step == 2 * EVERY
    # Once more: nothing left to train (Lightning's fit loop returns before its first batch).
    again = MuonCheckpoint(url, every_n_train_steps=EVERY)
    _trainer(pl, again, 2 * EVERY).fit(Net(offload=True), ResumableLoader(data()))
    assert again.resumed_step == 2 * EVERY and again.manager is None

    # A Lightning checkpoint of its own (offload off) while the url has steps: refused.
    lightning_ckpt = str(tmp_path / "plain.ckpt")
    assert not trainer.optimizers[0].cpu_offload  # turned off for Lightning's teardown
    trainer.save_checkpoint(lightning_ckpt)
    again = MuonCheckpoint(url, every_n_train_steps=EVERY)
    with pytest.raises(ValueError, match="would both restore this fit"):
        _trainer(pl, again, 3 * EVERY).fit(
            Net(offload=False), ResumableLoader(data()), ckpt_path=lightning_ckpt
        )


def test_bad_options_fail_at_construction(tmp_path, pl):
    from muon_ckpt.integrations.lightning import MuonCheckpoint

    with pytest.raises(ValueError, match=r"\['interval'\].*every_n_train_steps"):
        MuonCheckpoint(str(tmp_path), interval=3)
    with pytest.raises(ValueError, match=r"\['keep_lats'\]") as ei:
        MuonCheckpoint(str(tmp_path), keep_lats=3)
    assert "'memory'" in str(ei.value) and "deprecated" not in str(ei.value)
    # A new callback takes the options' 0.3 spelling only.
    with pytest.raises(ValueError, match=r"\['memory_interval'\]"):
        MuonCheckpoint(str(tmp_path), memory_interval=1)
    memory = MemoryOptions(interval=1, dir=str(tmp_path / "mem"))
    assert (
        MuonCheckpoint(str(tmp_path), memory=memory, async_save="deferred")._options["memory"]
        is memory
    )
    with pytest.raises(ValueError, match="keep_last"):
        MuonCheckpoint(str(tmp_path), keep_last=0)
    with pytest.raises(ValueError, match="'lightning' is MuonCheckpoint's own"):
        MuonCheckpoint(str(tmp_path), extra={"lightning": torch.optim.SGD([torch.zeros(1)])})


def test_the_core_never_imports_lightning():
    code = (
        "import sys, muon_ckpt, muon_ckpt.integrations\n"
        "from muon_ckpt import CheckpointManager\n"
        "print(sorted(m for m in sys.modules if 'lightning' in m))\n"
    )
    r = run_script(["-c", code], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
