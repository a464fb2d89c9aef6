"""Read once (muon_ckpt/load/_read_once.py): a stored item that several ranks load whole is read
from storage by one rank and sent to the others over the process group.

Real processes (gloo), real files: the bytes every rank read from storage
(``last_load_bytes_read``) are summed and compared with the bytes of the step's data files.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from muon_ckpt.store import Storage
from tests._ckpt import biggest_data_file, data_files
from tests._dist import run_on_ranks

ROWS, COLS = 512, 256  # fp32: 512 KiB per matrix


def _data_bytes(step_dir: str) -> int:
    """The bytes of the data files the step's manifest lists (its own directory holds none:
    they are in the run's data)."""
    root, name = os.path.split(step_dir)
    return sum(data_files(Storage(root), int(name[-8:])).values())


def _replicated(fill: float | None, mesh_shape: tuple[int, ...]) -> torch.nn.Module:
    """Plain tensors every rank holds, a Replicate DTensor, and (on a 2-D mesh) a tensor
    sharded over one dimension and replicated over the other, like HSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Module()
    for i in range(3):
        w = torch.randn(ROWS, COLS, generator=g)
        m.register_parameter(f"plain{i}", torch.nn.Parameter(w if fill is None else w * 0 + fill))
    r = torch.randn(ROWS, COLS, generator=g)
    r = r if fill is None else r * 0 + fill
    if len(mesh_shape) == 1:
        m.register_parameter("rep", torch.nn.Parameter(distribute_tensor(r, mesh, [Replicate()])))
    else:
        t = distribute_tensor(r, mesh, [Replicate(), Shard(0)])
        m.register_parameter("hsdp", torch.nn.Parameter(t))
    return m


class _Pos:
    """An ``extra`` object: saved once, loaded by every rank."""

    def __init__(self, epoch: int, seen: torch.Tensor) -> None:
        self.epoch, self.seen = epoch, seen

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "seen": self.seen}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.seen = sd["epoch"], sd["seen"]


def _local(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: getattr(v, "_local_tensor", v).detach().clone() for k, v in m.state_dict().items()}


def _body_save(
    rank: int, world: int, url: str, mesh_shape: tuple[int, ...], opts: dict | None = None
) -> None:
    from muon_ckpt import CheckpointManager

    m = _replicated(None, mesh_shape)
    pos = _Pos(3, torch.arange(4096.0))
    with CheckpointManager(url, model=m, extra={"data": pos}, storage_options=opts) as c:
        c.save(1)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1)
        c.save(2)


def _body_load(
    rank: int,
    world: int,
    url: str,
    mesh_shape: tuple[int, ...],
    verify: str,
    read_once: bool | None = True,
    opts: dict | None = None,
) -> tuple[int, int, dict[str, torch.Tensor], tuple]:
    from muon_ckpt import CheckpointManager

    m = _replicated(-7.0, mesh_shape)
    pos = _Pos(0, torch.zeros(4096))
    kw = {"verify": verify, "read_once": read_once, "storage_options": opts}
    with CheckpointManager(url, model=m, extra={"data": pos}, **kw) as c:
        assert c.load(step=1) == 1
        got = c.last_load_bytes_read
    want = _replicated(None, mesh_shape)
    for k, v in _local(want).items():
        assert torch.equal(_local(m)[k], v), (rank, k)
    return got, rank, _local(m), (pos.epoch, torch.equal(pos.seen, torch.arange(4096.0)))


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory) -> str:
    """Steps 1 and 2 of a replicated model saved on 4 ranks (read only by the tests)."""
    url = str(tmp_path_factory.mktemp("read_once") / "run")
    run_on_ranks(_body_save, 4, url, (4,))
    return url


@pytest.mark.parametrize("verify", ["checksum", "size"])
def test_a_replicated_model_on_4_ranks_reads_each_stored_byte_once(saved_on_4, verify):
    url = saved_on_4
    got = run_on_ranks(_body_load, 4, url, (4,), verify)  # read_once=True
    total = _data_bytes(os.path.join(url, "step-00000001"))
    read = sum(g[0] for g in got)
    # Every stored item is loaded by every rank: all of each data file is read, once.
    assert total <= read <= 1.05 * total, (read, total, [g[0] for g in got])
    assert all(g[3] == (3, True) for g in got), [g[3] for g in got]
    for _, _, sd, _ in got[1:]:  # the same bitwise state on every rank
        assert all(torch.equal(sd[k], got[0][2][k]) for k in sd)


def test_by_default_ranks_on_one_host_read_a_local_checkpoint_themselves(saved_on_4):
    """read_once=None on one host with a local directory: the page cache serves the other
    ranks' reads (faster than gloo, docs/benchmarks.md), so each rank reads what it loads."""
    got = run_on_ranks(_body_load, 4, saved_on_4, (4,), "checksum", None)
    total = _data_bytes(os.path.join(saved_on_4, "step-00000001"))
    assert sum(g[0] for g in got) >= 3.9 * total, ([g[0] for g in got], total)


def test_a_remote_checkpoint_is_read_once_by_default(s3_bucket):
    """On S3 (moto) the default reads each stored byte once: the owner streams its file,
    checking it, and sends the shared items; 2 ranks."""
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    run_on_ranks(_body_save, 2, url, (2,), opts)
    got = run_on_ranks(_body_load, 2, url, (2,), "checksum", None, opts)
    total = sum(data_files(Storage(url, opts), 1).values())
    read = sum(g[0] for g in got)
    assert total <= read <= 1.05 * total, (read, total, [g[0] for g in got])
    assert all(g[3] == (3, True) for g in got)


def test_items_needed_by_some_ranks_go_point_to_point_and_are_read_once(tmp_path):
    """A 2x2 mesh, [Replicate(), Shard(0)]: each stored shard is loaded whole by the 2 ranks of
    its column (sent point to point); the plain tensors by all 4 (a broadcast)."""
    url = str(tmp_path / "run")
    run_on_ranks(_body_save, 4, url, (2, 2))
    got = run_on_ranks(_body_load, 4, url, (2, 2), "checksum")
    total = _data_bytes(os.path.join(url, "step-00000001"))
    read = sum(g[0] for g in got)
    assert total <= read <= 1.05 * total, (read, total, [g[0] for g in got])
    shards = [g[2]["hsdp"] for g in got]
    assert torch.equal(shards[0], shards[2]) and torch.equal(shards[1], shards[3])
    assert not torch.equal(shards[0], shards[1])


def _body_corrupt(rank: int, world: int, url: str) -> tuple[str, bool, int | None]:
    from muon_ckpt import CheckpointCorruptError, CheckpointManager

    m = _replicated(-7.0, (4,))
    before = _local(m)
    pos = _Pos(0, torch.zeros(4096))
    with CheckpointManager(url, model=m, extra={"data": pos}, read_once=True) as c:
        with pytest.raises(CheckpointCorruptError) as e:
            c.load(step=2)
        unchanged = all(torch.equal(v, _local(m)[k]) for k, v in before.items())
        step = c.load()  # falls back to step 1
    want = _replicated(None, (4,))
    assert all(torch.equal(_local(m)[k], v) for k, v in _local(want).items())
    return str(e.value), unchanged, step


def test_a_flipped_byte_in_a_shared_item_fails_every_rank_and_the_load_falls_back(
    saved_on_4, tmp_path
):
    """The rank that reads a shared item for the others finds the corruption; every rank
    raises CheckpointCorruptError before anything is sent, nothing changes, and load()
    falls back to the older step on every rank."""
    url = str(tmp_path / "run")
    shutil.copytree(saved_on_4, url)
    path = Storage(url).path("step-00000002", biggest_data_file(Storage(url), 2))
    name = os.path.basename(path)
    with open(path, "r+b") as f:
        at = os.path.getsize(path) // 2
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    got = run_on_ranks(_body_corrupt, 4, url)
    assert all(unchanged and step == 1 for _, unchanged, step in got), got
    assert any(name in msg for msg, _, _ in got), got
