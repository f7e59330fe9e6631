"""The HTTP surface: landing page, health, readiness, content negotiation."""

from __future__ import annotations

import asyncio

from exporter import __version__
from exporter.config import Config
from exporter.server import FIRST_READ_KEY, create_app
from tests.helpers import scrape, value


async def test_landing_page_links_and_version(aiohttp_client):
    client = await aiohttp_client(create_app(Config(), initial_refresh=False))
    response = await client.get("/")
    page = await response.text()
    assert response.status == 200
    assert __version__ in page
    for link in ("/metrics", "/-/healthy", "/-/ready"):
        assert f'href="{link}"' in page


async def test_ready_only_after_every_target_was_tried(aiohttp_client, unused_tcp_port):
    dead = f"http://127.0.0.1:{unused_tcp_port}/metrics"
    client = await aiohttp_client(create_app(Config(vllm_url=(dead,)), initial_refresh=False))
    assert (await client.get("/-/healthy")).status == 200
    not_ready = await client.get("/-/ready")
    assert not_ready.status == 503
    assert dead in await not_ready.text()
    await scrape(client)  # the target fails once: that is enough to be ready
    assert (await client.get("/-/ready")).status == 200


async def test_first_read_starts_on_startup(aiohttp_client, unused_tcp_port):
    dead = f"http://127.0.0.1:{unused_tcp_port}/metrics"
    app = create_app(Config(vllm_url=(dead,)))
    client = await aiohttp_client(app)
    await asyncio.wait_for(app[FIRST_READ_KEY], timeout=10)
    assert (await client.get("/-/ready")).status == 200


async def test_no_targets_is_ready_and_serves_self_metrics(aiohttp_client):
    client = await aiohttp_client(create_app(Config(), initial_refresh=False))
    assert (await client.get("/-/ready")).status == 200
    text = await scrape(client)
    assert value(text, "vllm_cache_exporter_build_info", version=__version__) == 1


async def test_openmetrics_negotiation(aiohttp_client):
    client = await aiohttp_client(create_app(Config(), initial_refresh=False))
    response = await client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert response.headers["Content-Type"].startswith("application/openmetrics-text")
    assert (await response.text()).rstrip().endswith("# EOF")
