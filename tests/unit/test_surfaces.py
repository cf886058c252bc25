"""Tests and benchmarks reach the product through its public surfaces.

A private module or name (``_x``) of ``plugin``, ``bridge``, ``txn`` or
``sql`` is imported only by a test of that module's internals, which sits
in the directory mirroring the module's package under its kind
(``tests/unit/bridge/wire/`` for ``bridge.wire._frames``,
``tests/site/txn/local/`` for ``txn.local._log``)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests import REPO

PACKAGES = ("plugin", "bridge", "txn", "sql")
KINDS = ("unit", "site", "two_sites", "fault", "interop", "docs")


def _imported(tree: ast.AST) -> list[str]:
    """Every module or module.name a file imports (absolute imports only)."""
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def private_reach(path: Path, source: str) -> list[str]:
    """The private imports of ``path`` (relative to the checkout) that do
    not sit beside their module's mirror."""
    where = path.parent.parts
    kind_dir = where[:2] if len(where) >= 2 and where[0] == "tests" else ()
    found = []
    for name in _imported(ast.parse(source)):
        parts = name.split(".")
        if parts[0] not in PACKAGES:
            continue
        private = [i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")]
        if not private:
            continue
        package = tuple(parts[: private[0]])
        if kind_dir and kind_dir[1] in KINDS and where[2:] == package:
            continue
        found.append(name)
    return found


def test_tests_and_benchmarks_import_only_public_surfaces() -> None:
    files = sorted([*REPO.glob("tests/**/*.py"), *REPO.glob("bench/**/*.py")])
    reached = {
        str(f.relative_to(REPO)): names
        for f in files
        if (names := private_reach(f.relative_to(REPO), f.read_text()))
    }
    assert reached == {}


def test_the_check_sees_a_private_import_away_from_its_mirror() -> None:
    line = "from bridge.wire._frames import Hello\n"
    assert private_reach(Path("tests/unit/bridge/wire/test_frames.py"), line) == []
    assert private_reach(Path("tests/site/bridge/wire/test_x.py"), line) == []
    assert private_reach(Path("tests/unit/bridge/test_x.py"), line) == [
        "bridge.wire._frames",
        "bridge.wire._frames.Hello",
    ]
    assert private_reach(Path("bench/x.py"), "from bridge import _errors\n") == ["bridge._errors"]
    assert private_reach(Path("bench/x.py"), "from bridge.wire import Hello\n") == []


def _public_definitions(source: str) -> list[str]:
    """The classes and capitalised constants a module defines at its top."""
    names: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name) and t.id[:1].isupper()]
    return [n for n in names if not n.startswith("_")]


def test_no_public_class_or_constant_is_defined_in_two_modules() -> None:
    """One name, one definition: a second error class per reply code or a
    second ``TRANSITIONS`` is a copy or a clash, either way a reader's trap.
    (Alembic's per-revision ``revision`` names are lower case.)"""
    where: dict[str, list[str]] = {}
    for package in PACKAGES:
        for module in sorted((REPO / package).rglob("*.py")):
            if module.name == "__init__.py":
                continue  # a package re-exports, it does not define
            for name in _public_definitions(module.read_text()):
                where.setdefault(name, []).append(str(module.relative_to(REPO)))
    assert {name: modules for name, modules in where.items() if len(modules) > 1} == {}
