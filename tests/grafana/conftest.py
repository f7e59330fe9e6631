"""The Grafana-code loader, installed once per session (see bootstrap.py)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exporter.monitoring.dashboards.grafana import GRAFANA_VERSION
from tests.grafana.bootstrap import (
    UI_MODULE,
    BootstrapError,
    NodeMissing,
    ensure_installed,
    node,
)

LoadReport = dict[str, Any]


def _announce(config: pytest.Config) -> Callable[[str], None]:
    """A line on the terminal even while pytest captures output."""
    capture = config.pluginmanager.getplugin("capturemanager")

    def announce(message: str) -> None:
        with capture.global_and_fixture_disabled():
            print(f"\n{message}", flush=True)

    return announce


@pytest.fixture(scope="session")
def load_with_grafana(pytestconfig: pytest.Config) -> Callable[..., LoadReport]:
    """Dashboard files -> the report of loading them with Grafana's own panel code."""
    try:
        harness = ensure_installed(_announce(pytestconfig))
    except NodeMissing as err:
        if os.environ.get("CI"):
            pytest.fail(f"{err}; CI must have them (.ci/run installs them)", pytrace=False)
        pytest.skip(str(err))
    except BootstrapError as err:
        pytest.fail(f"cannot install Grafana's panel code: {err}", pytrace=False)

    def load(*paths: Path) -> LoadReport:
        result = subprocess.run(
            [node(), str(harness), GRAFANA_VERSION, str(UI_MODULE), *map(str, paths)],
            cwd=harness.parent,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout)

    return load
