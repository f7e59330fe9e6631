"""The README is what a new user runs: its commands and reference must match the code."""

from __future__ import annotations

import re
from pathlib import Path

from exporter.config import COMMANDS, flags_markdown
from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.rules import recorded_markdown

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
CONFIGURATION = ROOT / "docs" / "configuration.md"
USAGE = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
METRICS = ROOT / "docs" / "metrics.md"
RECORDED = ("<!-- recorded:begin -->\n", "<!-- recorded:end -->")


def flag_blocks(text: str) -> dict[str, str]:
    """command -> the generated flag table for it in docs/configuration.md."""
    blocks = {}
    for part in text.split("<!-- flags:begin ")[1:]:
        command = part.split(None, 1)[0]
        blocks[command] = part.split("-->", 1)[1].split("<!-- flags:end")[0].strip()
    return blocks


def test_flag_reference_is_current():
    """One generated table per command, all from the one table in exporter/config.py."""
    blocks = flag_blocks(CONFIGURATION.read_text(encoding="utf-8"))
    assert set(blocks) == set(COMMANDS)
    for command in COMMANDS:
        assert blocks[command] == flags_markdown(command).strip(), (
            f"regenerate: python -m tests.test_readme ({command})"
        )


def regenerate() -> None:
    text = CONFIGURATION.read_text(encoding="utf-8")
    for command in flag_blocks(text):
        marker = f"<!-- flags:begin {command} "
        head, rest = text.split(marker, 1)
        comment, rest = rest.split("-->", 1)
        _old, tail = rest.split("<!-- flags:end", 1)
        text = f"{head}{marker}{comment}-->\n{flags_markdown(command)}<!-- flags:end{tail}"
    CONFIGURATION.write_text(text, encoding="utf-8")
    metrics = METRICS.read_text(encoding="utf-8")
    head, rest = metrics.split(RECORDED[0], 1)
    _old, tail = rest.split(RECORDED[1], 1)
    METRICS.write_text(
        f"{head}{RECORDED[0]}{recorded_markdown(MonitoringConfig())}{RECORDED[1]}{tail}",
        encoding="utf-8",
    )


def test_every_recorded_series_is_documented():
    """docs/metrics.md lists every series the shipped rules record, from the rules."""
    block = METRICS.read_text(encoding="utf-8").split(RECORDED[0], 1)[1].split(RECORDED[1])[0]
    assert block == recorded_markdown(MonitoringConfig()), "regenerate: python -m tests.test_readme"


def test_ci_runs_exactly_the_readme_test_command():
    blocks = re.findall(r"```sh\n(.*?)```", README, flags=re.S)
    assert blocks[0].strip().endswith("vllm-cache-exporter demo")
    test_command = blocks[1].strip()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command in ci.splitlines()


if __name__ == "__main__":
    regenerate()


def test_ci_proves_the_declared_dependency_floors():
    """pyproject.toml's lowest admitted releases are exactly those .ci/run installs to prove."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for package in ("prometheus-client", "aiohttp", "orjson", "msgspec", "uvloop"):
        floor = re.search(rf'"{package}>=([\d.]+)[";]', pyproject)
        assert floor, f"{package} has no floor in pyproject.toml"
        assert f"'{package}=={floor.group(1)}'" in ci, f"{package} floor not proven in .ci/run"


def test_the_openai_format_examples_read_as_the_readme_says():
    """docs/usage.md: one record per response shape (chat, completions, Responses, Anthropic
    Messages): each is accepted, with the prompt and cached tokens its usage says."""
    import json

    from exporter.usage.formats import OpenAIFormat

    block = USAGE.split("One record of each")[1].split("```json\n", 1)[1].split("```")[0]
    events = [OpenAIFormat()(json.loads(line)) for line in block.splitlines() if line.strip()]
    assert [(event.caller, event.prompt_tokens, event.cached_tokens) for event in events] == [
        ("a", 1396, 1376),
        ("b", 1373, 1344),
        ("c", 268, 256),
        ("d", 446, 416),
    ]


def test_the_docs_list_every_shipped_alert():
    """docs/monitoring.md's entry for alerts/vllm-cache-alerts.yaml names exactly the alerts
    the generator writes there, each once: none left out, none that is not shipped."""
    from exporter.monitoring.alerts import alert_rule_groups

    monitoring = (ROOT / "docs" / "monitoring.md").read_text(encoding="utf-8")
    entry = monitoring.split("- `alerts/vllm-cache-alerts.yaml`:", 1)[1].split("\n- ", 1)[0]
    listed = re.findall(r"`(VllmCache[A-Za-z]+)`", entry)
    generated = {
        rule["alert"]
        for group in alert_rule_groups(MonitoringConfig())
        for rule in group["rules"]
        if "alert" in rule
    }
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == generated


CONFIG_KEYS = ("<!-- monitoring config keys:", "<!-- end of monitoring config keys -->")


def config_default(value: object) -> str:
    """A MonitoringConfig default as docs/monitoring.md's table writes it."""
    from exporter.monitoring.promql import number

    if isinstance(value, float):
        return number(value)
    if isinstance(value, tuple):
        parts = [
            f"{entry[0]}: {entry[1]}" if isinstance(entry, tuple) else str(entry) for entry in value
        ]
        return ", ".join(parts) or '""'
    return str(value) or '""'


def test_the_readme_documents_every_monitoring_config_key_with_its_default():
    """docs/monitoring.md's table of --monitoring.config-file keys is the config schema: the same
    keys, in the same order, with the defaults the dataclass has."""
    import dataclasses

    monitoring = (ROOT / "docs" / "monitoring.md").read_text(encoding="utf-8")
    block = monitoring.split(CONFIG_KEYS[0], 1)[1].split(CONFIG_KEYS[1], 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| `([^`]*)` \|", block, flags=re.M)
    config = MonitoringConfig()
    expected = [
        (item.name, config_default(getattr(config, item.name)))
        for item in dataclasses.fields(config)
    ]
    assert rows == expected
