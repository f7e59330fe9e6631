"""A scriptable stand-in for vLLM's /metrics endpoint, and the exporter pointed at it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from exporter.config import Config
from exporter.server import create_app

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


class FakeVllm:
    """Serves whatever the test sets: a body, a status, or a hang."""

    def __init__(self) -> None:
        self.body = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")
        self.status = 200
        self.hang = False
        self.requests = 0
        self.release = asyncio.Event()

    async def handle(self, _request: web.Request) -> web.Response:
        self.requests += 1
        if self.hang:
            await self.release.wait()
        return web.Response(status=self.status, text=self.body,
                            content_type="text/plain", charset="utf-8")


@pytest.fixture
async def fake_vllm(aiohttp_server: Callable[..., Awaitable[TestServer]]):
    fake = FakeVllm()
    app = web.Application()
    app.router.add_get("/metrics", fake.handle)
    server = await aiohttp_server(app)
    fake.url = str(server.make_url("/metrics"))  # type: ignore[attr-defined]
    yield fake
    fake.release.set()


ExporterFactory = Callable[..., Awaitable[TestClient]]


@pytest.fixture
def exporter_for(aiohttp_client: Callable[..., Awaitable[TestClient]]) -> ExporterFactory:
    """Start the exporter's app for the given vLLM URLs (no background first read)."""

    async def start(*urls: str, **overrides: object) -> TestClient:
        config = Config(vllm_url=tuple(urls), **overrides)  # type: ignore[arg-type]
        return await aiohttp_client(create_app(config, initial_refresh=False))

    return start


async def scrape(client: TestClient, headers: dict[str, str] | None = None) -> str:
    response = await client.get("/metrics", headers=headers or {})
    assert response.status == 200
    return await response.text()


def samples(text: str) -> dict[str, float]:
    """Exposition -> {'name{labels}': value} with labels as printed (sorted by client_python)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    """Value of the one sample with this name whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None
