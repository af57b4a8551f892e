"""The layout's one-way rule, checked on the sources: the datastores library never imports rest_core (the engine
builds on the stores, not the other way round)."""
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


def test_the_datastores_library_never_imports_rest_core():
    reaching_up = {str(p.relative_to(ROOT)): sorted(n for n in imported(p) if n.split(".")[0] == "rest_core")
                   for p in (ROOT / "datastores").glob("*.py")}
    assert {p: names for p, names in reaching_up.items() if names} == {}
