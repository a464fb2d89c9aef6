"""A training script on a 2-D mesh with torch's own APIs (``fully_shard`` over HSDP 2x2;
``parallelize_module`` then ``fully_shard``, TP 2 x FSDP 2), Muon with CPU offload on and an
asynchronous save after every step, SIGKILLed on every rank once a step is committed (the
next one being written in the background), then restarted on the same layout: it resumes the
newest committed step and ends bitwise where the uninterrupted run ends, every param and
optimizer state (Muon's momentum, AdamW's moments and step) on every rank. The job:
tests/manager/_mesh_resume_job.py."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_on_ranks, run_then_kill
from tests.manager._mesh_resume_job import committed, killed, uninterrupted_then_resumed

STEPS, KILL_AFTER = 4, 2  # killed once step 2 is committed, step 3 in flight


@pytest.mark.parametrize("layout", ["hsdp2x2", "tp2xfsdp2"])
def test_a_run_killed_after_a_committed_step_resumes_bitwise(tmp_path, layout):
    url, ref_url = str(tmp_path / "run"), str(tmp_path / "ref")
    progress = str(tmp_path / "progress.txt")
    run_then_kill(
        killed,
        4,
        url,
        layout,
        STEPS,
        KILL_AFTER + 1,
        progress,
        timeout=300,
        kill_when=lambda: committed(progress) >= KILL_AFTER,
    )
    results = run_on_ranks(uninterrupted_then_resumed, 4, ref_url, url, layout, STEPS, timeout=300)
    for rank, res in enumerate(results):
        ref, got = res["ref"], res["got"]
        assert ref["resumed"] is None and got["resumed"] in (KILL_AFTER, KILL_AFTER + 1), rank
        # The resumed step's manifest holds the layout it was saved on (here, the same one).
        assert len(got["layout"]["meshes"]) >= 1 and got["layout"]["params"], got["layout"]
        assert ref["state"].keys() == got["state"].keys(), rank
        assert any(k.endswith(".momentum_buffer") for k in ref["state"])
        assert any(k.endswith(".moment2") for k in ref["state"])
        for k, v in ref["state"].items():
            assert torch.equal(got["state"][k], v), (rank, k)
