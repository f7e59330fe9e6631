"""The README's Quick start installs only the runtime dependencies (``pip install -e .``) and
runs ``demo``; ``check``, ``generate`` and the exporter itself run from the same install. So
every package a product module imports (anywhere in it, also inside a function) must be one
that ``pip install .`` brings: a runtime dependency in pyproject.toml, or one of theirs. A
module importing pytest, hypothesis or cryptography (the ``test`` extra) would work in the
test venv and fail for the user who followed the Quick start.
"""

from __future__ import annotations

import ast
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test venv's tomli, or skip
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "exporter"


def imported_top_levels(package: Path) -> dict[str, set[str]]:
    """Top-level module name -> the files under ``package`` that import it (absolute imports
    only: a relative one stays inside the package)."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        optional = optional_imports(tree)
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(
                    str(path.relative_to(package.parent))
                )
    return found


def optional_imports(tree: ast.AST) -> set[int]:
    """The imports in the body of a ``try`` that handles ImportError: an optional extra
    (``google-re2``), which the code does without when it is not installed."""
    optional: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(handler.type, ast.Name)
            and handler.type.id in ("ImportError", "ModuleNotFoundError")
            for handler in node.handlers
        ):
            for statement in node.body:
                optional.update(
                    id(sub)
                    for sub in ast.walk(statement)
                    if isinstance(sub, (ast.Import, ast.ImportFrom))
                )
    return optional


def runtime_requirements(pyproject: Path) -> list[Requirement]:
    """pyproject.toml's ``dependencies`` that apply here (their markers evaluated), no extra."""
    with pyproject.open("rb") as handle:
        declared = tomllib.load(handle)["project"]["dependencies"]
    requirements = [Requirement(text) for text in declared]
    return [req for req in requirements if req.marker is None or req.marker.evaluate({"extra": ""})]


def installed_closure(requirements: list[Requirement]) -> set[str]:
    """What ``pip install .`` installs for these requirements: each, and what each requires
    (without extras), as installed here; canonical distribution names."""
    seen: set[str] = set()
    pending = list(requirements)
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:
            continue  # declared but not installed here: nothing more it could bring
        for text in requires:
            sub = Requirement(text)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                pending.append(sub)
    return seen


def not_installed_by_runtime(package: Path, pyproject: Path) -> list[str]:
    """Every import of ``package`` that the runtime install would not satisfy, with where."""
    allowed = installed_closure(runtime_requirements(pyproject))
    distributions = metadata.packages_distributions()
    wrong = []
    for name, files in sorted(imported_top_levels(package).items()):
        if name in sys.stdlib_module_names or name == package.name:
            continue
        owners = {canonicalize_name(dist) for dist in distributions.get(name, [])}
        if not owners & allowed:
            owner = ", ".join(sorted(owners)) or "no installed distribution"
            wrong.append(f"{name} ({owner}) imported by {', '.join(sorted(files))}")
    return wrong


def test_every_product_import_comes_with_the_runtime_dependencies():
    assert not_installed_by_runtime(PACKAGE, ROOT / "pyproject.toml") == []


@pytest.mark.parametrize("planted", ["pytest", "hypothesis", "cryptography.x509"])
def test_a_test_only_import_is_caught(tmp_path, planted):
    """The check itself can fail: a copy of the package with a test extra's import planted in
    one module (inside a function, where it would fail only when called)."""
    import shutil

    copy = tmp_path / "exporter"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "check.py"
    target.write_text(
        target.read_text(encoding="utf-8") + f"\n\ndef _planted():\n    import {planted}\n",
        encoding="utf-8",
    )
    wrong = not_installed_by_runtime(copy, ROOT / "pyproject.toml")
    assert [line.split()[0] for line in wrong] == [planted.split(".")[0]]
    assert "exporter/check.py" in wrong[0]
