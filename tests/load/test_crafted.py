"""Crafted steps whose checksums are consistent: items that inflate (deflated or
overlapping zip records), items whose tensor is not the one the metadata declares, chunks that
do not tile their tensor (a gap, an overlap, a piece outside it), and declared shapes that no
stored byte backs. Every command (load, import, export, inspect) either loads exactly what was
stored or raises CheckpointCorruptError, within MEMORY_BOUND of peak memory; a load of the run
falls back past the crafted newest step."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from muon_ckpt import (
    CheckpointCorruptError,
    CheckpointManager,
    export_hf,
    export_safetensors,
    import_optimizer_state,
)
from muon_ckpt.cli import main
from tests._ckpt import TinyNet, make_muon, three_step_run
from tests._crafted import (
    MiB,
    StepEditor,
    assert_verify_agrees,
    bomb_item,
    craft_step,
    peak_growth,
    saved,
)

# Peak resident memory a command may add on these tiny steps (< 100 KiB each), crafted or
# not: reading threads' buffers and torch's own; far below what an inflating item reaches.
MEMORY_BOUND = 64 * MiB
INFLATED = 256 * MiB  # what the crafted items of the memory tests expand to in torch.load

MOMENTUM = "optim.state.fc1.weight.momentum_buffer"  # a [12, 8] tensor: load, import, export
LR = "optim.param_groups.fc1.weight.lr"  # a stored object: load, export, inspect


@pytest.fixture
def local_run(tmp_path: Any) -> dict[str, Any]:
    return three_step_run(str(tmp_path / "run"), {}, leftover=False)


def _fresh() -> tuple[Any, Any]:
    torch.manual_seed(7)
    model = TinyNet()
    return model, make_muon(model)


def _stored_value(ed: StepEditor, key: str) -> torch.Tensor:
    import io

    return torch.load(io.BytesIO(ed.stored(key)), weights_only=True)


def _commands(run: dict[str, Any], tmp_path: Any, capsys: Any) -> dict[str, Callable[[], Any]]:
    """Each command on step 3, as a call that returns its result or raises."""
    url = run["url"]
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)

    def load() -> Any:
        model, opt = _fresh()
        return CheckpointManager(url, model=model, optimizer=opt).load(step=3)

    def imp() -> Any:
        model, opt = _fresh()
        return import_optimizer_state(opt, url, model=model, step=3)

    def inspect() -> Any:
        capsys.readouterr()
        rc = main(["inspect", url, "--step", "3"])
        _, err = capsys.readouterr()
        if rc != 0:
            name = err.split("error: ", 1)[-1].split(":", 1)[0]
            raise (CheckpointCorruptError if name == "CheckpointCorruptError" else RuntimeError)(
                err
            )
        return rc

    def verify() -> Any:
        capsys.readouterr()
        rc = main(["verify", url, "--step", "3"])
        return rc, capsys.readouterr().out

    return {
        "load": load,
        "verify": verify,
        "import": imp,
        "export": lambda: export_safetensors(
            url, str(out / "o.safetensors"), step=3, include=("model", "optim", "extra")
        ),
        "export_hf": lambda: export_hf(url, str(out / "hf"), step=3, include=("model", "optim")),
        "inspect": inspect,
    }


def _outcomes(run: dict[str, Any], tmp_path: Any, capsys: Any) -> dict[str, tuple[int, Any]]:
    """Each command's (memory growth, result or exception); ``muon-ckpt verify``'s verdict is
    asserted here to be load's, within the memory bound (and left out of the result)."""
    got = {name: peak_growth(cmd) for name, cmd in _commands(run, tmp_path, capsys).items()}
    grew, (rc, out) = got.pop("verify")
    _, loaded = got["load"]
    assert grew < MEMORY_BOUND, ("verify", grew // MiB, out)
    assert_verify_agrees(rc, out, loaded)
    return got


def _falls_back(run: dict[str, Any]) -> None:
    model, opt = _fresh()
    assert CheckpointManager(run["url"], model=model, optimizer=opt).load() == 2


# ------------------------------------------------------------------ items that inflate
@pytest.mark.parametrize("how", ["deflated", "overlapping"])
@pytest.mark.parametrize("key", [MOMENTUM, LR], ids=["tensor_item", "object_item"])
def test_an_item_that_inflates_is_corrupt_within_a_memory_bound(
    local_run, tmp_path, capsys, how, key
):
    """An item of a few hundred KiB whose record is deflated, or whose zip
    entries overlap one stored record, made torch.load allocate INFLATED bytes (and a
    1 GiB per 70 KiB, without bound, with both). Its values are the stored ones, so only
    the expansion is wrong: every command refuses it (or does not read it) within the bound."""

    def edit(ed: StepEditor) -> None:
        value = _stored_value(ed, key) if key == MOMENTUM else torch.tensor([0.02])
        if how == "deflated":
            item = bomb_item(value, INFLATED, deflate=True)
        else:
            item = bomb_item(value, 1 * MiB, deflate=False, aliases=INFLATED // MiB)
        ed.replace_item(key, item)

    craft_step(local_run["storage"], 3, edit)
    size = os.path.getsize(local_run["storage"].path("step-00000003", StepEditor.NEW_FILE))
    assert size < 2 * MiB
    got = _outcomes(local_run, tmp_path, capsys)
    readers = {"load", "export"} | ({"import"} if key == MOMENTUM else {"inspect"})
    for name, (grew, out) in got.items():
        assert grew < MEMORY_BOUND, (name, grew // MiB, out)
        if name in readers:
            assert isinstance(out, CheckpointCorruptError), (name, out)
            assert key in str(out) and StepEditor.NEW_FILE in str(out), (name, out)
        else:
            assert not isinstance(out, Exception) or isinstance(out, CheckpointCorruptError)
    _falls_back(local_run)


@pytest.mark.parametrize("storage_url", ["memory", "s3"], indirect=True)
def test_remote_reads_refuse_inflating_items_too(storage_url):
    """The remote read paths (streamed with checksums, ranged reads with verify="size") make
    the same checks as the local one: a deflated tensor item and an object item whose zip
    entries overlap are corrupt within the bound, and load() falls back."""
    url, opts = storage_url
    run = three_step_run(url, opts)

    def edit(ed: StepEditor) -> None:
        value = _stored_value(ed, MOMENTUM)
        ed.replace_item(MOMENTUM, bomb_item(value, INFLATED, deflate=True))
        lr = bomb_item(torch.tensor([0.02]), MiB, deflate=False, aliases=INFLATED // MiB)
        ed.replace_item(LR, lr)

    craft_step(run["storage"], 3, edit)
    flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
    assert main(["verify", url, "--step", "3", *flags]) == 1
    for verify in ("checksum", "size"):
        model, opt = _fresh()
        mgr = CheckpointManager(
            url, model=model, optimizer=opt, storage_options=opts, verify=verify
        )
        grew, out = peak_growth(lambda m=mgr: m.load(step=3))
        assert grew < MEMORY_BOUND and isinstance(out, CheckpointCorruptError), (verify, out)
        assert StepEditor.NEW_FILE in str(out), out
        assert mgr.load() == 2


@pytest.mark.parametrize("how", ["dtype", "larger", "transposed"])
def test_an_item_whose_tensor_is_not_its_chunk_is_corrupt(local_run, tmp_path, capsys, how):
    """A stored tensor of another dtype (cast silently on load) or another shape
    than its chunk declares (silently narrowed to the chunk: rows the metadata does not
    describe) is corrupt, naming the file and the key."""

    def edit(ed: StepEditor) -> None:
        v = _stored_value(ed, MOMENTUM)
        other = {
            "dtype": v.double(),
            "larger": torch.cat([v, v]),
            "transposed": v.t().contiguous(),
        }[how]
        ed.replace_item(MOMENTUM, saved(other))

    craft_step(local_run["storage"], 3, edit)
    got = _outcomes(local_run, tmp_path, capsys)
    for name in ("load", "import", "export", "export_hf"):
        grew, out = got[name]
        assert grew < MEMORY_BOUND, (name, grew // MiB, out)
        assert isinstance(out, CheckpointCorruptError), (name, out)
        assert MOMENTUM in str(out) and StepEditor.NEW_FILE in str(out), (name, out)
    _falls_back(local_run)


# ------------------------------------------------------------------ chunks that do not tile
def _rows(v: torch.Tensor, lo: int, hi: int) -> tuple[list[int], list[int], bytes]:
    return [lo, 0], [hi - lo, v.shape[1]], saved(v[lo:hi].clone())


@pytest.mark.parametrize("how", ["gap", "overlap", "outside", "none"])
def test_chunks_that_do_not_tile_their_tensor_are_corrupt(local_run, tmp_path, capsys, how):
    """Rows no chunk stores were left as they were by a strict load (an empty
    report) and filled with heap garbage by import and export; overlapping chunks wrote
    rows twice; a chunk outside the tensor's size. Each item is exactly its chunk, so only
    the tiling is wrong: every reader refuses the step before writing anything, naming the
    key. ``none``: the same tensor in three chunks that tile it loads exactly."""
    want: dict[str, torch.Tensor] = {}

    def edit(ed: StepEditor) -> None:
        v = want["v"] = _stored_value(ed, MOMENTUM)
        pieces = {
            "gap": [_rows(v, 0, 6)],
            "overlap": [_rows(v, 0, 8), _rows(v, 4, 12)],
            "outside": [_rows(v, 0, 12), ([12, 0], [4, 8], saved(v[:4].clone()))],
            "none": [_rows(v, 0, 3), _rows(v, 3, 4), _rows(v, 4, 12)],
        }[how]
        ed.set_chunks(MOMENTUM, pieces)

    craft_step(local_run["storage"], 3, edit)
    got = _outcomes(local_run, tmp_path, capsys)
    if how == "none":
        assert all(not isinstance(out, Exception) for _, out in got.values()), got
        model, opt = _fresh()
        CheckpointManager(local_run["url"], model=model, optimizer=opt).load(step=3)
        assert torch.equal(opt.state[model.fc1.weight]["momentum_buffer"], want["v"])
        return
    for name, (_, out) in got.items():
        assert isinstance(out, CheckpointCorruptError), (name, out)
        assert MOMENTUM in str(out), (name, out)
    assert not os.path.exists(tmp_path / "out" / "o.safetensors")
    _falls_back(local_run)


@pytest.mark.parametrize("size", [[24, 8], [4096, 4096]], ids=["garbage_rows", "inflated"])
def test_export_of_a_shape_its_chunks_do_not_cover_writes_nothing(local_run, tmp_path, size):
    """Export allocated the declared shape with torch.empty and wrote it out, the
    rows no chunk covers carrying whatever the heap held, and a declared [4096, 4096] turned
    a step of under 100 KiB into a 64 MiB file. The step is corrupt; no file is written."""
    key = "model.fc1.weight"

    def edit(ed: StepEditor) -> None:
        v = _stored_value(ed, key)
        ed.set_chunks(key, [([0, 0], list(v.shape), saved(v))], size=size)

    craft_step(local_run["storage"], 3, edit)
    model, opt = _fresh()
    with pytest.raises(CheckpointCorruptError, match=key):
        CheckpointManager(local_run["url"], model=model, optimizer=opt).load(step=3)
    assert main(["verify", local_run["url"], "--step", "3"]) == 1
    out = tmp_path / "o.safetensors"
    with pytest.raises(CheckpointCorruptError, match=key):
        export_safetensors(local_run["url"], str(out), step=3)
    assert not out.exists()
    with pytest.raises(CheckpointCorruptError, match=key):
        export_hf(local_run["url"], str(tmp_path / "hf"), step=3)
    assert not any((tmp_path / "hf").glob("*.safetensors"))
