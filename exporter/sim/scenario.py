"""Scenarios: one YAML file per field-report situation, with the engine it needs and its traffic.

A scenario names the vLLM settings that produce the situation (``engine``, the same keys as
``simulate``'s flags) and the agents that play it (``agents``). Times are scenario seconds;
``--speed`` divides them. Files ship as package data (``exporter/sim/scenarios/*.yaml``); a
path to another YAML file works too. Every key is checked: a typo is an error naming the file
and the key, not a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from exporter.sim.engine import EngineConfig, EngineConfigError

DEFAULT_SCENARIO = "two-agents-fit"  # drive's: a workload that stays warm where it fits
DEMO_SCENARIO = "two-agents-collapse"  # the demo's: the story of report 000
CONVERSATION, FANOUT = "conversation", "fanout"
SHARED_FIRST, TASK_FIRST = "shared-first", "task-first"


class ScenarioError(ValueError):
    pass


@dataclass(frozen=True)
class AgentSpec:
    """One caller's traffic.

    ``conversation``: ``count`` independent conversations (sessions) of this caller, each a
    system prompt of ``context_tokens`` then ``turns`` turns adding ``input_tokens`` and the
    reply (``output_tokens``), ``think_seconds`` apart.
    ``fanout``: ``rounds`` rounds, ``every_seconds`` apart, of ``width`` concurrent one-shot
    requests made of a fresh shared text (``shared_tokens``) and a per-request task
    (``task_tokens``), shared text first or task first (``order``).
    """

    caller: str
    kind: str = CONVERSATION
    start: float = 0.0
    count: int = 1
    context_tokens: int = 1000
    input_tokens: int = 200
    output_tokens: int = 100
    turns: int = 5
    think_seconds: float = 5.0
    stream: bool = True
    endpoint: str = "chat"
    width: int = 4
    rounds: int = 3
    every_seconds: float = 30.0
    shared_tokens: int = 2400
    task_tokens: int = 400
    order: str = SHARED_FIRST
    # max_tokens each request declares (0: output_tokens). Larger than output_tokens, it is a
    # caller that declares far more than it uses; the simulated model still answers
    # output_tokens (vllm_xargs.answer_tokens).
    declared_max_tokens: int = 0

    def check(self) -> None:
        problems = []
        if not self.caller or not self.caller.isprintable():
            problems.append("caller must be a printable name")
        if self.kind not in (CONVERSATION, FANOUT):
            problems.append(f"kind must be {CONVERSATION} or {FANOUT}")
        if self.endpoint not in ("chat", "completion"):
            problems.append("endpoint must be chat or completion")
        if self.order not in (SHARED_FIRST, TASK_FIRST):
            problems.append(f"order must be {SHARED_FIRST} or {TASK_FIRST}")
        for name in ("count", "turns", "width", "rounds", "output_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1")
        if self.declared_max_tokens and self.declared_max_tokens < self.output_tokens:
            problems.append("declared_max_tokens must be 0 or at least output_tokens")
        for name in (
            "context_tokens",
            "input_tokens",
            "shared_tokens",
            "task_tokens",
            "declared_max_tokens",
        ):
            if getattr(self, name) < 0:
                problems.append(f"{name} must not be negative")
        for name in ("start", "think_seconds", "every_seconds"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must not be negative")
        if problems:
            raise ScenarioError(f"agent {self.caller!r}: " + "; ".join(problems))


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    report: str  # which field report (docs/field-reports.md), and what it measured
    reproduces: str
    engine: dict[str, Any]
    agents: tuple[AgentSpec, ...]
    demo_speed: float = 10.0
    # vLLM restarts: each boot's engine settings over ``engine`` (a new pool, say). The
    # scenario plays once per boot on a fresh engine; none: one boot of ``engine``.
    boots: tuple[dict[str, Any], ...] = ()
    # The demo sends the traffic through the exporter's tap (which records it, and reads the
    # prompts: their order), instead of the driver reporting each request itself.
    demo_tap: bool = False

    def start_config(self, start: int, **overrides: Any) -> EngineConfig:
        """The engine settings of its ``start``-th start (0 the first), cycling through the
        boots: what it restarts with when it loops."""
        return self.engine_config(start % max(1, len(self.boots)), **overrides)

    def engine_config(self, boot: int = 0, **overrides: Any) -> EngineConfig:
        """The EngineConfig of boot ``boot``; ``overrides`` (flags) win when not None."""
        values = dict(self.engine)
        if self.boots:
            values.update(self.boots[boot])
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return EngineConfig(**values)
        except EngineConfigError as err:
            raise ScenarioError(f"scenario {self.name}: engine: {err}") from None

    @property
    def callers(self) -> list[str]:
        return [agent.caller for agent in self.agents]


_ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)}
_AGENT_FIELDS = {f.name: f for f in dataclasses.fields(AgentSpec)}
_TOP_KEYS = {"name", "title", "report", "reproduces", "engine", "agents", "demo", "boots"}


def _typed(value: Any, like: Any, where: str) -> Any:
    """Check a YAML scalar against the type of the default it replaces."""
    if isinstance(like, bool):
        if not isinstance(value, bool):
            raise ScenarioError(f"{where}: expected true or false")
        return value
    if isinstance(like, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ScenarioError(f"{where}: expected a whole number")
        return value
    if isinstance(like, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ScenarioError(f"{where}: expected a number")
        return float(value)
    if not isinstance(value, str):
        raise ScenarioError(f"{where}: expected a string")
    return value


def parse_scenario(data: Any, source: str) -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError(f"{source}: a scenario must be a mapping")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ScenarioError(f"{source}: unknown key(s) {', '.join(sorted(unknown))}")
    for key in ("name", "agents"):
        if key not in data:
            raise ScenarioError(f"{source}: {key} is required")
    engine = data.get("engine") or {}
    if not isinstance(engine, dict):
        raise ScenarioError(f"{source}: engine must be a mapping")
    bad = set(engine) - _ENGINE_KEYS
    if bad:
        raise ScenarioError(f"{source}: engine: unknown key(s) {', '.join(sorted(bad))}")
    engine = _engine_settings(engine, f"{source}: engine")
    boots = _boots(data.get("boots") or [], source)
    agents = _agents(data["agents"], source)
    speed, tap = _demo(data.get("demo") or {}, source)
    scenario = Scenario(
        str(data["name"]),
        str(data.get("title", "")),
        str(data.get("report", "")),
        str(data.get("reproduces", "")).strip(),
        engine,
        tuple(agents),
        speed,
        tuple(boots),
        demo_tap=tap,
    )
    for boot in range(max(1, len(boots))):
        try:
            scenario.engine_config(boot)  # fail now on an impossible engine
        except ScenarioError as err:
            raise ScenarioError(f"{source}: {err}") from None
    return scenario


def _boots(boots_raw: Any, source: str) -> list[dict[str, Any]]:
    if not isinstance(boots_raw, list) or not all(isinstance(boot, dict) for boot in boots_raw):
        raise ScenarioError(f"{source}: boots must be a list of engine settings")
    boots = []
    for index, boot in enumerate(boots_raw):
        bad = set(boot) - _ENGINE_KEYS
        if bad:
            raise ScenarioError(
                f"{source}: boots[{index}]: unknown key(s) {', '.join(sorted(bad))}"
            )
        boots.append(_engine_settings(boot, f"{source}: boots[{index}]"))
    return boots


def _agents(agents_raw: Any, source: str) -> list[AgentSpec]:
    if not isinstance(agents_raw, list) or not agents_raw:
        raise ScenarioError(f"{source}: agents must be a non-empty list")
    agents = []
    for index, raw in enumerate(agents_raw):
        where = f"{source}: agents[{index}]"
        if not isinstance(raw, dict) or "caller" not in raw:
            raise ScenarioError(f"{where}: each agent is a mapping with a caller")
        bad = set(raw) - set(_AGENT_FIELDS)
        if bad:
            raise ScenarioError(f"{where}: unknown key(s) {', '.join(sorted(bad))}")
        values: dict[str, Any] = {
            key: _typed(value, _AGENT_FIELDS[key].default, f"{where}.{key}")
            if key != "caller"
            else str(value)
            for key, value in raw.items()
        }
        agent = AgentSpec(**values)
        try:
            agent.check()
        except ScenarioError as err:
            raise ScenarioError(f"{source}: {err}") from None
        agents.append(agent)
    return agents


def _demo(demo: Any, source: str) -> tuple[float, bool]:
    """The demo's speed and whether it plays through the tap."""
    if not isinstance(demo, dict) or set(demo) - {"speed", "tap"}:
        raise ScenarioError(f"{source}: demo may only set speed and tap")
    speed = _typed(demo.get("speed", 10.0), 1.0, f"{source}: demo.speed")
    if speed <= 0:
        raise ScenarioError(f"{source}: demo.speed must be positive")
    tap = demo.get("tap", False)
    if not isinstance(tap, bool):
        raise ScenarioError(f"{source}: demo.tap must be true or false")
    return speed, tap


def _engine_settings(engine: dict[str, Any], where: str) -> dict[str, Any]:
    """Engine settings typed against EngineConfig's defaults."""
    defaults = EngineConfig()
    return {
        key: value
        if key == "enable_prefix_caching" and value is None
        else _typed(
            value,
            getattr(defaults, key) if getattr(defaults, key) is not None else True,
            f"{where}.{key}",
        )
        for key, value in engine.items()
    }


def available() -> list[str]:
    """Names of the scenarios shipped with the package."""
    folder = resources.files("exporter.sim") / "scenarios"
    return sorted(entry.name[:-5] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def load(name_or_path: str) -> Scenario:
    """A shipped scenario by name, or a YAML file by path."""
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        path = Path(name_or_path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ScenarioError(f"cannot read {path}: {err.strerror}") from None
        source = str(path)
    else:
        if name_or_path not in available():
            raise ScenarioError(
                f"unknown scenario {name_or_path!r}; shipped: " + ", ".join(available())
            )
        resource = resources.files("exporter.sim") / "scenarios" / f"{name_or_path}.yaml"
        text = resource.read_text(encoding="utf-8")
        source = f"{name_or_path}.yaml"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ScenarioError(f"{source} is not valid YAML{where}") from None
    return parse_scenario(data, source)
