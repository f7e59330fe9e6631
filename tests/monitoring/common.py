"""Paths and tools the monitoring tests share."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
ALERTS_DIR = ROOT / "alerts"
RULES_FILE = ALERTS_DIR / "vllm-cache-rules.yaml"
ALERTS_FILE = ALERTS_DIR / "vllm-cache-alerts.yaml"
PROMTOOL_TESTS = sorted((ALERTS_DIR / "tests").glob("*.yaml"))
DASHBOARD_DIR = ROOT / "dashboards"
RUNBOOK = ROOT / "docs" / "runbook.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"


def require_tool(*names: str) -> str:
    """The first tool found; skip locally when none is installed, fail in CI (.ci/run
    installs the Debian packages)."""
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    if os.environ.get("CI"):
        pytest.fail(f"{' or '.join(names)} is required in CI (.ci/run installs it)")
    pytest.skip(f"{' or '.join(names)} not installed")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def rules(path: Path) -> list[dict[str, Any]]:
    return [rule for group in load_yaml(path)["groups"] for rule in group["rules"]]
