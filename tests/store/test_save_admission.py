"""An asynchronous save is admitted from what the catalog knows of the run (``plan_cached``)
with no pass over its steps while ``save()`` blocks: what the decision reads of them
(``_lines.Steps``) is made when the steps change (a scan, a commit, a deletion: in the save's
job), so a run of a thousand steps blocks its saves no longer than a run of two. Pinned by
counting what the admission reads of the steps, never by timing."""

from __future__ import annotations

from muon_ckpt.store import open_storage
from muon_ckpt.store._catalog import Catalog
from muon_ckpt.store._lines import Steps, plan_save
from muon_ckpt.store._steps import COMMITTED, SUPERSEDED, StepInfo


class _Read(StepInfo):
    """A step that counts the reads of its fields (``reads``: all steps' together)."""

    reads = 0

    def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
        if not name.startswith("__"):
            type(self).reads += 1
        return super().__getattribute__(name)


def _run(tmp_path, n: int) -> Catalog:
    """A catalog under the lease that knows ``n`` committed steps (and one superseded)."""
    catalog = Catalog(open_storage(str(tmp_path / f"n{n}")))
    catalog.lease.acquire()
    infos = [_Read(s, f"step-{s:08d}", COMMITTED, gen=s, line="a") for s in range(1, n + 1)]
    infos[0].status = SUPERSEDED
    catalog.known = infos
    return catalog


def test_an_async_saves_admission_reads_no_step_of_a_long_run(tmp_path):
    def admit(catalog: Catalog, step: int) -> int:
        _Read.reads = 0
        plan = catalog.plan_cached(step, overwrite=False, resumed=True, new_run=False, abandon=[])
        assert plan is not None and plan.gen == step
        return _Read.reads

    few, many = admit(_run(tmp_path, 2), 3), admit(_run(tmp_path, 1000), 1001)
    assert many <= few + 10, f"{few} reads of the steps with 2 kept, {many} with 1,000"


def test_the_decision_from_the_cache_is_the_decision_from_the_scan(tmp_path):
    catalog = _run(tmp_path, 50)
    kw = dict(overwrite=False, resumed=True, new_run=False, abandon=[(49, 49), (50, 50)])
    cached = catalog.plan_cached(51, **kw)
    assert cached == plan_save(list(catalog.known), catalog.storage.url, 51, **kw)
    assert cached.gen == 51 and (1, 1) in cached.retires and (50, 50) in cached.retires
    assert isinstance(catalog._steps, Steps)
