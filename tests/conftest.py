"""Fixtures shared by every test package: a fake vLLM /metrics and the exporter app."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from exporter.config import Config
from exporter.server import create_app
from tests.helpers import FakeVllm


@pytest.fixture
async def fake_vllm(aiohttp_server: Callable[..., Awaitable[TestServer]]):
    fake = FakeVllm()
    app = web.Application()
    app.router.add_get("/metrics", fake.handle)
    server = await aiohttp_server(app)
    fake.url = str(server.make_url("/metrics"))
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
