"""``muon-ckpt demo``: train a small transformer with Muon under FSDP2, SIGKILL it mid-run,
resume from the newest committed checkpoint, and check the result bitwise against an
uninterrupted run. ``_driver`` launches the phases, ``_worker`` is one rank, ``_model`` the
model and its deterministic data."""

from muon_ckpt.demo._driver import DemoOptions, compare_runs, run_demo

__all__ = ["DemoOptions", "compare_runs", "run_demo"]
