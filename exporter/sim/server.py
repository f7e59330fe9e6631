"""The simulator's HTTP front: vLLM's OpenAI-compatible routes, /health and /metrics.

Bad requests get vLLM's error JSON and a 4xx, never a crash; a client that goes away in the
middle of a stream has its request aborted in the engine, so its blocks go back to the pool
(and it is counted as ``finished_reason="abort"``, as vLLM counts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from exporter.sim.api import CHAT, COMPLETION, ApiError, Running, SimService
from exporter.sim.clock import SimClock
from exporter.sim.engine import Engine, EngineConfig
from exporter.sim.metrics import SimMetrics
from exporter.sim.runner import EngineRunner

log = logging.getLogger(__name__)

# Scenario seconds per wall-clock second; the driver scales the TTFT it measures by it, so a
# simulator run faster than real time still reports TTFTs in the scenario's seconds.
SPEED_HEADER = "X-Simulator-Speed"
VLLM_VERSION = "0.32.0"
MAX_BODY_BYTES = 64 * 1024 * 1024
# Wall-clock seconds between streamed chunks after the first token.
STREAM_INTERVAL = 0.2


@dataclass
class Simulator:
    """Everything one simulated vLLM is made of, wired together."""

    config: EngineConfig
    clock: SimClock
    engine: Engine
    metrics: SimMetrics
    runner: EngineRunner
    service: SimService
    started: float

    def render_metrics(self) -> bytes:
        self.runner.refresh()
        return self.metrics.render(self.engine)

    async def restart(self, config: EngineConfig | None = None) -> None:
        """Restart as vLLM does: the requests in flight are dropped, the cache is empty, and
        every counter starts again from 0 with a new ``_created`` time (a new registry);
        ``config``: the new boot's engine settings (another pool, say), else the same."""
        await self.runner.close()
        if config is not None:
            self.config = self.service.config = config
        self.engine = Engine(self.config)
        self.metrics = SimMetrics(self.config)
        self.runner.engine = self.engine
        self.runner.observers = [self.metrics.observe]
        self.started = time.time()
        await self.runner.start()


def build_simulator(config: EngineConfig, clock: SimClock | None = None) -> Simulator:
    clock = clock or SimClock()
    engine = Engine(config)
    metrics = SimMetrics(config)
    runner = EngineRunner(engine, clock, observers=[metrics.observe])
    return Simulator(
        config, clock, engine, metrics, runner, SimService(runner, config), time.time()
    )


SIM_KEY = web.AppKey("simulator", Simulator)


def create_sim_app(sim: Simulator) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[SIM_KEY] = sim
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", landing)

    async def start(app: web.Application) -> None:
        await app[SIM_KEY].runner.start()

    async def stop(app: web.Application) -> None:
        await app[SIM_KEY].runner.close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def _speed_headers(sim: Simulator) -> dict[str, str]:
    return {SPEED_HEADER: f"{sim.clock.speed:g}"}


def _error(err: ApiError, sim: Simulator) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=_speed_headers(sim))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, COMPLETION)


async def _read_json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deeply
        raise ApiError(400, "the request body is not valid JSON") from None


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    sim = request.app[SIM_KEY]
    service = sim.service
    try:
        parsed = service.parse(kind, await _read_json(request))
    except ApiError as err:
        return _error(err, sim)
    running = service.start(parsed)
    try:
        if not parsed.stream:
            try:
                outcome = await service.outcome(running)
            except ApiError as err:
                return _error(err, sim)
            return web.json_response(
                service.response(running, outcome), headers=_speed_headers(sim)
            )
        return await _stream(request, sim, running)
    finally:
        if not running.handle.done.done():  # the client went away (or we failed): free it
            service.abort(running)


def _sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def _stream(request: web.Request, sim: Simulator, running: Running) -> web.StreamResponse:
    try:
        return await _stream_chunks(request, sim, running)
    except ConnectionResetError:  # the client went away; _generate aborts the request
        log.debug("client of %s disconnected", running.request_id)
        return web.Response(status=499)


async def _stream_chunks(
    request: web.Request, sim: Simulator, running: Running
) -> web.StreamResponse:
    service = sim.service
    if not await service.first_token(running):
        try:
            await service.outcome(running)
        except ApiError as err:  # refused before any output: a plain error, as vLLM does
            return _error(err, sim)
        return web.json_response(
            {
                "error": {
                    "message": "request aborted",
                    "type": "Aborted",
                    "param": None,
                    "code": 499,
                }
            },
            status=499,
        )
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            **_speed_headers(sim),
        }
    )
    await response.prepare(request)
    if running.request.kind == CHAT:
        await response.write(_sse(service.chunk(running, None, role=True)))
    await response.write(_sse(service.chunk(running, running.reply.text(0, 1))))
    sent = 1
    done = running.handle.done
    while not done.done():
        await asyncio.wait((done,), timeout=STREAM_INTERVAL)
        generated = sim.runner.generated(running.request_id) if not done.done() else sent
        if generated > sent:
            await response.write(_sse(service.chunk(running, running.reply.text(sent, generated))))
            sent = generated
    outcome = await service.outcome(running)
    if outcome.completion_tokens > sent:
        await response.write(
            _sse(service.chunk(running, running.reply.text(sent, outcome.completion_tokens)))
        )
    await response.write(_sse(service.chunk(running, "", finish_reason=outcome.finish_reason)))
    if running.request.include_usage:
        await response.write(_sse(service.usage_chunk(running, outcome)))
    await response.write(_sse("[DONE]"))
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    sim = request.app[SIM_KEY]
    name = sim.config.served_model_name
    created = int(sim.started)
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": name,
                    "parent": None,
                    "max_model_len": sim.config.context_limit,
                    "permission": [
                        {
                            "id": "modelperm-sim",
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }
    )


async def health(_request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(_request: web.Request) -> web.Response:
    return web.json_response({"version": VLLM_VERSION})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SIM_KEY].render_metrics()
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


async def landing(request: web.Request) -> web.Response:
    sim = request.app[SIM_KEY]
    cfg = sim.config
    return web.Response(
        text=(
            f"vllm-cache-exporter simulator: a vLLM {VLLM_VERSION} stand-in serving "
            f"{cfg.served_model_name}\n"
            f"KV pool {cfg.kv_pool_tokens} tokens ({cfg.num_blocks} blocks of {cfg.block_size}), "
            f"granule {cfg.granule}, prefix caching {'on' if cfg.prefix_caching else 'off'}, "
            f"prompt token details {'on' if cfg.enable_prompt_tokens_details else 'off'}, "
            f"per-request metrics {'on' if cfg.enable_per_request_metrics else 'off'}, "
            f"speed x{sim.clock.speed:g}\n"
            "Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, /health, "
            "/metrics\n"
        )
    )


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on host:port (port 0: any free port) and return the port it got."""
    # Open streams are cut after a second on shutdown: a stopping simulator (docker compose
    # stop, Ctrl-C) must not wait for every simulated answer to finish.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])
