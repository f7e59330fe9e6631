"""Scenario files are checked key by key: a typo is an error naming the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter.sim import scenario as scenarios
from exporter.sim.scenario import ScenarioError, parse_scenario

GOOD = {"name": "t", "agents": [{"caller": "a"}]}


@pytest.mark.parametrize(
    "data, message",
    [
        ([1, 2], "must be a mapping"),
        ({"agents": [{"caller": "a"}]}, "name is required"),
        ({**GOOD, "agnets": []}, "unknown key(s) agnets"),
        ({**GOOD, "engine": {"block_sise": 16}}, "engine: unknown key(s) block_sise"),
        ({**GOOD, "engine": {"block_size": "big"}}, "engine.block_size: expected a whole number"),
        ({**GOOD, "engine": {"hybrid": "yes"}}, "engine.hybrid: expected true or false"),
        ({**GOOD, "engine": {"block_size": 32, "granularity": 48}}, "multiple of block_size"),
        ({"name": "t", "agents": []}, "agents must be a non-empty list"),
        ({"name": "t", "agents": [{"turns": 3}]}, "with a caller"),
        ({"name": "t", "agents": [{"caller": "a", "turns": 0}]}, "turns must be at least 1"),
        ({"name": "t", "agents": [{"caller": "a", "kind": "swarm"}]}, "kind must be"),
        ({"name": "t", "agents": [{"caller": "a", "think_seconds": -1}]}, "must not be negative"),
        ({"name": "t", "agents": [{"caller": "a", "tunrs": 3}]}, "unknown key(s) tunrs"),
        ({**GOOD, "demo": {"speed": 0}}, "demo.speed must be positive"),
        ({**GOOD, "boots": {"kv_pool_tokens": 1}}, "boots must be a list of engine settings"),
        (
            {**GOOD, "boots": [{"kv_pool_tokens": 1000}, {"pool": 5}]},
            "boots[1]: unknown key(s) pool",
        ),
        ({**GOOD, "boots": [{"kv_pool_tokens": "big"}]}, "boots[0].kv_pool_tokens: expected"),
        (
            {**GOOD, "engine": {"block_size": 32}, "boots": [{"kv_pool_tokens": 16}]},
            "kv_pool_tokens must hold one block",
        ),
        (
            {
                "name": "t",
                "agents": [{"caller": "a", "output_tokens": 800, "declared_max_tokens": 100}],
            },
            "declared_max_tokens must be 0 or at least output_tokens",
        ),
    ],
)
def test_bad_scenarios_are_refused_with_the_key_named(data, message):
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(data, "my.yaml")
    assert message in str(caught.value) and "my.yaml" in str(caught.value)


def test_files_by_path_and_their_errors(tmp_path: Path):
    good = tmp_path / "mine.yaml"
    good.write_text("name: mine\nagents:\n  - caller: x\n    turns: 2\n")
    assert scenarios.load(str(good)).agents[0].turns == 2
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError, match="not valid YAML at line"):
        scenarios.load(str(broken))
    with pytest.raises(ScenarioError, match="cannot read"):
        scenarios.load(str(tmp_path / "missing.yaml"))
    with pytest.raises(ScenarioError, match="unknown scenario 'nope'; shipped: details-off"):
        scenarios.load("nope")


def test_flags_override_the_scenario_engine():
    scenario = scenarios.load("two-agents-fit")
    assert scenario.engine_config().kv_pool_tokens == 210828
    config = scenario.engine_config(kv_pool_tokens=160779, hybrid=None)
    assert config.kv_pool_tokens == 160779 and config.hybrid is True


def test_boots_are_engine_settings_over_the_engine():
    """pool-restarts: each boot's pool over the same engine; flags still win."""
    scenario = scenarios.load("pool-restarts")
    pools = [scenario.engine_config(boot).kv_pool_tokens for boot in range(len(scenario.boots))]
    assert pools == [210_828, 193_732, 203_372]
    assert {scenario.engine_config(boot).block_size for boot in range(3)} == {2048}
    assert scenario.engine_config(1, kv_pool_tokens=100_000).kv_pool_tokens == 100_000
