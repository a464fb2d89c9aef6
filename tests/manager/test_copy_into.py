"""``copy_into``: the backup copy of a load (``Rollback.keep``). One ``memmove`` between
contiguous CPU tensors of one dtype and shape, ``copy_`` for everything else; bitwise the
same as ``copy_`` either way."""

import pytest
import torch

from muon_ckpt._tensors import copy_into


def _cases():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 48, generator=g)
    yield "contiguous", torch.empty_like(a), a
    yield "bf16", torch.empty(64, 48, dtype=torch.bfloat16), a.bfloat16()
    yield "strided source", torch.empty(48, 64), a.t()
    yield "strided target", torch.empty(48, 64).t(), a
    yield "cast", torch.empty(64, 48, dtype=torch.float64), a
    yield "broadcast", torch.empty(64, 48), a[:1]
    yield (
        "conjugate",
        torch.empty(8, dtype=torch.complex64),
        torch.randn(8, dtype=torch.complex64).conj(),
    )
    yield (
        "negative view",
        torch.empty(8, dtype=torch.complex64),
        torch.randn(8, dtype=torch.complex64).conj().imag,
    )
    yield "negative target", torch.zeros(8, dtype=torch.complex64).conj().imag, torch.randn(8)
    yield "parameter", torch.nn.Parameter(torch.empty(64, 48), requires_grad=False), a
    yield "empty", torch.empty(0), torch.empty(0)
    sparse = torch.randn(6, 6, generator=g).relu().to_sparse()
    yield "sparse", torch.empty(6, 6).to_sparse(), sparse
    yield "scalar", torch.empty(()), torch.tensor(3.5)


def _bits(t):
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


@pytest.mark.parametrize("name,dst,src", list(_cases()), ids=[c[0] for c in _cases()])
def test_copy_into_is_copy_(name, dst, src):
    want = dst.clone().copy_(src)
    layout = dst.stride()
    version = dst._version
    copy_into(dst, src)
    assert dst._version > version or dst.numel() == 0 or name == "sparse"  # as copy_ does
    assert dst.dtype == want.dtype and dst.stride() == layout
    assert torch.equal(_bits(dst), _bits(want)), name


def test_a_wrapper_subclass_takes_copy_():
    """A DTensor's data_ptr is 0: a memmove there would crash the process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        src = torch.randn(8, 4)
        dst = distribute_tensor(torch.zeros(8, 4), mesh, [Replicate()])
        copy_into(dst, distribute_tensor(src, mesh, [Replicate()]))
        assert torch.equal(dst.to_local(), src)
    finally:
        dist.destroy_process_group()


def test_a_load_target_is_an_in_place_write_for_autograd():
    """A backward through a value copied over by copy_into fails as it would after copy_."""
    w = torch.nn.Parameter(torch.randn(4, 4))
    y = (w * w).sum()
    copy_into(w.detach(), torch.randn(4, 4))
    with pytest.raises(RuntimeError, match="inplace operation"):
        y.backward()
