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
    copy_into(dst, src)
    assert dst.dtype == want.dtype and dst.stride() == layout
    assert torch.equal(_bits(dst), _bits(want)), name
