"""The alerts for vmalert (``generate --format vmalert``): Debian's vmalert (VictoriaMetrics
1.79) refuses the Prometheus file, whose collapse alerts carry ``keep_firing_for``; it loads
the variant, and the variant fires and resolves when the Prometheus file does.

The variant's expressions are PromQL too, so promtool runs the committed tests of the alerts
that keep firing on it: the same alerts, with the same labels, at the same instants. Only the
annotations are left out of that comparison: while an alert is kept firing, the variant reads
their figures anew, where Prometheus keeps the last ones (the header of the file says so).
tests/monitoring/test_fleet_store.py runs the variant in a real vmalert on VictoriaMetrics.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from exporter.cli import main
from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.render import ALERTS_PATH, RULES_PATH, vmalert_files
from tests.monitoring.common import ALERTS_DIR, ALERTS_FILE, RULES_FILE, require_tool

# The promtool tests of the alerts with keep_firing_for (collapse and warm TTFT): a page held
# through a gap, resolved after the recovery.
KEPT = (
    "caller_target_collapse.yaml",
    "long_collapse.yaml",
    "prefix_collapse.yaml",
    "warm_ttft_collapse.yaml",
)


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=300)


def test_generate_writes_the_vmalert_variant(tmp_path: Path) -> None:
    assert main(["generate", "--format", "vmalert", "--output-dir", str(tmp_path)]) == 0
    written = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*.yaml"))
    assert written == sorted((RULES_PATH, ALERTS_PATH))
    assert (tmp_path / RULES_PATH).read_text("utf-8") == RULES_FILE.read_text("utf-8")
    alerts = yaml.safe_load((tmp_path / ALERTS_PATH).read_text("utf-8"))
    rules = [rule for group in alerts["groups"] for rule in group["rules"]]
    assert not [rule for rule in rules if "keep_firing_for" in rule]
    kept = [rule for rule in rules if rule["expr"].startswith("last_over_time((")]
    assert {rule["alert"] for rule in kept} == {
        "VllmCachePrefixCollapse",
        "VllmCacheWarmTTFTCollapse",
    }
    assert all(rule["expr"].endswith(")[10m:1m])") for rule in kept)
    # --check holds a directory to it, as it does the Prometheus files.
    assert main(["generate", "--format", "vmalert", "--output-dir", str(tmp_path), "--check"]) == 0


def test_vmalert_refuses_the_prometheus_file_and_loads_the_variant(tmp_path: Path) -> None:
    vmalert = require_tool("vmalert")
    refused = run(vmalert, "-dryRun", f"-rule={ALERTS_FILE}")
    assert refused.returncode != 0
    assert "keep_firing_for" in refused.stdout + refused.stderr
    for relative, content in vmalert_files(MonitoringConfig()).items():
        (tmp_path / Path(relative).name).write_text(content, "utf-8")
    loaded = run(
        vmalert,
        "-dryRun",
        f"-rule={tmp_path / RULES_FILE.name}",
        f"-rule={tmp_path / ALERTS_FILE.name}",
    )
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr


def _without_annotations(path: Path, key: str) -> None:
    data = yaml.safe_load(path.read_text("utf-8"))

    def strip(node: object) -> None:
        if isinstance(node, dict):
            node.pop(key, None)
            for value in node.values():
                strip(value)
        elif isinstance(node, list):
            for value in node:
                strip(value)

    strip(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False), "utf-8")


@pytest.mark.parametrize("test_file", KEPT)
def test_the_variant_fires_and_resolves_when_the_prometheus_file_does(
    tmp_path: Path, test_file: str
) -> None:
    promtool = require_tool("promtool")
    alerts_dir = tmp_path / "alerts"
    (alerts_dir / "tests").mkdir(parents=True)
    for relative, content in vmalert_files(MonitoringConfig()).items():
        (tmp_path / relative).write_text(content, "utf-8")
    shutil.copy(ALERTS_DIR / "tests" / test_file, alerts_dir / "tests")
    _without_annotations(alerts_dir / ALERTS_FILE.name, "annotations")
    _without_annotations(alerts_dir / "tests" / test_file, "exp_annotations")
    result = run(promtool, "test", "rules", f"tests/{test_file}", cwd=alerts_dir)
    assert result.returncode == 0, result.stdout + result.stderr


def test_annotations_never_hand_vmalert_a_missing_label() -> None:
    """vmalert (1.79) renders a label the alert lacks as no value, not "": a query built
    with printf from it fails, and vmalert drops the alert ("failed to execute"), where
    Prometheus renders "". Seen with a topology label the series do not carry. So every
    label a template queries or links with is defaulted (``or $labels.x ""``) or tested
    (``with $labels.x``)."""
    alerts = yaml.safe_load(vmalert_files(MonitoringConfig())[ALERTS_PATH])
    checked = 0
    for group in alerts["groups"]:
        for rule in group["rules"]:
            for text in rule["annotations"].values():
                for args in re.findall(r'printf "[^"]*"((?: \([^)]*\)| \$\S+)*) \| query', text):
                    for arg in re.findall(r" (\([^)]*\)|\$\S+)", args):
                        checked += 1
                        assert re.fullmatch(r'\(or \$labels\.\w+ ""\)', arg), (rule["alert"], arg)
                for piped in re.findall(r"\{\{ ([^}]*?) \| urlquery \}\}", text):
                    checked += 1
                    assert re.fullmatch(r'or \$labels\.\w+ ""|\.', piped), (rule["alert"], piped)
    assert checked > 50
