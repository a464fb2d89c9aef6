"""A property over randomly crafted steps: a tensor stored in a random grid of chunks,
then changed in random ways (a chunk dropped, extended over its neighbour or placed outside
the tensor; the declared shape or dtype changed; an item holding another shape or dtype; an
item whose record is deflated or whose zip entries overlap; an object item that inflates;
every item compressed (store._codec), one compressed item that expands far beyond its chunk,
one that lies about what it holds or is stored with a transform muon-ckpt does not read).
Every command (load, import, export, inspect) either gives exactly the stored values or raises
CheckpointCorruptError (or, for a declared dtype other than the target's, the
CheckpointMismatchError a load reports before reading), and none adds more than MEMORY_BOUND to the process's peak resident
memory, whatever the crafted items would expand to (INFLATED). Seeded; CASES cases."""

from __future__ import annotations

import io
import itertools
import random
import shutil
from typing import Any

import pytest
import torch

from muon_ckpt import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointMismatchError,
    export_safetensors,
    import_optimizer_state,
)
from muon_ckpt.cli import main
from muon_ckpt.interop._safetensors import SafetensorsFile
from muon_ckpt.store import Storage
from muon_ckpt.store.codec import DESCRIPTOR
from tests._ckpt import TinyNet, make_muon, three_step_run
from tests._crafted import (
    MiB,
    StepEditor,
    assert_verify_agrees,
    bomb_item,
    compressed,
    compressed_bomb,
    craft_step,
    peak_growth,
    saved,
)

CASES = 24
SEED = 31
MEMORY_BOUND = 64 * MiB  # peak resident memory one command may add (the steps are < 2 MiB)
INFLATED = 256 * MiB  # what a crafted item expands to in an unchecked torch.load

KEY = "optim.state.fc1.weight.momentum_buffer"  # [12, 8] float32: load, import, export
LR = "optim.param_groups.fc1.weight.lr"  # an object: load, export, inspect
CHANGES = (
    "drop",
    "extend",
    "outside",
    "declare_rows",
    "declare_dtype",
    "store_shape",
    "store_dtype",
    "deflated",
    "overlapping",
    "object_bomb",
    "compressed",
    "compressed_bomb",
    "compressed_lie",
)
LIES = ("frame_size", "crc", "magic", "truncated", "dcp_zstd", "object")


@pytest.fixture(scope="module")
def template(tmp_path_factory: Any) -> str:
    return three_step_run(str(tmp_path_factory.mktemp("template") / "run"), {})["url"]


def _grid(rng: random.Random, v: torch.Tensor) -> list[list[Any]]:
    """A random grid of chunks of ``v``: [offsets, sizes, stored tensor] each."""
    rows = sorted({0, v.shape[0], *rng.sample(range(1, v.shape[0]), rng.randint(0, 4))})
    cols = sorted({0, v.shape[1], *rng.sample(range(1, v.shape[1]), rng.randint(0, 2))})
    return [
        [[r0, c0], [r1 - r0, c1 - c0], v[r0:r1, c0:c1].clone()]
        for r0, r1 in itertools.pairwise(rows)
        for c0, c1 in itertools.pairwise(cols)
    ]


def _craft(rng: random.Random, ed: StepEditor, changes: list[str]) -> torch.Tensor:
    """Store KEY in a random grid with ``changes`` applied; returns its true values."""
    v = torch.load(io.BytesIO(ed.stored(KEY)), weights_only=True)
    pieces = _grid(rng, v)
    size, dtype = list(v.shape), None
    raw: dict[int, bytes] = {}  # piece -> crafted item bytes
    enc: dict[int, tuple[bytes, list[str]]] = {}  # piece -> crafted item and its transforms
    pack = False  # every other item compressed, as a save with compression="zstd" does
    for change in changes:
        i = rng.randrange(len(pieces))
        (r, c), (h, w), t = pieces[i]
        if change == "drop" and len(pieces) > 1:
            pieces.pop(i)
            raw, enc = {}, {}
        elif change == "compressed":
            pack = True
        elif change == "compressed_bomb":
            enc[i] = (compressed_bomb(INFLATED // (4 * MiB)), [DESCRIPTOR])
        elif change == "compressed_lie":
            enc[i] = _lie(rng, ed, saved(t))
        elif change == "extend" and r + h < v.shape[0]:
            pieces[i] = [[r, c], [h + 1, w], v[r : r + h + 1, c : c + w].clone()]
        elif change == "outside":
            pieces.append([[v.shape[0], 0], [rng.randint(1, 4), v.shape[1]], v[:1].clone()])
        elif change == "declare_rows":
            size[0] += rng.choice([1, 5, 4096])
        elif change == "declare_dtype":
            dtype = rng.choice([torch.float64, torch.float16, torch.int32])
        elif change == "store_shape":
            raw[i] = saved(rng.choice([t.t().contiguous(), torch.cat([t, t]), t.reshape(-1)]))
        elif change == "store_dtype":
            raw[i] = saved(t.to(rng.choice([torch.float64, torch.bfloat16])))
        elif change in ("deflated", "overlapping"):
            deflate = change == "deflated"
            aliases = 0 if deflate else INFLATED // MiB
            raw[i] = bomb_item(t, INFLATED if deflate else MiB, deflate=deflate, aliases=aliases)
        elif change == "object_bomb":
            ed.replace_item(LR, bomb_item(torch.tensor([0.02]), INFLATED, deflate=True))

    def item(i: int, t: torch.Tensor) -> tuple[bytes, list[str] | None]:
        if i in enc:
            return enc[i]
        data = raw.get(i) or saved(t)
        return (compressed(data), [DESCRIPTOR]) if pack else (data, None)

    items = [(o, s, *item(i, t)) for i, (o, s, t) in enumerate(pieces)]
    ed.set_chunks(KEY, items, size=size, dtype=dtype)
    return v


def _lie(rng: random.Random, ed: StepEditor, data: bytes) -> tuple[bytes, list[str]]:
    """A compressed item of ``data`` that is not what it says: its first frame declares a
    byte more, its first frame's CRC32C is not that of its bytes, its header is not the
    format's, it is cut short, it is DCP's own zstd transform (which muon-ckpt does not
    read), or a compressed object item instead."""
    lie = rng.choice(LIES)
    item = bytearray(compressed(data))
    if lie == "frame_size":
        item[6] = (item[6] + 1) % 256
    elif lie == "crc":
        item[15] ^= 1  # (6 bytes of header, then the frame's raw, stored length and mode)
    elif lie == "magic":
        item[:4] = b"PK\x03\x04"
    elif lie == "truncated":
        del item[len(item) // 2 :]
    elif lie == "dcp_zstd":
        import zstandard

        return zstandard.ZstdCompressor().compress(data), ["stream.zstd/1"]
    else:
        ed.replace_item(LR, compressed(saved(torch.tensor([0.02]))), [DESCRIPTOR])
    return bytes(item), [DESCRIPTOR]


def _run_commands(url: str, tmp: Any, capsys: Any) -> dict[str, Any]:
    """Each command on step 3: the crafted tensor as it loaded (or the exception)."""

    def load() -> Any:
        model, opt = _fresh()
        CheckpointManager(url, model=model, optimizer=opt).load(step=3)
        return opt.state[model.fc1.weight]["momentum_buffer"]

    def imp() -> Any:
        model, opt = _fresh()
        import_optimizer_state(opt, url, model=model, step=3)
        return opt.state[model.fc1.weight]["momentum_buffer"]

    def export() -> Any:
        out = str(tmp / "o.safetensors")
        export_safetensors(url, out, step=3, include=("model", "optim"))
        return SafetensorsFile(Storage(out)).read(KEY)

    def inspect() -> Any:
        capsys.readouterr()
        rc = main(["inspect", url, "--step", "3"])
        err = capsys.readouterr().err
        if rc and "CheckpointCorruptError" in err:
            raise CheckpointCorruptError(err)
        assert rc == 0, err
        return None

    def verify() -> Any:
        capsys.readouterr()
        rc = main(["verify", url, "--step", "3"])
        return rc, capsys.readouterr().out

    cmds = {"load": load, "verify": verify, "import": imp, "export": export, "inspect": inspect}
    return {name: peak_growth(cmd) for name, cmd in cmds.items()}


def _fresh() -> tuple[Any, Any]:
    torch.manual_seed(7)
    model = TinyNet()
    return model, make_muon(model)


def _cases() -> list[Any]:
    rng = random.Random(SEED)
    changes: list[list[str]] = [[], []]  # grids alone: they load exactly
    changes += [[c] for c in CHANGES]  # each change alone once, then random pairs
    changes += [rng.sample(CHANGES, 2) for _ in range(CASES - len(changes))]
    return [pytest.param(i, c, id=f"{i}-{'+'.join(c) or 'grid'}") for i, c in enumerate(changes)]


@pytest.mark.parametrize("case,changes", _cases())
def test_every_command_loads_exactly_or_refuses_within_a_memory_bound(
    template, tmp_path, capsys, case, changes
):
    url = str(tmp_path / "run")
    shutil.copytree(template, url)
    rng = random.Random(SEED * 1000 + case)
    want: dict[str, torch.Tensor] = {}
    craft_step(Storage(url), 3, lambda ed: want.setdefault("v", _craft(rng, ed, changes)))
    results = _run_commands(url, tmp_path, capsys)
    grew, (rc, out) = results.pop("verify")
    assert grew < MEMORY_BOUND, ("verify", changes, grew // MiB)
    assert_verify_agrees(rc, out, results["load"][1])
    # A declared dtype other than the target's is what a load reports before reading (the
    # metadata alone cannot tell a crafted step from one of another model): a mismatch.
    refused = (CheckpointCorruptError,)
    if "declare_dtype" in changes:
        refused += (CheckpointMismatchError,)
    for name, (grew, got) in results.items():
        assert grew < MEMORY_BOUND, (name, changes, grew // MiB, got)
        if isinstance(got, Exception):
            assert isinstance(got, refused), (name, changes, got)
        elif got is not None:
            assert torch.equal(got, want["v"]), (name, changes)
    if set(changes) <= {"compressed"}:  # grids, plain or compressed: they load exactly
        assert not any(isinstance(got, Exception) for _, got in results.values()), results
    if changes in (["compressed_bomb"], ["compressed_lie"]):
        assert isinstance(results["load"][1], CheckpointCorruptError), results
