"""The aiohttp app: /metrics, /-/healthy, /-/ready, the landing page, and reader routes.

/metrics first awaits a fresh read of every vLLM target (bounded by our timeout and by
Prometheus' scrape timeout), then renders the registry in slices that leave the event loop
free between them (collectors never do I/O), in the text format or OpenMetrics as
negotiated, gzipped when asked: exporter.metrics.scrape (which shares the read and the body
between scrapes that arrive together) and exporter.metrics.exposition (byte-identical to
client_python's encoders, many times faster: docs/performance.md).
"""

from __future__ import annotations

import asyncio
import html
import logging
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from exporter import __version__
from exporter.config import Config
from exporter.engine.fetch import EnginePoller
from exporter.metrics import build_registry
from exporter.metrics.exposition import choose_format
from exporter.metrics.scrape import MetricsBodies, gzip_accepted
from exporter.signals.state import SignalsState

log = logging.getLogger(__name__)

STATE_KEY = web.AppKey("state", SignalsState)
POLLER_KEY = web.AppKey("poller", EnginePoller)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
CONFIG_KEY = web.AppKey("config", Config)
FIRST_READ_KEY = web.AppKey("first_read", asyncio.Task)
BODIES_KEY = web.AppKey("metrics_bodies", MetricsBodies)

# Extra route installers (usage ingest, status page parts): each gets the app after the
# core routes exist. Kept as a list so readers plug in without the server importing them.
RouteInstaller = Callable[[web.Application], None]


def _default_installers() -> list[RouteInstaller]:
    from exporter.usage.ingest import install_routes

    return [install_routes]


def create_app(config: Config, state: SignalsState | None = None,
               session_factory: Callable[[], aiohttp.ClientSession] | None = None,
               installers: list[RouteInstaller] | None = None,
               initial_refresh: bool = True) -> web.Application:
    state = state or SignalsState(config)
    poller = EnginePoller(state.engine, session_factory or _default_session,
                          timeout=config.vllm_timeout, max_bytes=config.vllm_max_body_bytes)
    app = web.Application(client_max_size=config.usage_ingest_max_body_bytes)
    app[STATE_KEY] = state
    app[POLLER_KEY] = poller
    app[REGISTRY_KEY] = build_registry(state)
    app[CONFIG_KEY] = config
    app[BODIES_KEY] = MetricsBodies(app[REGISTRY_KEY], state, poller.refresh)
    app.router.add_get("/", landing)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/-/healthy", healthy)
    app.router.add_get("/-/ready", ready)
    for install in installers if installers is not None else _default_installers():
        install(app)

    async def start_first_read(app: web.Application) -> None:
        if initial_refresh and state.engine.targets:
            app[FIRST_READ_KEY] = asyncio.ensure_future(poller.refresh())

    async def close(app: web.Application) -> None:
        task = app.get(FIRST_READ_KEY)
        if task is not None:
            task.cancel()
        await poller.close()

    app.on_startup.append(start_first_read)
    app.on_cleanup.append(close)
    return app


def _default_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=32, keepalive_timeout=30),
        headers={"User-Agent": f"vllm-cache-exporter/{__version__}"},
        auto_decompress=True,
    )


async def metrics(request: web.Request) -> web.Response:
    poller = request.app[POLLER_KEY]
    timeout = poller.effective_timeout(
        request.headers.get("X-Prometheus-Scrape-Timeout-Seconds"))
    fmt = choose_format(request.headers.get("Accept", ""))
    gzip = gzip_accepted(request.headers.get("Accept-Encoding", ""))
    # Reads vLLM, then renders (both shared with scrapes that arrive together).
    body = await request.app[BODIES_KEY].body(fmt, gzip, timeout)
    headers = {"Content-Type": fmt.content_type, "Vary": "Accept, Accept-Encoding"}
    if gzip:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, headers=headers)


async def healthy(_request: web.Request) -> web.Response:
    return web.Response(text="vllm-cache-exporter is healthy.\n")


async def ready(request: web.Request) -> web.Response:
    engine = request.app[STATE_KEY].engine
    if engine.ready:
        return web.Response(text="vllm-cache-exporter is ready.\n")
    waiting = [t for t, s in engine.targets.items() if not s.attempted]
    return web.Response(status=503, text="waiting for a first read of: " + ", ".join(waiting)
                        + "\n")


async def landing(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    rows = []
    for target, target_state in sorted(state.engine.targets.items()):
        status = "up" if target_state.up else ("down" if target_state.attempted else "not read yet")
        error = f" ({html.escape(target_state.last_error)})" if target_state.last_error else ""
        rows.append(f"<li><code>{html.escape(target)}</code>: {status}{error}</li>")
    targets = "\n".join(rows) or "<li>none configured (--vllm.url)</li>"
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>vllm-cache-exporter</title></head>
<body>
<h1>vllm-cache-exporter {html.escape(__version__)}</h1>
<p>Is vLLM's prefix cache doing its job, and for whom.</p>
<ul>
<li><a href="/metrics">/metrics</a></li>
<li><a href="/-/healthy">/-/healthy</a></li>
<li><a href="/-/ready">/-/ready</a></li>
</ul>
<h2>vLLM targets</h2>
<ul>
{targets}
</ul>
</body></html>
"""
    return web.Response(text=page, content_type="text/html")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
