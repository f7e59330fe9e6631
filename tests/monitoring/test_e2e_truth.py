"""Every request counted by rate() and increase(), in a real Prometheus and in its HA twin.

An exporter with a short new-series hold is scraped every second by two Prometheus servers
at different phases (an HA pair, told apart by their external labels), both loading the
committed recording rules. A caller nobody has seen sends one cold turn and five warm ones.
On both servers, ``increase()`` over the whole run, evaluated at the last scrape, gives
exactly 1 cold and 5 warm, and the recorded hit ratio is what was sent.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from exporter.monitoring.config import MonitoringConfig, duration_seconds
from tests.monitoring.common import ALERTS_DIR, require_tool
from tests.monitoring.test_e2e_alerts import (
    JOB,
    Processes,
    free_port,
    instant_query,
    poll_until,
    processes,  # noqa: F401 (fixture)
    wait_http_ok,
)

pytestmark = [pytest.mark.e2e, pytest.mark.new_series_hold]

HOLD_SECONDS = 3  # three scrapes of each server at zero before the counts show
MODEL = "qwen3.8-27b"
# (prompt, cached): the first turn cold, then the conversation grows and stays cached.
TURNS = [(60_000, 0)] + [(60_000 + 2_500 * turn, 57_344 + 2_048 * turn) for turn in range(1, 6)]


def prometheus_config(exporter: str, replica: str) -> dict[str, Any]:
    return {
        "global": {
            "scrape_interval": "1s",
            "evaluation_interval": "1s",
            "external_labels": {"replica": replica},
        },
        "rule_files": [str(ALERTS_DIR / "vllm-cache-rules.yaml")],
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [exporter]}]}],
    }


async def query_at(
    session: aiohttp.ClientSession, prometheus: str, expr: str, time: float
) -> list[dict[str, Any]]:
    async with session.post(
        f"http://{prometheus}/api/v1/query", data={"query": expr, "time": repr(time)}
    ) as response:
        body = await response.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


async def test_both_replicas_count_every_turn_of_a_new_caller(
    tmp_path: Path,
    processes: Processes,  # noqa: F811
) -> None:
    prometheus_bin = require_tool("prometheus")
    exporter = f"127.0.0.1:{free_port()}"
    servers = {replica: f"127.0.0.1:{free_port()}" for replica in ("a", "b")}
    processes.start(
        "exporter",
        sys.executable,
        "-m",
        "exporter",
        "run",
        "--web.listen-address",
        exporter,
        "--log.level",
        "warning",
        "--usage.new-series-hold",
        str(HOLD_SECONDS),
        "--signals.granularity",
        "2048",
    )
    for replica, address in servers.items():
        config = tmp_path / f"prometheus-{replica}.yml"
        config.write_text(yaml.safe_dump(prometheus_config(exporter, replica)), "utf-8")
        processes.start(
            f"prometheus-{replica}",
            prometheus_bin,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / f'data-{replica}'}",
            f"--web.listen-address={address}",
        )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        await wait_http_ok(session, f"http://{exporter}/-/healthy", processes)
        for address in servers.values():
            await wait_http_ok(session, f"http://{address}/-/ready", processes)
            await poll_until(
                session, address, processes, f'count_over_time(up{{job="{JOB}"}}[1m]) >= 2'
            )
        events = [
            {
                "caller": "fresh-agent",
                "model": MODEL,
                "session": "conv-1",
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "ttft_seconds": 1.0,
            }
            for prompt, cached in TURNS
        ]
        async with session.post(f"http://{exporter}/v1/usage", json=events) as response:
            assert (await response.json())["accepted"] == len(TURNS)
        selector = f'job="{JOB}", caller="fresh-agent", model="{MODEL}"'
        for address in servers.values():
            await poll_until(
                session,
                address,
                processes,
                f'vllm_cache_requests_total{{{selector}, state="warm"}} == 5',
            )
            # Two more scrapes (and rule evaluations) after the final values arrived.
            await poll_until(
                session,
                address,
                processes,
                f"min_over_time(vllm_cache_requests_total{{{selector}, "
                f'state="warm"}}[2500ms]) == 5',
            )
        sent_ratio = sum(cached for _, cached in TURNS) / sum(prompt for prompt, _ in TURNS)
        for replica, address in servers.items():
            # Evaluated at the last scrape, so that nothing is extrapolated past the data.
            stamp = await instant_query(
                session,
                address,
                f'timestamp(vllm_cache_requests_total{{{selector}, state="warm"}})',
            )
            last = float(stamp[0]["value"][1])
            seen_at_zero = await query_at(
                session,
                address,
                (f'min_over_time(vllm_cache_requests_total{{{selector}, state="cold"}}[10m])'),
                last,
            )
            assert seen_at_zero and float(seen_at_zero[0]["value"][1]) == 0, replica
            for state_name, expected in (("cold", 1), ("warm", 5), ("partial", 0)):
                result = await query_at(
                    session,
                    address,
                    (
                        f"increase(vllm_cache_requests_total{{{selector}, "
                        f'state="{state_name}"}}[10m])'
                    ),
                    last,
                )
                assert float(result[0]["value"][1]) == pytest.approx(expected, abs=1e-9), (
                    replica,
                    state_name,
                    result,
                )
            ratio = await poll_ratio(session, address, processes, last)
            assert ratio == pytest.approx(sent_ratio, rel=0.01), (replica, ratio, sent_ratio)


async def poll_ratio(
    session: aiohttp.ClientSession, address: str, started: Processes, after: float
) -> float:
    """The recorded 1h hit ratio of the first rule evaluation after ``after`` (the last
    scrape), which has seen every turn: its group runs every caller_long_interval."""
    recorded = 'caller_model:vllm_cache_hit_ratio:rate1h{caller="fresh-agent"}'
    expr = f"{recorded} and timestamp({recorded}) > {after!r}"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration_seconds(MonitoringConfig().caller_long_interval) + 30
    while True:
        result = await instant_query(session, address, expr)
        if result:
            return float(result[0]["value"][1])
        started.assert_alive()
        assert loop.time() < deadline, f"no {expr}\n{started.logs()}"
        await asyncio.sleep(0.5)
