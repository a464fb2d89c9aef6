"""The tree is the first architecture diagram: its import graph, computed from the sources
(AST), runs one way and has no cycle.

Within ``muon_ckpt``: the top-level private modules (errors, collectives, options, threads...)
are the base; ``store`` is above the base; ``state`` and ``_dcp`` above ``store``; ``save``
and ``load`` above those, and neither imports the other; ``memory`` (the memory tier, which
saves and loads through both) and ``interop`` above them; ``_saves`` (the save coordinator of
both tiers) above those; ``manager`` above it; then
``demo`` (which uses the public API, like any script) and ``cli`` (which runs the demo); the
package's ``__init__`` is the facade. Across packages:
``offload`` imports neither of the others, ``optim`` only ``offload``, and ``muon_ckpt`` never
``optim`` (it works with any optimizer) but in its demo.
"""

from __future__ import annotations

import ast
import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = ("muon_ckpt", "optim", "offload")

# The unit of a module (its folder, or the top-level module itself) -> its level.
_LEVEL = {
    "base": 0,
    "store": 1,
    "state": 2,
    "_dcp": 2,
    "save": 3,
    "load": 3,
    "memory": 4,
    "interop": 4,
    "_saves": 5,  # the save coordinator: the url's writer and the memory tier's
    "manager": 6,
    "demo": 7,
    "integrations": 7,  # adapters for the frameworks: users of the manager
    "cli": 8,
    "__init__": 9,
}


def _modules() -> dict[str, str]:
    """Dotted module name -> path, for every module of the three packages."""
    out = {}
    for pkg in _PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(_ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), _ROOT)[:-3]
                    name = rel.replace(os.sep, ".").removesuffix(".__init__")
                    out[name] = os.path.join(dirpath, f)
    return out


def _imports(path: str, known: set[str]) -> set[str]:
    """The known modules ``path`` imports (at any depth: a lazy import is a dependency too)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n:
                found.add(n)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(p, known) - {m} for m, p in mods.items()}


def _unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    if parts[1] in _LEVEL:
        return parts[1]
    return "base"  # a top-level private module: _errors, _collective, _config, ...


def test_muon_ckpt_folders_import_one_way():
    wrong = []
    for m, deps in _graph().items():
        if not m.startswith("muon_ckpt"):
            continue
        for d in deps:
            if not d.startswith("muon_ckpt"):
                continue
            a, b = _unit(m), _unit(d)
            if a == "demo" and b == "__init__":
                continue  # the demo is a user of the public API
            if a != b and _LEVEL[b] >= _LEVEL[a]:
                wrong.append(f"{m} ({a}) imports {d} ({b})")
    assert not wrong, "\n".join(sorted(wrong))


def _private_imports(path: str) -> list[str]:
    """``from muon_ckpt.<folder>._<module> import ...`` in ``path`` (at any depth)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    return [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.level == 0
        and len(node.module.split(".")) > 2
        and node.module.split(".")[0] == "muon_ckpt"
        and node.module.split(".")[2].startswith("_")
    ]


def test_folders_meet_through_their_facades():
    """A folder of ``muon_ckpt`` imports another folder's names from its ``__init__`` only:
    what it exports is its interface, everything underscored is its own."""
    wrong = []
    for m, path in _modules().items():
        parts = m.split(".")
        if parts[0] != "muon_ckpt" or len(parts) < 3:
            continue  # (a top-level module, the facade, and the base are not folders)
        for imported in _private_imports(path):
            if imported.split(".")[1] != parts[1]:
                wrong.append(f"{m} imports {imported}")
    assert not wrong, "\n".join(sorted(wrong))


def test_packages_import_one_way():
    allowed = {
        "offload": {"offload"},
        "optim": {"optim", "offload"},
        "muon_ckpt": {"muon_ckpt", "offload"},
    }
    wrong = []
    for m, deps in _graph().items():
        top = m.split(".")[0]
        for d in deps:
            other = d.split(".")[0]
            if other not in allowed[top] and not m.startswith("muon_ckpt.demo"):
                # An adapter may build optim's Muon where its framework builds optimizers
                # (torchtitan's optimizer container); the core never imports optim.
                if m.startswith("muon_ckpt.integrations.") and other == "optim":
                    continue
                wrong.append(f"{m} imports {d}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_cycle_between_modules():
    graph = _graph()
    # Package facades re-export their modules and are imported instead of them: an edge to a
    # facade stands for edges to what it re-exports, so cycles are looked for between modules.
    facades = {m for m in graph if os.path.basename(_modules()[m]) == "__init__.py"}
    edges = {
        m: {d for d in deps if d not in facades}
        | set().union(*(graph[d] for d in deps if d in facades))
        for m, deps in graph.items()
        if m not in facades
    }
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if d in facades or d == m:
                continue
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d) :], d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles[:10])


@pytest.mark.parametrize("pkg", _PACKAGES)
def test_no_module_is_longer_than_450_lines(pkg):
    long = {}
    for m, path in _modules().items():
        if m.split(".")[0] == pkg:
            with open(path) as f:
                n = sum(1 for _ in f)
            if n > 450:
                long[m] = n
    assert not long, long


def test_the_manager_is_its_options_handshake_and_public_calls():
    """manager.py stays at most 300 lines: its procedures live where they belong (the saves
    of both tiers in ``_saves``, their writers in ``save`` and ``memory``, loads in ``load``
    and ``memory``)."""
    with open(os.path.join(_ROOT, "muon_ckpt", "manager.py")) as f:
        n = sum(1 for _ in f)
    assert n <= 300, f"muon_ckpt/manager.py has {n} lines"


def test_no_package_is_named_like_a_standard_library_module():
    import sys

    clash = [m for m in _modules() if m.split(".")[-1] in sys.stdlib_module_names]
    assert not clash, clash
