"""Fixtures for the simulator tests: scenarios played once per session in virtual time, and
an exporter that reads a simulator's final /metrics and ingests a run's usage events."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from exporter.config import Config
from exporter.server import create_app
from exporter.sim import scenario as scenarios
from exporter.sim.virtual import VirtualRun, play

_RUNS: dict[str, VirtualRun] = {}


def played(name: str) -> VirtualRun:
    """A shipped scenario, played once per test session (each costs well under a second)."""
    if name not in _RUNS:
        _RUNS[name] = play(scenarios.load(name))
    return _RUNS[name]


Phases = Sequence[Sequence[dict[str, Any]]]


@pytest.fixture
def through_exporter(aiohttp_server: Callable[..., Awaitable[TestServer]], aiohttp_client):
    """Feed a run to a real exporter app: vLLM's /metrics is the simulator's final scrape, the
    usage events are POSTed phase by phase, and the exporter's /metrics is read after each."""

    async def run(metrics_text: str, phases: Phases) -> list[str]:
        async def vllm_metrics(_request: web.Request) -> web.Response:
            return web.Response(text=metrics_text, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", vllm_metrics)
        vllm = await aiohttp_server(app)
        exporter = await aiohttp_client(
            create_app(Config(vllm_url=(str(vllm.make_url("/metrics")),)), initial_refresh=False)
        )
        # As at startup (initial_refresh): the engine is read before the first event, so the
        # classifier knows vLLM's block size from the start.
        assert (await exporter.get("/metrics")).status == 200
        scrapes = []
        for events in phases:
            if events:
                response = await exporter.post("/v1/usage", json=list(events))
                reply = await response.json()
                assert response.status == 200, reply
                assert reply["accepted"] == len(events) and reply["rejected"] == 0, reply
            metrics = await exporter.get("/metrics")
            assert metrics.status == 200
            scrapes.append(await metrics.text())
        return scrapes

    return run
