"""Hugging Face transformers: a ``Trainer`` run with Muon (CPU offload on) saved by
``MuonCkptTrainer``, SIGKILLed after a save and restarted with the same script, ends bitwise
where an uninterrupted run ends: weights, Muon and AdamW state, lr scheduler, global step,
epoch, the losses it logs, the batches it trains after the restart (the Trainer's skip of the
trained batches of the epoch) and the RNG (dropout on: the Trainer's RNG states restored where
it restores its own). A step exported with ``muon-ckpt export --hf`` loads with
``AutoModelForCausalLM.from_pretrained`` into the same model. The job:
tests/integrations/_hf_job.py.
"""

from __future__ import annotations

import shutil
import signal

import pytest
import torch

from muon_ckpt.cli import main
from tests._dist import run_module, run_script

EVERY, STEPS = 3, 10  # as in tests/integrations/_hf_job.py


@pytest.fixture(scope="module")
def hf():
    """transformers, imported by the tests that use it (not at collection: ~6 s)."""
    return pytest.importorskip("transformers")


def _job(url, out, *args):
    r = run_module(["-m", "tests.integrations._hf_job", str(url), str(out), *args], timeout=240)
    return r, (torch.load(out, weights_only=False) if r.returncode == 0 else None)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """What an uninterrupted run ends with."""
    tmp = tmp_path_factory.mktemp("ref")
    r, out = _job(tmp / "run", tmp / "ref.pt")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """``killed(memory)``: the url (and memory tier) of a run SIGKILLed once step 8 was trained
    (``--kill-at 8``; ``memory``: with a memory tier), killed once per module and handed to
    each test as a fresh copy at the same paths (the tier knows its run by its url): the
    tests differ in what they damage and how they resume, not in the run."""
    base = tmp_path_factory.mktemp("killed")

    def get(memory: bool) -> tuple:
        work = base / ("memory" if memory else "plain")
        url, mem, template = work / "run", work / "mem", base / f"{work.name}.killed"
        if not template.exists():
            more = ["--memory", str(mem)] if memory else []
            r, _ = _job(url, base / "killed.pt", "--kill-at", "8", *more)
            assert r.returncode == -signal.SIGKILL, r.stderr
            shutil.copytree(work, template, symlinks=True)
        shutil.rmtree(work)
        shutil.copytree(template, work, symlinks=True)
        return url, str(mem)

    return get


def _same_end(got, ref, resumed):
    """``got`` (a run resumed at step ``resumed``) ends bitwise where ``ref`` ends."""
    assert got["resumed"] == resumed
    assert got["seen"] == ref["seen"][resumed * 4 :]  # the same batches, from the same position
    assert (got["global_step"], got["epoch"]) == (ref["global_step"], ref["epoch"]) == (STEPS, 2)
    assert got["losses"] == ref["losses"] and len(ref["losses"]) == STEPS  # log history too
    assert got["sched"] == ref["sched"]
    assert torch.equal(got["rng"], ref["rng"])
    for name, p in ref["params"].items():
        assert torch.equal(got["params"][name], p), name
        assert ref["states"][name].keys() == got["states"][name].keys(), name
        for k, v in ref["states"][name].items():
            assert torch.equal(got["states"][name][k], v), (name, k)


def test_train_killed_after_a_save_resumes_bitwise(tmp_path, ref, killed):
    url, _ = killed(memory=False)
    assert sorted(p.name for p in url.glob("step-*")) == ["step-00000003", "step-00000006"]
    r, got = _job(url, tmp_path / "resumed.pt")
    assert r.returncode == 0, r.stderr

    assert ref["resumed"] is None
    _same_end(got, ref, 6)  # epoch 1, after its first batch
    assert got["steps"] == ref["steps"] == [9, 10]  # save_total_limit=2


def _flip_a_byte(url, step):
    """One byte flipped in the middle of the largest data file ``step`` wrote (a tensor's)."""
    (data,) = (url / "data").glob(f"{step:08d}-*")
    path = max(data.iterdir(), key=lambda p: p.stat().st_size)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_damaged_newest_step_resumes_the_one_before_and_trains_on(tmp_path, ref, killed):
    url, _ = killed(memory=False)
    _flip_a_byte(url, 6)
    # Every requeued restart used to raise "resume that step explicitly"; now the load falls
    # back to step 3 and the Trainer resumes from step 3's TrainerState.
    r, got = _job(url, tmp_path / "resumed.pt")
    assert r.returncode == 0, r.stderr
    assert "skipping step 6" in r.stderr
    assert (got["began"]["tier"], got["began"]["global_step"]) == ("storage", 3)
    _same_end(got, ref, 3)  # what an uninterrupted run resumed from step 3 ends with
    assert got["steps"] == [9, 10]  # the damaged step 6 went with the rewind


@pytest.mark.parametrize("named", [False, True])
def test_a_memory_step_newer_than_the_urls_resumes_from_memory(tmp_path, ref, killed, named):
    url, mem = killed(memory=True)
    # A crash while step 6 was written to the url: the tier has it, the url does not.
    shutil.rmtree(url / "step-00000006")
    more = ["--resume", "6"] if named else []  # (the url has no step 6 to read its state from)
    r, got = _job(url, tmp_path / "resumed.pt", "--memory", mem, *more)
    assert r.returncode == 0, r.stderr
    assert (got["began"]["tier"], got["began"]["global_step"]) == ("memory", 6)
    _same_end(got, ref, 6)
    assert got["steps"] == [9, 10]


def test_a_run_saved_on_two_ranks_resumes_on_one(tmp_path):
    """DDP over 2 CPU processes (torchrun) saves; a run on 1 process resumes its newest step
    elastically: weights, optimizer, scheduler and TrainerState from the step, each rank's
    RNG states fresh with a WARNING; it trains on to its end."""
    url = tmp_path / "run"
    two = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    r = run_script(
        [*two, "-m", "tests.integrations._hf_job", str(url), str(tmp_path / "two.pt")], timeout=240
    )
    assert r.returncode == 0, r.stderr
    saved = torch.load(tmp_path / "two.pt", weights_only=False)
    assert saved["global_step"] == 6 and saved["steps"] == [3, 6]  # 3 steps an epoch on 2
    r, one = _job(url, tmp_path / "one.pt")
    assert r.returncode == 0, r.stderr
    assert "saved on another number of ranks: each rank's RNG states start fresh" in r.stderr
    assert one["resumed"] == 6 and one["began"]["global_step"] == 6
    for name, p in saved["params"].items():
        assert torch.equal(one["began"]["params"][name], p), name
    assert one["global_step"] == STEPS and one["steps"] == [9, 10]


def test_export_hf_loads_with_from_pretrained_and_a_step_resumes_by_name(tmp_path, hf):
    from tests.integrations._hf_job import trainer_for

    url = str(tmp_path / "run")
    trainer, _ = trainer_for(url, str(tmp_path / "out"))
    trainer.train()
    trained = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    hf_dir = tmp_path / "hf"
    tied = "lm_head.weight=transformer.wte.weight"
    assert main(["export", url, "--hf", str(hf_dir), "--step", str(STEPS), "--tied", tied]) == 0
    trainer.model.config.save_pretrained(hf_dir)  # the user's config.json
    loaded = hf.AutoModelForCausalLM.from_pretrained(hf_dir)
    assert type(loaded) is type(trainer.model)
    got = loaded.state_dict()
    assert got.keys() == trained.keys()
    for k, v in trained.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k

    # A step named the Trainer's way resumes that step (the newer one is retired at the
    # next save); the url itself, or a checkpoint of the Trainer's own beside it, is refused.
    again, _ = trainer_for(url, str(tmp_path / "out"))
    again.train(resume_from_checkpoint=f"{url}/step-{EVERY * 3:08d}")
    assert again.resumed_step == 9 and again.state.global_step == STEPS
    with pytest.raises(ValueError, match="is checkpoint_url itself"):
        trainer_for(url, str(tmp_path / "out"))[0].train(resume_from_checkpoint=url)
    with pytest.raises(ValueError, match="not a step directory"):
        trainer_for(url, str(tmp_path / "out"))[0].train(resume_from_checkpoint=f"{url}/lease")
    with pytest.raises(ValueError, match="has committed steps"):
        trainer_for(url, str(tmp_path / "out"))[0].train(resume_from_checkpoint=str(hf_dir))
    fresh = str(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="has no committed step"):
        trainer_for(fresh, str(tmp_path / "out"))[0].train(resume_from_checkpoint=True)


def test_bad_options_fail_at_construction(tmp_path, hf):
    from tests.integrations._hf_job import trainer_for

    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match=r"\['interval'\].*save_steps"):
        trainer_for(str(tmp_path), out, interval=3)
    with pytest.raises(ValueError, match=r"\['keep_lats'\].*not a CheckpointManager option"):
        trainer_for(str(tmp_path), out, keep_lats=3)
    with pytest.raises(ValueError, match="io_threads"):
        trainer_for(str(tmp_path), out, io_threads=0)


def test_the_core_never_imports_transformers():
    code = (
        "import sys, muon_ckpt, muon_ckpt.integrations\n"
        "from muon_ckpt import CheckpointManager\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'accelerate')))\n"
    )
    r = run_script(["-c", code], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
