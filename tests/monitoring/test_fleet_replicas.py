"""Issue 33's acceptance test: three vLLM replicas, one collapses, in a fleet's store.

- three simulated vLLM replicas (tests/monitoring/fleet-replicas.yaml), each read by its own
  engine-side exporter (a sidecar: ``--vllm.url`` its replica, no usage);
- three gateway exporters (no ``--vllm.url``) taking the usage of every request, as a proxy
  POSTs it: the test is the balancer in front of them, sticky by session for agent-a and
  agent-c, request by request (round robin) for agent-b. Each usage event names the replica
  that served it (``backend``, its base URL);
- an HA pair of Prometheus agents (external labels ``cluster: a`` and ``prometheus_replica``
  r1 / r2) scraping all six exporters and remote-writing to a central Prometheus and to
  VictoriaMetrics, where vmalert evaluates the ``--format vmalert`` rules
  (tests/monitoring/fleet.py, shared with test_fleet_store.py).

Phase one: agent-a holds a warm conversation on each replica, its usage sticky by session.
The test waits until both stores have a baseline hit ratio for every replica, and requires
no turn with unseen history anywhere (the sticky split explains every turn). Phase two: the
test sends agent-c's 42k conversation to the last replica only, whose pool (60,000 tokens)
cannot hold it beside agent-a's (their checkpoints evict each other: its hit ratio goes from
about 0.97 to 0), and starts agent-b on the first replica with its usage split request by
request. It then requires, from the central Prometheus and from vmalert alike:

- ``VllmCachePrefixCollapse{scope="engine"}`` firing for the collapsed replica's target, with
  ``cluster="a"`` and no replica label, and never (not even pending) for the other two, nor
  for agent-a as a whole (its combined ratio stays above half its baseline: what the
  per-replica caller alert is for);
- ``VllmCacheUnseenHistory`` firing for the model once agent-b's usage is split, and the
  gateways counting its turns in ``vllm_cache_unseen_history_requests_total``;
- each replica's admission budget equal to what its sidecar serves (two copies stored, one
  counted), and agent-a's prompt tokens per second over the long window equal to what the
  test posted (not twice it).

Per caller and replica (``vllm_cache_target_prompt_tokens_total``, the ``caller_target``
collapse alert) is checked only when the exporter serves those counters and the rules have
that alert: then agent-a's per-replica alert must fire for the collapsed replica only.

Windows are short (the monitoring config below), every scrape, evaluation and remote write
runs each second; the simulators run in real time. 72-76 s measured for the run, plus about
5 s to stop the processes (agents first, while the stores take their last writes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from exporter.monitoring.config import MonitoringConfig, config_from_mapping
from exporter.monitoring.render import ALERTS_PATH, prometheus_files
from exporter.monitoring.rules import Names
from exporter.sim import scenario as scenarios
from exporter.sim.client import HttpClient
from exporter.sim.clock import SimClock
from exporter.sim.driver import Driver
from exporter.sim.report import HttpReporter
from tests.monitoring.fleet import JOB, Stores, start_agent, start_stores, stop_agents
from tests.monitoring.test_e2e_alerts import (
    Processes,
    exporter_command,
    free_port,
    wait_http_ok,
)

pytestmark = pytest.mark.e2e

SCENARIO = Path(__file__).with_name("fleet-replicas.yaml")
MODEL = "qwen3.8-27b"
REPLICAS = 3
GATEWAYS = 3
COLLAPSING = REPLICAS - 1  # the replica agent-c moves into
SPLIT = 0  # the replica whose agent-b usage is split request by request
COLLAPSING_POOL_TOKENS = 60_000
CLUSTER = "a"
FLEET_RULES = {
    "short_window": "15s",
    "long_window": "1m",
    "baseline_window": "10m",
    "rule_interval": "1s",
    "caller_interval": "1s",
    "caller_detail_interval": "1s",
    "caller_long_interval": "1s",
    "collapse_for": "5s",
    "collapse_keep_firing_for": "30s",
    # agent-b is one conversation of four: a third of the turns misread is the signal here
    "unseen_history_share": 0.1,
    "unseen_history_min_requests": 5.0,
    "unseen_history_for": "2s",
}
DEADLINE = 120.0  # seconds for each condition the stores must reach
# The long-window rate is compared with the tokens posted once this much traffic has flowed.
SUM_AFTER = 70.0
SUM_TOLERANCE = 0.15  # Prometheus extrapolates; the HA pair's copies summed would be +100%
# Per caller and replica: the counter the exporter serves, and the alert's scope.
TARGET_COUNTER = "vllm_cache_target_prompt_tokens_total"
CALLER_TARGET_SCOPE = "caller_target"


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        stop_agents(procs)
        procs.stop_all()


# --- the balancer in front of the gateway exporters --------------------------------------------


class Gateways:
    """Sends each usage event to one gateway exporter: by session (sticky) or in turn (not),
    and keeps what was posted, per caller, for the sums the stores are held to."""

    def __init__(self, addresses: list[str]) -> None:
        self.reporters = [HttpReporter(f"http://{address}") for address in addresses]
        self.turn = itertools.count()
        self.posted: list[tuple[float, str, int]] = []  # (unix time, caller, prompt tokens)

    def route(self, event: dict[str, Any], sticky: bool) -> None:
        if sticky:
            index = zlib.crc32(str(event.get("session")).encode()) % len(self.reporters)
        else:
            index = next(self.turn) % len(self.reporters)
        if isinstance(event.get("prompt_tokens"), int):
            self.posted.append((time.time(), event["caller"], event["prompt_tokens"]))
        self.reporters[index].report(event)

    def prompt_rate(self, caller: str, start: float, end: float) -> float:
        tokens = sum(n for when, who, n in self.posted if who == caller and start < when <= end)
        return tokens / (end - start)

    async def close(self) -> None:
        for reporter in self.reporters:
            await reporter.close(flush_seconds=2.0)


class ReplicaReporter:
    """A driver's reporter for one replica: each event names that replica (``backend``) and
    gets a session id of the balancer's (the drivers of different replicas number their
    sessions alike)."""

    def __init__(self, gateways: Gateways, replica: int, backend: str, sticky: bool) -> None:
        self.gateways = gateways
        self.replica = replica
        self.backend = backend
        self.sticky = sticky

    def report(self, event: dict[str, Any]) -> None:
        session = f"replica-{self.replica}/{event.get('session', '')}"
        self.gateways.route(dict(event, backend=self.backend, session=session), self.sticky)

    async def close(self) -> None:
        return None


class Traffic:
    """The drivers the test starts, one per (replica, agent)."""

    def __init__(self, gateways: Gateways, replicas: list[str]) -> None:
        self.scenario = scenarios.load(str(SCENARIO))
        self.gateways = gateways
        self.replicas = replicas
        self.clients: list[HttpClient] = []
        self.tasks: list[asyncio.Task[Any]] = []

    def start(self, caller: str, replica: int, sticky: bool = True) -> None:
        agents = tuple(agent for agent in self.scenario.agents if agent.caller == caller)
        backend = f"http://{self.replicas[replica]}"
        client = HttpClient(backend, timeout=60.0)
        driver = Driver(
            dataclasses.replace(self.scenario, agents=agents),
            client,
            ReplicaReporter(self.gateways, replica, backend, sticky),
            SimClock(1.0),
            MODEL,
            seed=len(self.tasks) * 1000,
        )
        self.clients.append(client)
        self.tasks.append(asyncio.create_task(driver.run()))

    def assert_running(self) -> None:
        for task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise AssertionError(f"a driver failed: {task.exception()!r}")

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for client in self.clients:
            await client.close()
        await self.gateways.close()


# --- reading the stores ------------------------------------------------------------------------


async def query(
    session: aiohttp.ClientSession, store: str, expr: str, at: float | None = None
) -> list[dict[str, Any]]:
    data = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    async with session.post(f"http://{store}/api/v1/query", data=data) as response:
        body = await response.json(content_type=None)
    assert body["status"] == "success", (store, expr, body)
    return body["data"]["result"]


def by(label: str, results: list[dict[str, Any]]) -> dict[str, float]:
    return {item["metric"].get(label, ""): float(item["value"][1]) for item in results}


async def firing(session: aiohttp.ClientSession, evaluator: str, name: str) -> list[dict[str, str]]:
    """The labels of every firing alert ``name`` an evaluator (Prometheus, vmalert) holds."""
    async with session.get(f"http://{evaluator}/api/v1/alerts") as response:
        body = await response.json(content_type=None)
    return [
        alert["labels"]
        for alert in body["data"]["alerts"]
        if alert["labels"].get("alertname") == name and alert.get("state") == "firing"
    ]


async def served(session: aiohttp.ClientSession, exporter: str) -> str:
    async with session.get(f"http://{exporter}/metrics") as response:
        return await response.text()


def sample_sum(text: str, name: str) -> float:
    return sum(
        float(value) for value in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    )


async def until(
    what: str,
    probe: Callable[[], Awaitable[tuple[bool, Any]]],
    processes: Processes,
    traffic: Traffic,
) -> Any:
    """Poll ``probe`` (no event crosses a process boundary) until it holds; what it saw."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        done, seen = await probe()
        if done:
            return seen
        processes.assert_alive()
        traffic.assert_running()
        if loop.time() > deadline:
            raise AssertionError(f"{what}: last seen {seen}\n{processes.logs()}")
        await asyncio.sleep(1.0)


# --- the test ----------------------------------------------------------------------------------


async def test_one_replica_collapses_in_prometheus_and_victoriametrics(
    tmp_path: Path, processes: Processes
) -> None:
    config = config_from_mapping(FLEET_RULES, source="fleet-replicas")
    stores = start_stores(processes, tmp_path, config)
    replicas = [f"127.0.0.1:{free_port()}" for _ in range(REPLICAS)]
    sidecars = [f"127.0.0.1:{free_port()}" for _ in range(REPLICAS)]
    gateways = [f"127.0.0.1:{free_port()}" for _ in range(GATEWAYS)]
    targets = [f"http://{replica}/metrics" for replica in replicas]
    for index, (replica, sidecar) in enumerate(zip(replicas, sidecars, strict=True)):
        pool = ["--sim.kv-pool-tokens", str(COLLAPSING_POOL_TOKENS)] if index == COLLAPSING else []
        processes.start(
            f"replica-{index}",
            *exporter_command(
                "simulate",
                "--scenario",
                str(SCENARIO),
                *pool,
                "--sim.listen-address",
                replica,
                "--log.level",
                "warning",
            ),
        )
        processes.start(
            f"sidecar-{index}",
            *exporter_command(
                "run",
                "--vllm.url",
                f"http://{replica}",
                "--web.listen-address",
                sidecar,
                "--log.level",
                "warning",
            ),
        )
    for index, gateway in enumerate(gateways):
        processes.start(
            f"gateway-{index}",
            *exporter_command("run", "--web.listen-address", gateway, "--log.level", "warning"),
        )
    agents = [
        start_agent(
            processes,
            tmp_path,
            stores,
            replica_label,
            [*sidecars, *gateways],
            {"cluster": CLUSTER, "prometheus_replica": replica_label},
        )
        for replica_label in ("r1", "r2")
    ]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        await stores.wait_ready(session, processes)
        for agent in agents:
            await wait_http_ok(session, f"http://{agent}/-/ready", processes)
        for exporter in (*sidecars, *gateways):
            await wait_http_ok(session, f"http://{exporter}/-/ready", processes)
        for replica in replicas:
            await wait_http_ok(session, f"http://{replica}/v1/models", processes)

        traffic = Traffic(Gateways(gateways), replicas)
        try:
            await play(session, stores, config, traffic, processes, sidecars, gateways, targets)
        finally:
            await traffic.stop()


async def play(
    session: aiohttp.ClientSession,
    stores: Stores,
    config: MonitoringConfig,
    traffic: Traffic,
    processes: Processes,
    sidecars: list[str],
    gateways: list[str],
    targets: list[str],
) -> None:
    names = Names(config)
    selector = f'{{job="{JOB}"}}'
    both = (stores.central, stores.victoria)
    evaluators = {"central Prometheus": stores.central, "vmalert": stores.vmalert}

    # Phase one: agent-a warm on every replica, its usage sticky by session.
    started = time.time()
    for replica in range(REPLICAS):
        traffic.start("agent-a", replica)
    baseline = names.target_hit_ratio[names.baseline] + selector
    for store in both:

        async def baselines(store: str = store) -> tuple[bool, Any]:
            found = by("target", await query(session, store, baseline))
            share = by("model", await query(session, store, names.model_unseen_share + selector))
            turns = by("model", await query(session, store, names.model_turns + selector))
            done = (
                set(found) == set(targets)
                and all(value > 0.5 for value in found.values())
                and turns.get(MODEL, 0) > 0
                and share.get(MODEL) == 0
            )
            return done, {"baseline": found, "unseen share": share, "turns/s": turns}

        await until(f"{store}: every replica's baseline", baselines, processes, traffic)
    # Sticky by session: every turn so far is explained by what its gateway saw.
    texts = [await served(session, gateway) for gateway in gateways]
    assert sum(sample_sum(text, "vllm_cache_conversation_turns_total") for text in texts) >= 10
    assert sum(sample_sum(text, "vllm_cache_unseen_history_requests_total") for text in texts) == 0

    # Phase two: agent-c moves into the last replica; agent-b's usage is split by request.
    traffic.start("agent-c", COLLAPSING)
    traffic.start("agent-b", SPLIT, sticky=False)
    collapsed = targets[COLLAPSING]
    for where, evaluator in evaluators.items():

        async def collapse(evaluator: str = evaluator) -> tuple[bool, Any]:
            """The engine's collapse and agent-a's on the collapsed replica, both firing:
            the latter reads rules recorded every caller_detail_interval from usage
            reported at each turn's end, so it may fire a few evaluations later."""
            labels = await firing(session, evaluator, "VllmCachePrefixCollapse")
            engine = [alert for alert in labels if alert.get("scope") == "engine"]
            mine = [
                alert
                for alert in labels
                if alert.get("scope") == CALLER_TARGET_SCOPE and alert.get("caller") == "agent-a"
            ]
            return bool(engine) and bool(mine), labels

        async def unseen(evaluator: str = evaluator) -> tuple[bool, Any]:
            labels = await firing(session, evaluator, "VllmCacheUnseenHistory")
            return bool(labels), labels

        alerts = await until(f"{where}: the collapse", collapse, processes, traffic)
        engine = [alert for alert in alerts if alert.get("scope") == "engine"]
        assert [alert["target"] for alert in engine] == [collapsed], alerts
        assert engine[0]["cluster"] == CLUSTER
        assert "prometheus_replica" not in engine[0]
        split = await until(f"{where}: the split flagged", unseen, processes, traffic)
        assert [(alert["model"], alert["cluster"]) for alert in split] == [(MODEL, CLUSTER)]
        assert "prometheus_replica" not in split[0]
    texts = [await served(session, gateway) for gateway in gateways]
    assert sum(sample_sum(text, "vllm_cache_unseen_history_requests_total") for text in texts) > 0

    # The other replicas never collapsed, not even pending, in either store; nor agent-a as a
    # whole (two warm replicas of three keep its combined ratio above half its baseline).
    history = 'max_over_time(ALERTS{alertname="VllmCachePrefixCollapse"}[10m])'
    per_replica = await caller_target_checked(session, config, gateways)
    for store in both:

        async def stored(store: str = store) -> tuple[bool, Any]:
            """The firing alerts in the store's ALERTS series: vmalert's reach VictoriaMetrics
            by remote write (flushed each second, then searchable), after its API says firing."""
            ever = [item["metric"] for item in await query(session, store, history)]
            states = {
                (alert.get("caller", ""), alert["scope"], alert.get("target"), alert["alertstate"])
                for alert in ever
            }
            wanted = {("", "engine", collapsed, "firing")}
            if per_replica:
                wanted.add(("agent-a", CALLER_TARGET_SCOPE, collapsed, "firing"))
            return wanted <= states, ever

        ever = await until(f"{store}: the firing alerts stored", stored, processes, traffic)
        seen = {(alert["scope"], alert.get("target"), alert["alertstate"]) for alert in ever}
        assert ("engine", collapsed, "firing") in seen, (store, ever)
        assert {(scope, target) for scope, target, _ in seen} <= {
            ("engine", collapsed),
            (CALLER_TARGET_SCOPE, collapsed),
        }, (store, ever)
        if per_replica:  # agent-a's alert for the collapsed replica, and no other caller's
            mine = {
                (alert["caller"], alert["target"], alert["alertstate"])
                for alert in ever
                if alert["scope"] == CALLER_TARGET_SCOPE
            }
            assert ("agent-a", collapsed, "firing") in mine, (store, ever)
            assert {(caller, target) for caller, target, _ in mine} == {("agent-a", collapsed)}

    # Absolute figures, with two copies of every series stored: counted once.
    budget_name = "vllm_cache_engine_admission_budget_tokens"
    budgets = {
        target: sample_sum(await served(session, sidecar), budget_name)
        for target, sidecar in zip(targets, sidecars, strict=True)
    }
    copies = f"count by (target) ({budget_name}{selector})"
    for store in both:
        assert by("target", await query(session, store, copies)) == dict.fromkeys(targets, 2.0)
        recorded = by("target", await query(session, store, names.target_budget + selector))
        assert recorded == budgets, store
    window = config.long_seconds
    prompt_rate = names.caller_prompt[names.long] + f'{{job="{JOB}", caller="agent-a"}}'
    for store in both:

        async def prompt_sum(store: str = store) -> tuple[bool, Any]:
            at = time.time() - 5.0
            if at - window < started + 5.0:
                return False, "not a whole window of traffic yet"
            found = by("cluster", await query(session, store, prompt_rate, at))
            truth = traffic.gateways.prompt_rate("agent-a", at - window - 1.0, at - 1.0)
            value = found.get(CLUSTER, 0.0)
            return abs(value / truth - 1) < SUM_TOLERANCE, {"recorded": found, "posted": truth}

        await until(f"{store}: agent-a's prompt tokens/s", prompt_sum, processes, traffic)


async def caller_target_checked(
    session: aiohttp.ClientSession, config: MonitoringConfig, gateways: list[str]
) -> bool:
    """Whether per caller and replica is there to check: the gateways serve the counters (the
    usage event's ``backend``) and the rules have the ``caller_target`` collapse alert. Both
    are the product's now: their absence is a failure, not a check skipped."""
    texts = [await served(session, gateway) for gateway in gateways]
    assert any(TARGET_COUNTER in text for text in texts), "no gateway serves " + TARGET_COUNTER
    alerts = prometheus_files(config)[ALERTS_PATH]
    assert f"scope: {CALLER_TARGET_SCOPE}" in alerts, "no caller_target collapse alert"
    return True
