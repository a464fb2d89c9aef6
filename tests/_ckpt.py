"""Test helpers: write checkpoints in muon-ckpt's layout with plain DCP (no CheckpointManager),
and small Muon/AdamW setups trained for a few steps.

``write_step`` is what a committed step looks like on storage: DCP files, then
``manifest.json`` (sizes and crc32 of every file) written last.
"""

from __future__ import annotations

import datetime
import zlib
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from muon_ckpt.store import MANIFEST, FileEntry, Manifest, Storage, step_dirname


def flip_byte(path: str, at: int, mask: int = 0x01) -> None:
    """Corrupt one byte of a local file in place (XOR with ``mask``)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


def file_layout(path: str, offset: int = 0, length: int | None = None) -> Any:
    """The layout the local reader parses for the stored item at ``[offset, offset + length)``
    of ``path`` (the whole file without ``length``), or None."""
    import os

    from muon_ckpt.load import _local_files

    def pread(fd: int, mv: memoryview, at: int) -> None:
        assert os.preadv(fd, [mv], at) == len(mv)

    fd = os.open(path, os.O_RDONLY)
    try:
        n = os.fstat(fd).st_size - offset if length is None else length
        return _local_files.item_layout(_local_files.Edges(fd, offset, n, pread))
    finally:
        os.close(fd)


def write_step(
    url: str,
    step: int,
    state_dict: dict[str, Any],
    *,
    storage_options: dict[str, Any] | None = None,
    commit: bool = True,
) -> str:
    """dcp.save ``state_dict`` to ``<url>/step-XXXXXXXX`` in one process; then the manifest."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    storage = Storage(url, storage_options)
    name = step_dirname(step)
    if storage.is_local:
        writer = dcp.FileSystemWriter(storage.path(name))
    else:
        writer = FsspecWriter(storage.url_of(name), **(storage_options or {}))
    dcp.save(state_dict, storage_writer=writer, no_dist=True)
    if commit:
        files = {}
        for rel in storage.walk_files(name):
            data = storage.read_bytes(name, rel)
            files[rel] = FileEntry(len(data), f"{zlib.crc32(data) & 0xFFFFFFFF:08x}")
        m = Manifest(
            step=step,
            world_size=1,
            files=files,
            time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            torch_version=torch.__version__,
            muon_ckpt_version="test",
        )
        storage.write_bytes(m.to_json(), name, MANIFEST)
    return storage.url_of(name)


def data_files(storage: Storage, step: int, dirname: str | None = None) -> dict[str, int]:
    """Name -> size of the data files (``*.distcp``) the manifest of ``step`` lists, named
    from its step directory (``dirname``, default its own): ``../data/<dir>/<file>`` in
    format 3, plain names in format 2. ``storage.read_bytes(dirname, name)`` reads one."""
    name = dirname or step_dirname(step)
    m = Manifest.from_json(storage.read_bytes(name, MANIFEST), storage.url_of(name))
    return {n: e.size for n, e in m.files.items() if n.endswith(".distcp")}


def biggest_data_file(storage: Storage, step: int) -> str:
    sizes = data_files(storage, step)
    return max(sizes, key=lambda n: (sizes[n], n))


def three_step_run(
    url: str, opts: dict[str, Any], *, leftover: bool = False, dedup: bool = True
) -> dict[str, Any]:
    """Committed steps 1, 2, 3 saved by the CheckpointManager (TinyNet + Muon), with
    ``leftover`` also an uncommitted step 4; returns url, opts, CLI flags and the Storage.
    ``dedup=False``: steps of format 2, each self-contained in its directory."""
    import json

    from muon_ckpt import CheckpointManager

    torch.manual_seed(0)
    model = TinyNet()
    opt = make_muon(model)
    with CheckpointManager(
        url, model=model, optimizer=opt, storage_options=opts, dedup=dedup
    ) as mgr:
        for step in (1, 2, 3):
            train(model, opt, 1, seed=step)
            mgr.save(step)
    if leftover:
        write_step(url, 4, muon_state_sd(model, opt), storage_options=opts, commit=False)
    flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
    return {"url": url, "opts": opts, "flags": flags, "storage": Storage(url, opts)}


class TinyNet(nn.Module):
    """Two matrices (Muon), an embedding, a norm and biases (AdamW)."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, 12)
        self.fc2 = nn.Linear(12, dim, bias=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return self.norm(h + self.fc2(torch.relu(self.fc1(h))))


def is_matrix(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and not name.startswith("emb")


def make_muon(model: nn.Module, **kw: Any) -> Any:
    from optim import Muon

    mats = [(n, p) for n, p in model.named_parameters() if is_matrix(n, p)]
    rest = [(n, p) for n, p in model.named_parameters() if not is_matrix(n, p)]
    return Muon(
        [
            {"params": [p for _, p in mats], "names": [n for n, _ in mats], "lr": 0.02},
            {
                "params": [p for _, p in rest],
                "names": [n for n, _ in rest],
                "use_muon": False,
                "lr": 1e-3,
                "weight_decay": 0.01,
            },
        ],
        **kw,
    )


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 11, (4, 5), generator=g)
        model(idx).square().mean().backward()
        opt.step()
        opt.zero_grad()


def muon_state_sd(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """muon-ckpt keys of the model and optimizer state (what the manager saves)."""
    names = {id(p): n for n, p in model.named_parameters()}
    sd: dict[str, Any] = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            sd[f"optim.state.{names[id(p)]}.{k}"] = v.clone()
    for g in opt.param_groups:
        for p in g["params"]:
            sd[f"optim.param_groups.{names[id(p)]}.lr"] = g["lr"]
    return sd


def offload_off(opt: Any, read: Any) -> Any:
    """``read()`` with the optimizer's CPU offload off (offloaded states are not device
    tensors), then back on if it was."""
    on = opt.cpu_offload
    if on:
        opt.turn_off_cpu_offload()
    try:
        return read()
    finally:
        if on:
            opt.turn_on_cpu_offload()
