"""exporter.web is a leaf: the exporter's listener and the tap's both use it, so it may
import nothing else from the package (a cycle through server or config would follow), but
the series table ``exporter.families`` (a leaf of data: its series' names and HELP)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "exporter" / "web"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_exporter_web_imports_only_itself_from_the_package():
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 5
    outside = {
        f"{path.name}: {name}"
        for path in files
        for name in imported_modules(path)
        if (name == "exporter" or name.startswith("exporter."))
        and not name.startswith("exporter.web")
        and name != "exporter.families"
    }
    assert outside == set()
