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

The tests follow the same folders: tests/<folder>/ for each package folder, no test file at
the root of tests/ but this one, none over 600 lines, and docstrings that name the behaviour
they pin rather than an issue number.
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


# ---------------------------------------------------------------------- the tests' own layout
_TESTS = os.path.join(_ROOT, "tests")
# Test folders that follow no package folder, and why.
_OTHER_TEST_FOLDERS = {
    "benchmarks": "the CPU benchmarks' smoke test (benchmarks/ is no package of the library)",
    "gpu": "what needs CUDA, run by tests/gpu/run_gpu.sh on a GPU machine, never in CI",
    "typing": "a user's script that mypy --strict reads (.ci/typecheck), never run",
    "fixtures": "files the tests read",
}
# The seed acceptance test, kept as it came (ruff and vulture skip it too: pyproject.toml).
_SEED = os.path.join("tests", "gpu", "test_cpu_offload.py")
_MAX_TEST_LINES = 600


def _package_folders() -> set[str]:
    """The folders whose tests have a folder of their name: each sub-package of
    ``muon_ckpt``, ``manager`` (``manager.py`` and the top-level modules), the other packages."""
    inner = {
        d
        for d in os.listdir(os.path.join(_ROOT, "muon_ckpt"))
        if os.path.isfile(os.path.join(_ROOT, "muon_ckpt", d, "__init__.py"))
    }
    return inner | {"manager"} | (set(_PACKAGES) - {"muon_ckpt"})


def _test_sources() -> dict[str, str]:
    """Path relative to the root -> text, for every Python file under tests/."""
    out = {}
    for dirpath, _, files in os.walk(_TESTS):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    out[os.path.relpath(path, _ROOT)] = fh.read()
    return out


def test_each_package_folder_has_its_test_folder():
    """tests/<folder>/ (a package, with test files) for each package folder; no other test
    folder but those _OTHER_TEST_FOLDERS names."""
    missing = []
    for name in sorted(_package_folders()):
        folder = os.path.join(_TESTS, name)
        has_tests = os.path.isdir(folder) and any(
            f.startswith("test_") and f.endswith(".py") for f in os.listdir(folder)
        )
        if not has_tests or not os.path.isfile(os.path.join(folder, "__init__.py")):
            missing.append(f"tests/{name}/ (with __init__.py and test_*.py)")
    assert not missing, f"package folders without their test folder: {missing}"
    folders = {
        d for d in os.listdir(_TESTS) if os.path.isdir(os.path.join(_TESTS, d)) and d[0] not in "._"
    }
    stray = sorted(folders - _package_folders() - set(_OTHER_TEST_FOLDERS))
    assert not stray, f"test folders that follow no package folder: {stray}"


def test_no_test_file_sits_at_the_root_of_tests():
    """Each test file sits in the folder of the code it covers; at the root only this file,
    which covers the whole tree (helpers shared by several folders sit there too)."""
    root = sorted(f for f in os.listdir(_TESTS) if f.startswith("test_") and f.endswith(".py"))
    assert root == ["test_layout.py"], f"move these into tests/<folder>/: {root}"


def test_no_test_file_is_longer_than_600_lines():
    long = {
        path: n
        for path, text in _test_sources().items()
        if path != _SEED and (n := text.count("\n")) > _MAX_TEST_LINES
    }
    assert not long, f"split these along their sections: {long}"


def test_test_docstrings_say_the_behaviour_not_the_issue():
    """A docstring of a test module, class or function names the behaviour it pins; the issue
    that asked for it is the commit's business (an issue number tells a reader nothing)."""
    import re

    issue = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)
    found = []
    for path, text in _test_sources().items():
        tree = ast.parse(text)
        nodes = [tree, *ast.walk(tree)]
        for node in nodes:
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                continue
            doc = ast.get_docstring(node) or ""
            if issue.search(doc):
                found.append(f"{path}: {getattr(node, 'name', '(module)')}")
    assert not found, "\n".join(sorted(set(found)))
