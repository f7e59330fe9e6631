"""Process lifecycle for ``run``: start the web app and the readers, stop them cleanly."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from exporter import wiring
from exporter.config import Config
from exporter.server import create_app
from exporter.signals.state import SignalsState
from exporter.usage.tail import follow
from exporter.usage.tap import run_tap

log = logging.getLogger(__name__)


async def serve(config: Config, stop: asyncio.Event | None = None,
                started: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set or SIGINT/SIGTERM arrives."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    state = wiring.signals_state(config)
    app = create_app(config, state)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    host, port = config.listen_host_port
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    background = start_background(config, state)
    log.info("listening on http://%s:%d/metrics, reading %d vLLM target(s)", host, port,
             len(config.engine_targets))
    if started is not None:
        started.set()
    stopping = asyncio.ensure_future(stop.wait())
    try:
        # A background reader that dies (the tap cannot bind its port, say) ends the process
        # with its error instead of leaving a half-working exporter behind.
        await asyncio.wait([stopping, *background], return_when=asyncio.FIRST_COMPLETED)
        failed = [task for task in background
                  if task.done() and not task.cancelled() and task.exception() is not None]
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
    finally:
        stopping.cancel()
        for task in background:
            task.cancel()
        await asyncio.gather(stopping, *background, return_exceptions=True)
        await runner.cleanup()


def start_background(config: Config, state: SignalsState) -> list[asyncio.Task[None]]:
    """Long-running readers (file follower, tap proxy) that are not request handlers."""
    tasks: list[asyncio.Task[None]] = []
    if config.usage_file:
        follower = wiring.file_follower(config, state.usage)
        tasks.append(asyncio.ensure_future(follow(follower, config.usage_file_poll_interval)))
    if config.tap_listen_address:
        tasks.append(asyncio.ensure_future(run_tap(
            wiring.tap_settings(config), wiring.tap_record(state.usage),
            wiring.tap_reject(state.usage))))
    return tasks
