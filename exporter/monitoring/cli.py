"""``vllm-cache-exporter generate``: write, or ``--check``, the rule files and dashboards.

``--check`` is what CI runs: it regenerates in memory and exits 1 with a unified diff when a
committed file differs, is missing, or is a stale dashboard no generator produces any more,
so a hand edit or a forgotten regeneration cannot ship.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path

from exporter.monitoring.config import MonitoringConfigError, load_config
from exporter.monitoring.render import prometheus_files, prometheus_rule_manifest, vmalert_files

DIFF_LINES_PER_FILE = 40


def main(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.monitoring_config_file)
    except MonitoringConfigError as err:
        print(f"vllm-cache-exporter generate: configuration error: {err}", file=sys.stderr)
        return 2
    if args.output and args.format != "prometheus-operator":
        print(
            "vllm-cache-exporter generate: --output goes with --format prometheus-operator "
            "(rule files and dashboards go under --output-dir)",
            file=sys.stderr,
        )
        return 2
    if args.format == "prometheus-operator":
        manifest = prometheus_rule_manifest(config)
        if not args.output:
            if args.check:
                print(
                    "vllm-cache-exporter generate: --check with prometheus-operator needs "
                    "--output FILE",
                    file=sys.stderr,
                )
                return 2
            sys.stdout.write(manifest)
            return 0
        files = {args.output: manifest}
        root = Path(".")
    elif args.format == "vmalert":
        files = vmalert_files(config)
        root = Path(args.output_dir)
    else:
        files = prometheus_files(config)
        root = Path(args.output_dir)
    if args.check:
        return check(root, files)
    write(root, files)
    return 0


def write(root: Path, files: dict[str, str]) -> None:
    for relative, content in files.items():
        path = root / relative
        if path.is_file() and path.read_text(encoding="utf-8") == content:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(content, encoding="utf-8")
        os.replace(tmp, path)
        print(f"wrote {path}")


def drift(root: Path, files: dict[str, str]) -> list[tuple[str, str]]:
    """(path, problem) for every generated file that is missing, differs, or is stale."""
    problems: list[tuple[str, str]] = []
    for relative, content in sorted(files.items()):
        path = root / relative
        if not path.is_file():
            problems.append((relative, "missing"))
            continue
        current = path.read_text(encoding="utf-8")
        if current != content:
            diff = list(
                difflib.unified_diff(
                    current.splitlines(keepends=True),
                    content.splitlines(keepends=True),
                    fromfile=f"{relative} (on disk)",
                    tofile=f"{relative} (generated)",
                )
            )
            shown = "".join(diff[:DIFF_LINES_PER_FILE])
            if len(diff) > DIFF_LINES_PER_FILE:
                shown += f"... {len(diff) - DIFF_LINES_PER_FILE} more diff lines\n"
            problems.append((relative, "differs\n" + shown))
    generated_dashboards = {rel for rel in files if rel.startswith("dashboards/")}
    if generated_dashboards:
        for path in sorted((root / "dashboards").glob("*.json")):
            relative = f"dashboards/{path.name}"
            if relative not in generated_dashboards:
                problems.append((relative, "stale: no generator produces it"))
    return problems


def check(root: Path, files: dict[str, str]) -> int:
    if not any((root / folder).is_dir() for folder in ("alerts", "dashboards")):
        print(
            f"generate --check: {root.resolve()} holds no alerts/ or dashboards/ to check; "
            "run it from the repository's root or pass --output-dir",
            file=sys.stderr,
        )
        return 2
    problems = drift(root, files)
    if not problems:
        print(f"generate --check: {len(files)} file(s) up to date")
        return 0
    for relative, problem in problems:
        print(f"{relative}: {problem}", file=sys.stderr)
    print(
        f"generate --check: {len(problems)} of {len(files)} file(s) out of date; run "
        "'vllm-cache-exporter generate' and commit the result",
        file=sys.stderr,
    )
    return 1
