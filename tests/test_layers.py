"""The layout's one-way rules, checked on the sources: the bottom package (rest_base) imports neither the stores nor
the engine, nor torch; the datastores library never imports rest_core (the engine builds on the stores, not the
other way round)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported(path: Path) -> set[str]:
    """Every module a source file imports, at any depth of the file (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def reaching(folder: str, above: set[str]) -> dict[str, list[str]]:
    """Per source file of `folder` that imports any of the packages `above`, what it imports from them."""
    found = {str(p.relative_to(ROOT)): sorted(n for n in imported(p) if n.split(".")[0] in above)
             for p in (ROOT / folder).glob("*.py")}
    return {p: names for p, names in found.items() if names}


def test_the_bottom_package_imports_neither_the_stores_nor_the_engine():
    assert (ROOT / "rest_base" / "__init__.py").exists()
    assert reaching("rest_base", {"datastores", "rest_core", "torch"}) == {}


def test_the_datastores_library_never_imports_rest_core():
    assert reaching("datastores", {"rest_core"}) == {}
