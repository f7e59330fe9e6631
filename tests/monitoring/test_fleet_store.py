"""A fleet's store, for real: Prometheus agents remote-writing into a central Prometheus that
evaluates the generated rules, and into VictoriaMetrics, where vmalert evaluates the
``generate --format vmalert`` variant of the same rules.

- cluster a: one exporter scraped by an HA pair of agents (external labels ``cluster: a`` and
  ``prometheus_replica: r1`` / ``r2``), so the store holds each of its series twice;
- cluster b: one exporter, one agent (``cluster: b``), the same caller and model as in a;
- both exporters read the same simulated vLLM (one process, its pool idle), and a's also reads
  an address where nothing answers, so that ``VllmCacheEngineDown`` fires for it.

The test posts the same usage to both exporters, one record a second: agent-a with 80% of its
prompt cached in cluster a, 20% in cluster b. It then requires, in both stores: the admission
budget recorded for a's vLLM equal to the one its exporter serves (not twice it, though two
copies of the series are stored); agent-a's hit ratio 0.8 in a and 0.2 in b (two series, the
clusters never summed); agent-a's 10,000 prompt tokens/s in each (not 20,000 in a); and one
VllmCacheEngineDown, carrying ``cluster="a"`` and no replica label, from the central
Prometheus and from vmalert alike. VictoriaMetrics' rate() does not extrapolate, so its rates
are held to the true figure within the same 15% as Prometheus'; its budget and ratios are the
same.

Windows are short (``generate`` with the test's config), every scrape, evaluation and remote
write runs each second, so the whole takes about a minute (62 s measured, processes started
and stopped).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from exporter.monitoring.config import config_from_mapping
from tests.monitoring.fleet import JOB, start_agent, start_stores, stop_agents
from tests.monitoring.test_e2e_alerts import (
    Processes,
    exporter_command,
    free_port,
    instant_query,
    wait_http_ok,
)

pytestmark = pytest.mark.e2e

FLEET_RULES = {
    "short_window": "15s",
    "long_window": "2m",
    "baseline_window": "10m",
    "rule_interval": "1s",
    "caller_interval": "1s",
    "caller_detail_interval": "1s",
    "caller_long_interval": "1s",
    "engine_down_for": "2s",
}
PROMPT = 10_000  # agent-a's prompt tokens per request, one request a second per cluster
CACHED = {"a": 8_000, "b": 2_000}  # agent-a's cached tokens per request, by cluster
DEADLINE = 90.0  # seconds for the stores to hold every figure


@pytest.fixture
def processes(tmp_path: Path):  # type: ignore[no-untyped-def]
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        stop_agents(procs)
        procs.stop_all()


async def post_turns(session: aiohttp.ClientSession, exporters: dict[str, str]) -> None:
    """One agent-a turn a second to each cluster's exporter, until cancelled."""
    while True:
        for cluster, address in exporters.items():
            async with session.post(
                f"http://{address}/v1/usage",
                json={
                    "caller": "agent-a",
                    "model": "qwen3.8-27b",
                    "prompt_tokens": PROMPT,
                    "cached_tokens": CACHED[cluster],
                    "completion_tokens": 200,
                },
            ) as response:
                assert response.status < 300, await response.text()
        await asyncio.sleep(1.0)


async def served_budget(session: aiohttp.ClientSession, exporter: str) -> float:
    async with session.get(f"http://{exporter}/metrics") as response:
        text = await response.text()
    values = re.findall(r"^vllm_cache_engine_admission_budget_tokens\{[^}]*\} (\S+)$", text, re.M)
    assert len(values) == 1, text[:2000]
    return float(values[0])


def by_cluster(results: list[dict[str, Any]]) -> dict[str, float]:
    return {item["metric"].get("cluster", ""): float(item["value"][1]) for item in results}


async def figures(session: aiohttp.ClientSession, store: str) -> dict[str, dict[str, float]]:
    """The recorded figures the test holds a store to, each by cluster."""
    queries = {
        "budget": f'target_model:vllm_cache_admission_budget_tokens:min7d{{job="{JOB}"}}',
        "copies": f'count by (cluster) (vllm_cache_engine_admission_budget_tokens{{job="{JOB}"}})',
        "ratio": f'caller_model:vllm_cache_hit_ratio:rate15s{{job="{JOB}", caller="agent-a"}}',
        "prompt": f'caller_model:vllm_cache_prompt_tokens:rate15s{{job="{JOB}", caller="agent-a"}}',
    }
    found = {}
    for name, expr in queries.items():
        found[name] = by_cluster(await instant_query(session, store, expr))
    return found


def settled(found: dict[str, dict[str, float]], budget: float) -> bool:
    ratio, prompt = found["ratio"], found["prompt"]
    return (
        found["copies"] == {"a": 2, "b": 1}
        and set(found["budget"]) == {"a", "b"}
        and set(ratio) == {"a", "b"}
        and set(prompt) == {"a", "b"}
        and abs(ratio["a"] - 0.8) < 0.01
        and abs(ratio["b"] - 0.2) < 0.01
        and all(abs(prompt[cluster] / PROMPT - 1) < 0.15 for cluster in ("a", "b"))
        and found["budget"]["a"] == budget
    )


async def wait_settled(
    session: aiohttp.ClientSession, store: str, budget: float, processes: Processes
) -> dict[str, dict[str, float]]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        found = await figures(session, store)
        if settled(found, budget):
            return found
        processes.assert_alive()
        if loop.time() > deadline:
            raise AssertionError(f"{store}: {found} (budget {budget})\n{processes.logs()}")
        await asyncio.sleep(1.0)


def engine_down(alerts: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [
        alert["labels"]
        for alert in alerts
        if alert["labels"].get("alertname") == "VllmCacheEngineDown"
        and alert.get("state") == "firing"
    ]


async def firing_engine_down(
    session: aiohttp.ClientSession, url: str, processes: Processes
) -> list[dict[str, str]]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        async with session.get(url) as response:
            body = await response.json()
        labels = engine_down(body["data"]["alerts"])
        if labels:
            return labels
        processes.assert_alive()
        assert loop.time() < deadline, f"{url}: {body}\n{processes.logs()}"
        await asyncio.sleep(1.0)


async def test_an_ha_pair_and_two_clusters_in_prometheus_and_victoriametrics(
    tmp_path: Path, processes: Processes
) -> None:
    config = config_from_mapping(FLEET_RULES, source="fleet")
    stores = start_stores(processes, tmp_path, config)
    addr = {name: f"127.0.0.1:{free_port()}" for name in ("sim", "exp-a", "exp-b", "dead")}
    processes.start(
        "simulator",
        *exporter_command(
            "simulate",
            "--scenario",
            "two-agents-fit",
            "--sim.listen-address",
            addr["sim"],
            "--log.level",
            "warning",
        ),
    )
    for cluster in ("a", "b"):
        dead = ["--vllm.url", f"http://{addr['dead']}"] if cluster == "a" else []
        processes.start(
            f"exporter-{cluster}",
            *exporter_command(
                "run",
                "--vllm.url",
                f"http://{addr['sim']}",
                *dead,
                "--web.listen-address",
                addr[f"exp-{cluster}"],
                "--log.level",
                "warning",
            ),
        )
    agents = {
        "a-r1": ("exp-a", {"cluster": "a", "prometheus_replica": "r1"}),
        "a-r2": ("exp-a", {"cluster": "a", "prometheus_replica": "r2"}),
        "b": ("exp-b", {"cluster": "b"}),
    }
    for name, (exporter, labels) in agents.items():
        addr[name] = start_agent(processes, tmp_path, stores, name, [addr[exporter]], labels)
    addr["central"], addr["vm"], addr["vmalert"] = stores.central, stores.victoria, stores.vmalert

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        await stores.wait_ready(session, processes)
        for name in ("a-r1", "a-r2", "b"):
            await wait_http_ok(session, f"http://{addr[name]}/-/ready", processes)
        for cluster in ("a", "b"):
            await wait_http_ok(session, f"http://{addr[f'exp-{cluster}']}/-/ready", processes)
        traffic = asyncio.create_task(
            post_turns(session, {cluster: addr[f"exp-{cluster}"] for cluster in ("a", "b")})
        )
        try:
            budget = await served_budget(session, addr["exp-a"])
            central = await wait_settled(session, addr["central"], budget, processes)
            victoria_found = await wait_settled(session, addr["vm"], budget, processes)
            central_down = await firing_engine_down(
                session, f"http://{addr['central']}/api/v1/alerts", processes
            )
            vmalert_down = await firing_engine_down(
                session, f"http://{addr['vmalert']}/api/v1/alerts", processes
            )
        finally:
            traffic.cancel()

    # The HA pair's two copies are stored, and counted once: the budget is the exporter's.
    assert central["copies"]["a"] == 2
    assert central["budget"] == victoria_found["budget"] == {"a": budget, "b": budget}
    # The same caller in two clusters: two ratios, each its own cluster's.
    for found in (central, victoria_found):
        assert found["ratio"]["a"] == pytest.approx(0.8, abs=0.01)
        assert found["ratio"]["b"] == pytest.approx(0.2, abs=0.01)
    # 10,000 prompt tokens/s in each cluster (one request a second), in both stores: the HA
    # pair's copies are not summed (20,000), and VictoriaMetrics' rate (no extrapolation)
    # agrees with Prometheus' within a few percent.
    for found in (central, victoria_found):
        for cluster in ("a", "b"):
            assert found["prompt"][cluster] == pytest.approx(PROMPT, rel=0.15)
    # One alert for the dead vLLM, in cluster a, from both evaluators: the HA copies folded.
    for labels in (central_down, vmalert_down):
        assert len(labels) == 1, labels
        assert labels[0]["cluster"] == "a"
        assert labels[0]["target"] == f"http://{addr['dead']}/metrics"
        assert "prometheus_replica" not in labels[0]
