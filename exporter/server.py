"""The aiohttp app: /metrics, /-/healthy, /-/ready, the status page (/), and POST /v1/usage.

/metrics first awaits a fresh read of every vLLM target (bounded by our timeout and by
Prometheus' scrape timeout), then renders the registry in slices that leave the event loop
free between them (collectors never do I/O), in the text format or OpenMetrics as
negotiated, gzipped when asked: exporter.metrics.scrape (which shares the read and the body
between scrapes that arrive together) and exporter.metrics.exposition (byte-identical to
client_python's encoders, many times faster: docs/performance.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from exporter import __version__, page, wiring
from exporter.config import Config
from exporter.engine.fetch import EnginePoller
from exporter.limits import SendStats, SendStatsCollector
from exporter.metrics import build_registry
from exporter.metrics.exposition import choose_format
from exporter.metrics.scrape import MetricsBodies, gzip_accepted
from exporter.monitoring.config import MonitoringConfig, load_config
from exporter.signals import status
from exporter.signals.state import SignalsState
from exporter.usage.body import HANDLER_ARGS as BODY_HANDLER_ARGS
from exporter.usage.ingest import ROUTE as USAGE_ROUTE

log = logging.getLogger(__name__)

STATE_KEY = web.AppKey("state", SignalsState)
POLLER_KEY = web.AppKey("poller", EnginePoller)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
FIRST_READ_KEY = web.AppKey("first_read", asyncio.Task)
BODIES_KEY = web.AppKey("metrics_bodies", MetricsBodies)
SEND_KEY = web.AppKey("send_stats", SendStats)
# The status model as JSON (check --exporter.url reads it).
STATUS_ROUTE = "/api/v1/status"
RULE_KEY = web.AppKey("collapse_rule", status.CollapseRule)
# The demo's exporter runs on a clock faster than real time: its time at scenario second 0,
# so that the page shows scenario time rather than a UTC time it is not (absent: UTC).
SCENARIO_ORIGIN_KEY = web.AppKey("scenario_origin", float)
# A body goes out in chunks, each written only once the last has left (aiohttp drains its
# buffer above 64 KiB), so a reader that never reads holds ~128 KiB, not a copy of the body;
# one that has not taken the whole body within SEND_TIMEOUT_SECONDS is cut off.
SEND_CHUNK_BYTES = 64 * 1024
SEND_TIMEOUT_SECONDS = 30.0


def create_app(
    config: Config,
    state: SignalsState | None = None,
    session_factory: Callable[[], aiohttp.ClientSession] | None = None,
    initial_refresh: bool = True,
) -> web.Application:
    state = state or wiring.signals_state(config)
    poller = wiring.engine_poller(config, state, session_factory or _default_session)
    ingest = wiring.usage_ingest(config, state.usage)
    # Request bodies reach /v1/usage as sent; it decodes them itself, bounded
    # (exporter.usage.body).
    app = web.Application(
        client_max_size=config.usage_ingest_max_body_bytes, handler_args=BODY_HANDLER_ARGS
    )
    app[STATE_KEY] = state
    app[POLLER_KEY] = poller
    app[REGISTRY_KEY] = build_registry(state)
    usage = state.usage

    async def refresh(timeout: float | None = None) -> None:
        # The history keeps the totals at each 30-s boundary: sample before a read moves them.
        usage.catch_up(usage.now())
        await poller.refresh(timeout)

    app[BODIES_KEY] = MetricsBodies(app[REGISTRY_KEY], state, refresh)
    # The generated alerts' thresholds, as the operator set them (checked by build_config).
    app[RULE_KEY] = collapse_rule(load_config(config.monitoring_config_file))
    app[SEND_KEY] = SendStats()
    app[REGISTRY_KEY].register(SendStatsCollector(app[SEND_KEY]))
    app.router.add_get("/", landing)
    app.router.add_get("/metrics", metrics)
    app.router.add_get(STATUS_ROUTE, status_json)
    app.router.add_get("/-/healthy", healthy)
    app.router.add_get("/-/ready", ready)
    app.router.add_post(USAGE_ROUTE, ingest.handle)

    async def start_first_read(app: web.Application) -> None:
        if initial_refresh and state.engine.targets:
            app[FIRST_READ_KEY] = asyncio.ensure_future(refresh())

    async def close(app: web.Application) -> None:
        task = app.get(FIRST_READ_KEY)
        if task is not None:
            task.cancel()
        await poller.close()

    app.on_startup.append(start_first_read)
    app.on_cleanup.append(close)
    return app


def collapse_rule(monitoring: MonitoringConfig | None = None) -> status.CollapseRule:
    """What the page and the demo call a collapse: the generated alerts' own thresholds."""
    config = monitoring or MonitoringConfig()
    return status.CollapseRule(
        pages=config.collapse_severity == "critical",
        window_seconds=config.short_seconds,
        drop_factor=config.collapse_drop_factor,
        min_baseline=config.collapse_min_baseline,
        caller_min_tokens_per_second=config.collapse_caller_min_tokens_per_second,
        engine_min_tokens_per_second=config.collapse_engine_min_tokens_per_second,
    )


def current_status(app: web.Application) -> status.Status:
    """The status model as of now, the history caught up first."""
    state = app[STATE_KEY]
    now = state.usage.now()
    state.usage.catch_up(now)
    return status.build(state.engine, state.usage, now, app[RULE_KEY])


def _default_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=32, keepalive_timeout=30),
        headers={"User-Agent": f"vllm-cache-exporter/{__version__}"},
        auto_decompress=True,
    )


async def metrics(request: web.Request) -> web.StreamResponse:
    poller = request.app[POLLER_KEY]
    timeout = poller.effective_timeout(request.headers.get("X-Prometheus-Scrape-Timeout-Seconds"))
    fmt = choose_format(request.headers.get("Accept", ""))
    gzip = gzip_accepted(request.headers.get("Accept-Encoding", ""))
    # Reads vLLM, then renders (both shared with scrapes that arrive together).
    body = await request.app[BODIES_KEY].body(fmt, gzip, timeout)
    headers = {"Content-Type": fmt.content_type, "Vary": "Accept, Accept-Encoding"}
    if gzip:
        headers["Content-Encoding"] = "gzip"
    return await send(request, body, headers)


async def send(request: web.Request, body: bytes, headers: dict[str, str]) -> web.StreamResponse:
    """Write ``body`` chunk by chunk, bounded in buffered bytes and in time. A HEAD request
    gets the headers a GET would (its Content-Length too) and no body: aiohttp leaves a
    streamed body to the handler, and bytes after a HEAD answer would be read as the next
    answer on the connection."""
    response = web.StreamResponse(headers=headers)
    response.content_length = len(body)
    await response.prepare(request)
    if request.method == "HEAD":
        body = b""
    view = memoryview(body)

    async def write_all() -> None:
        for start in range(0, len(view), SEND_CHUNK_BYTES):
            await response.write(view[start : start + SEND_CHUNK_BYTES])
        await response.write_eof()

    try:
        await asyncio.wait_for(write_all(), SEND_TIMEOUT_SECONDS)
    except asyncio.TimeoutError:
        request.app[SEND_KEY].cut += 1
        if request.transport is not None:
            request.transport.abort()  # close() would wait for the unread buffer to drain
    except ConnectionError:
        pass  # the reader went away; nothing is left to send
    return response


async def healthy(_request: web.Request) -> web.Response:
    return web.Response(text="vllm-cache-exporter is healthy.\n")


async def ready(request: web.Request) -> web.Response:
    engine = request.app[STATE_KEY].engine
    if engine.ready:
        return web.Response(text="vllm-cache-exporter is ready.\n")
    waiting = [state.shown for state in engine.targets.values() if not state.attempted]
    return web.Response(
        status=503, text="waiting for a first read of: " + ", ".join(waiting) + "\n"
    )


async def status_json(request: web.Request) -> web.Response:
    """The status page's model as JSON (what ``check --exporter.url`` reads): the same fresh
    read of every vLLM, the same figures and problems, and which of them page."""
    app = request.app
    await app[BODIES_KEY].engine_read(app[POLLER_KEY].timeout)
    return web.json_response(current_status(app).as_json(), headers={"Cache-Control": "no-store"})


async def landing(request: web.Request) -> web.Response:
    """The status page: a fresh read of every vLLM (shared with scrapes in flight), then the
    state in plain words (exporter/page.py)."""
    app = request.app
    await app[BODIES_KEY].engine_read(app[POLLER_KEY].timeout)
    body = page.render(
        current_status(app), __version__, scenario_origin=app.get(SCENARIO_ORIGIN_KEY)
    )
    return web.Response(
        text=body,
        content_type="text/html",
        headers={
            "Content-Security-Policy": page.CONTENT_SECURITY_POLICY,
            "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff",
        },
    )
