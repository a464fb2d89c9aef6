"""Reading or writing an optimizer state while CPU offload parks it never kills the process:
every use of it as a tensor raises OffloadedStateError naming the param and the state and
saying where its value can be read (``optimizer.cpu_state(param)``), in a process of its own
(a segmentation fault would be exit code -11) and on 2 ranks with DTensor states. The seed
test's view of a parked state holds: the same object, a storage of 0 bytes, its byte count
in the pool under its ``id``."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

from tests import REPO
from tests._dist import dist_device, run_on_ranks

_USES = {
    "norm": lambda t: t.norm(),
    "add": lambda t: t + 1,
    "index": lambda t: t[0],
    "clone": lambda t: t.clone(),
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.tolist(),
    "zero_": lambda t: t.zero_(),
    "copy_": lambda t: t.copy_(torch.ones(t.shape)),
    "deepcopy": lambda t: __import__("copy").deepcopy(t),
    "save": lambda t: torch.save(t, __import__("io").BytesIO()),
    "torch.add": lambda t: torch.add(torch.zeros(t.shape), t),
    "data": lambda t: t.data,
    "bool": lambda t: bool(t.any()),
}


def _probe(opt, params) -> dict[str, str]:
    """Every use of every parked state: 'ok' when it raised the documented error."""
    from offload import OffloadedStateError

    out = {}
    for p in params:
        for key, t in opt.state[p].items():
            if key == "step":
                continue
            for name, use in _USES.items():
                try:
                    use(t)
                    out[f"{key}.{name}"] = "did not raise"
                except OffloadedStateError as e:
                    msg = str(e)
                    ok = f"Muon state {key!r} of param" in msg and "cpu_state(param)" in msg
                    out[f"{key}.{name}"] = "ok" if ok else msg
    return out


_SCRIPT = """
import torch
from optim import Muon
from tests.offload.test_offloaded_state_access import _probe
torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(8, 4))
b = torch.nn.Parameter(torch.randn(4))
opt = Muon([{"params": [w], "names": ["layer.w"]},
            {"params": [b], "use_muon": False, "names": ["layer.b"]}])
opt.turn_on_cpu_offload()
for _ in range(2):
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    opt.step()
m = opt.state[w]["momentum_buffer"]
assert m.untyped_storage().size() == 0 and m.shape == (8, 4) and m.dtype == torch.float32
assert opt._cpu_offload_pool._storage_nbytes[id(m)] == 8 * 4 * 4
res = _probe(opt, [w, b])
bad = {k: v for k, v in res.items() if v != "ok"}
assert not bad, bad
assert "'layer.w'" in repr(m) and "cpu_state(param)" in repr(m)
norm = opt.cpu_state(w)["momentum_buffer"].norm()
opt.cpu_state(b)["moment1"].fill_(0.5)  # writing the view sets the value the step uses
opt.turn_off_cpu_offload()
assert torch.equal(m.norm(), norm) and bool((opt.state[b]["moment1"] == 0.5).all())
print("probed", len(res))
"""


def test_using_an_offloaded_state_raises_in_its_own_process():
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert f"probed {3 * len(_USES)}" in r.stdout


def _body_dtensor(rank: int, world_size: int) -> dict[str, str]:
    from optim import Muon

    dev = dist_device()
    mesh = init_device_mesh(dev.type, (world_size,))
    torch.manual_seed(0)
    # 5 rows on 2 ranks: uneven shards.
    w = torch.nn.Parameter(distribute_tensor(torch.randn(5, 4, device=dev), mesh, [Shard(0)]))
    b = torch.nn.Parameter(distribute_tensor(torch.randn(5, device=dev), mesh, [Shard(0)]))
    opt = Muon(
        [
            {"params": [w], "names": ["layer.w"]},
            {"params": [b], "use_muon": False, "names": ["layer.b"]},
        ]
    )
    opt.turn_on_cpu_offload()
    for _ in range(2):
        w.grad = distribute_tensor(torch.randn(5, 4, device=dev), mesh, [Shard(0)])
        b.grad = distribute_tensor(torch.randn(5, device=dev), mesh, [Shard(0)])
        opt.step()
    m = opt.state[w]["momentum_buffer"]
    assert isinstance(m, DTensor) and m._local_tensor.untyped_storage().size() == 0
    assert opt._cpu_offload_pool._storage_nbytes[id(m)] == m._local_tensor.numel() * 4
    res = _probe(opt, [w, b])
    for name, use in {"full_tensor": lambda t: t.full_tensor(), "to_local": None}.items():
        try:
            if use is None:
                m.to_local().norm()
            else:
                use(m)
            res[name] = "did not raise"
        except Exception as e:
            res[name] = "ok" if "cpu_state(param)" in str(e) else repr(e)
    view = opt.cpu_state(w)["momentum_buffer"]
    assert isinstance(view, DTensor) and view.to_local().device.type == "cpu"
    view.to_local().norm()  # the value is there
    w2 = dist.all_reduce(torch.zeros(1, device=dev), async_op=True)
    w2.wait()
    return res


def test_using_an_offloaded_dtensor_state_raises_on_2_ranks():
    for res in run_on_ranks(_body_dtensor, 2):
        bad = {k: v for k, v in res.items() if v != "ok"}
        assert not bad, bad
        assert len(res) == 3 * len(_USES) + 2
