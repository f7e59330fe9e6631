"""Imports flow one way: readers (engine, usage) and signals import only `values` (and the
`redaction` leaf); metrics
reads signals; the simulator, the monitoring generators and the web-config package stand
alone; only the top (cli, config, wiring, runtime, server, page, check, demo) ties them together,
and nothing below imports the top.

docs/architecture.md states the same rule; this test is its proof. Every import counts,
also those inside functions, and no two modules may import each other, directly or not.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "exporter"

TOP = frozenset(
    {"cli", "config", "wiring", "runtime", "server", "page", "check", "demo", "__main__"}
)
# part of the package -> the parts it may import (besides itself). "" is exporter/__init__.py.
ALLOWED: dict[str, frozenset[str]] = {
    "": frozenset(),
    "values": frozenset(),
    "redaction": frozenset(),
    "logs": frozenset(),
    "limits": frozenset({"families"}),
    "families": frozenset({"values"}),
    "engine": frozenset({"values", "redaction"}),
    "usage": frozenset({"values", "redaction"}),
    "signals": frozenset({"values", "redaction"}),
    "metrics": frozenset({"signals", "values", "families", ""}),
    "sim": frozenset({"logs"}),
    "monitoring": frozenset({"families"}),
    "web": frozenset({"families"}),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """What a file imports from the exporter package, anywhere in it: module names, or
    ``module:name`` for ``from module import name`` (a module or a name in it)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.update(f"{module}:{alias.name}" for alias in node.names)
    return {
        name for name in found if name.split(":")[0] == "exporter" or name.startswith("exporter.")
    }


def graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path):
            module, _, member = imported.partition(":")
            if member and f"{module}.{member}" in modules:  # from exporter import wiring
                module = f"{module}.{member}"
            while module not in modules and "." in module:
                module = module.rpartition(".")[0]
            if module in modules and module != name:
                targets.add(module)
        edges[name] = targets
    return edges


def part_of(module: str) -> str:
    """exporter.usage.tap.proxy -> usage; exporter.cli -> cli; exporter -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_follow_the_documented_direction():
    wrong = []
    for module, targets in sorted(graph().items()):
        source = part_of(module)
        if source in TOP:
            continue
        assert source in ALLOWED, f"{module}: add its package to ALLOWED and to the docs"
        for target in sorted(targets):
            destination = part_of(target)
            if destination != source and destination not in ALLOWED[source]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "source, target",
    [
        ("exporter/signals/usage.py", "exporter.config"),
        ("exporter/usage/ingest.py", "exporter.server"),
    ],
)
def test_the_rule_catches_a_wrong_import(tmp_path, monkeypatch, source, target):
    """The checker itself can fail: plant a forbidden import in a copy of the package."""
    import shutil

    copy = tmp_path / "exporter"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    planted = copy / source.removeprefix("exporter/")
    planted.write_text(
        planted.read_text(encoding="utf-8") + f"\nimport {target}\n", encoding="utf-8"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy)
    with pytest.raises(AssertionError, match=f"imports {target}"):
        test_imports_follow_the_documented_direction()


def test_architecture_doc_states_the_rule():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    for part in ALLOWED:
        if part:
            assert f"`{part}`" in doc, f"docs/architecture.md does not describe {part}"
