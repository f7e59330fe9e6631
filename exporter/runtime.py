"""Process lifecycle for ``run``: start the web app and the readers, stop them cleanly."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from types import ModuleType
from typing import Any

from aiohttp import web

from exporter import wiring
from exporter.config import Config, ConfigError, loopback_aliases
from exporter.limits import (
    TAP_DESCRIPTORS_PER_CONNECTION,
    DescriptorPlan,
    FileDescriptors,
    FollowedFilesCollector,
    LimitedRunner,
    LimitsCollector,
    ListenerStats,
    RateLimitedLogs,
    install_log_limits,
    keep_freed_memory,
    plan_descriptors,
    raise_fd_limit,
)
from exporter.server import REGISTRY_KEY, create_app
from exporter.signals.state import SignalsState
from exporter.usage.tail import follow
from exporter.usage.tap import run_tap
from exporter.web import WebConfigError, WebListener, install_sighup
from exporter.web.metrics import WebConfigCollector

log = logging.getLogger(__name__)
UVLOOP, ASYNCIO = "uvloop", "asyncio"


def _uvloop() -> ModuleType | None:
    try:
        import uvloop
    except ImportError:  # an optional speed-up: a platform without it runs asyncio's loop
        return None
    return uvloop


def event_loop_name(use_uvloop: bool = Config.web_uvloop) -> str:
    """The loop ``run`` uses with this setting (the default: the flag's)."""
    return UVLOOP if use_uvloop and _uvloop() is not None else ASYNCIO


def run_to_completion(main: Coroutine[Any, Any, None], use_uvloop: bool) -> None:
    """``asyncio.run(main)``, on uvloop's loop when asked for and installed.

    The web server, the tap and the readers only use asyncio's public API, so either loop
    runs them; uvloop's transports take less CPU per connection and per read.
    """
    uvloop = _uvloop() if use_uvloop else None
    if uvloop is None:
        asyncio.run(main)
    else:
        uvloop.run(main)


async def serve(
    config: Config, stop: asyncio.Event | None = None, started: asyncio.Event | None = None
) -> None:
    """Serve until ``stop`` is set or SIGINT/SIGTERM arrives."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    logs = RateLimitedLogs()
    install_log_limits(logs)
    plan = descriptor_plan(config, raise_fd_limit())
    keep_freed_memory()
    web_stats = ListenerStats("web", plan.caps["web"], plan.slacks["web"])
    tap_stats = ListenerStats(
        "tap", plan.caps.get("tap", config.tap_max_connections), plan.slacks.get("tap")
    )
    files = FileDescriptors(plan.files)
    state = wiring.signals_state(config)
    app = create_app(config, state)
    app[REGISTRY_KEY].register(
        LimitsCollector(
            [web_stats, tap_stats] if config.tap_listen_address else [web_stats], logs, plan, files
        )
    )
    listeners = open_web_listeners(config)
    web_listener = listeners.get("web")
    if web_listener is not None:
        secure_app(app, web_listener, config)
    if listeners:
        app[REGISTRY_KEY].register(
            WebConfigCollector(lambda: [listener.status() for listener in listeners.values()])
        )
    install_sighup(listeners.values())
    runner = LimitedRunner(
        app, web_stats, access_log=None, handle_signals=False, shutdown_timeout=5.0
    )
    await runner.setup()
    host, port = config.listen_host_port
    site = web.TCPSite(
        runner,
        host,
        port,
        reuse_address=True,
        ssl_context=web_listener.ssl_context if web_listener else None,
    )
    try:
        await site.start()
    except OSError as err:
        await runner.cleanup()
        raise listen_error(err, config.web_listen_address, "--web.listen-address") from None
    if not config.engine_targets:
        log.warning(
            "no --vllm.url: reading no vLLM, so only the per-caller usage signals are "
            "served (give --vllm.url http://HOST:8000 for the engine's)"
        )
    for warning in loopback_aliases(config.vllm_url):
        log.warning("%s", warning)
    background = start_background(
        config, state, listeners.get("tap"), tap_stats, files, register=app[REGISTRY_KEY].register
    )
    scheme = "https" if web_listener and web_listener.ssl_context else "http"
    log.info(
        "listening on %s://%s:%d/metrics, reading %d vLLM target(s)",
        scheme,
        host,
        port,
        len(config.engine_targets),
    )
    if started is not None:
        started.set()
    stopping = asyncio.ensure_future(stop.wait())
    try:
        # A background reader that dies (the tap cannot bind its port, say) ends the process
        # with its error instead of leaving a half-working exporter behind.
        await asyncio.wait([stopping, *background], return_when=asyncio.FIRST_COMPLETED)
        failed = [
            task
            for task in background
            if task.done() and not task.cancelled() and task.exception() is not None
        ]
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
    finally:
        stopping.cancel()
        for task in background:
            task.cancel()
        await asyncio.gather(stopping, *background, return_exceptions=True)
        await runner.cleanup()


def descriptor_plan(config: Config, fd_limit: int) -> DescriptorPlan:
    """The process's descriptors shared out between the listeners (a tap connection holds
    two: its own and one to vLLM) and the followed files; said when it lowers a cap."""
    asked = {"web": config.web_max_connections}
    costs = {"web": 1}
    if config.tap_listen_address:
        asked["tap"] = config.tap_max_connections
        costs["tap"] = TAP_DESCRIPTORS_PER_CONNECTION
    plan = plan_descriptors(
        fd_limit,
        {name: (asked[name], costs[name]) for name in asked},
        follow_files=bool(config.usage_file),
    )
    if plan.lowered(asked):
        log.warning(
            "the file-descriptor limit (%d, the hard limit) is below what the "
            "connection caps need: serving at most %s (a tap connection also holds "
            "one to vLLM)%s; raise the hard limit (ulimit -n, LimitNOFILE) for more",
            fd_limit,
            ", ".join(f"{plan.caps[name]} {name} connections" for name in plan.caps),
            f", {plan.files} followed files" if plan.files else "",
        )
    return plan


def open_web_listeners(config: Config) -> dict[str, WebListener]:
    """The web configs of the exporter's listener ("web") and the tap's ("tap"), where set.
    build_config has loaded them once already; a file broken since is a ConfigError."""
    files = {
        "web": (config.web_config_file, "--web.config.file", True),
        "tap": (config.tap_web_config_file, "--tap.web-config.file", False),
    }
    listeners = {}
    for name, (path, option, basic_auth) in files.items():
        if not path:
            continue
        try:
            listeners[name] = WebListener.open(path, name, allow_basic_auth=basic_auth)
        except WebConfigError as err:
            raise ConfigError(option, str(err)) from None
    return listeners


def secure_app(app: web.Application, listener: WebListener, config: Config) -> None:
    """TLS-side checks, basic auth and headers on the exporter's app. The health probes
    stay open (a kubelet probe cannot hold a password); /v1/usage keeps its own bearer
    token when one is set, since one Authorization header cannot carry both."""
    listener.install(
        app,
        open_paths=("/-/healthy", "/-/ready"),
        bearer_paths=("/v1/usage",) if config.usage_ingest_token else (),
    )


def start_background(
    config: Config,
    state: SignalsState,
    tap_listener: WebListener | None = None,
    tap_stats: ListenerStats | None = None,
    files: FileDescriptors | None = None,
    register: Callable[[Any], object] | None = None,
) -> list[asyncio.Task[None]]:
    """Long-running readers (file follower, tap proxy) that are not request handlers. The
    tap's sockets to vLLM are held to its connections (cap and slack), ``files`` is the
    followed files' share of the descriptors; ``register`` puts the follower's collector on
    /metrics."""
    tasks: list[asyncio.Task[None]] = []
    if config.usage_file:
        follower = wiring.file_follower(config, state.usage, files)
        if register is not None:  # the follower's bounds and losses, on /metrics
            register(FollowedFilesCollector(follower))
        tasks.append(asyncio.ensure_future(follow(follower, config.usage_file_poll_interval)))
    if config.tap_listen_address:
        tap_stats = tap_stats or ListenerStats("tap", config.tap_max_connections)
        serving = run_tap(
            wiring.tap_settings(config),
            wiring.tap_record(state.usage),
            wiring.tap_reject(state.usage),
            record_prompt=wiring.tap_record_prompt(state.usage),
            secure=tap_listener.install if tap_listener is not None else None,
            ssl_context=tap_listener.ssl_context if tap_listener is not None else None,
            runner=functools.partial(LimitedRunner, stats=tap_stats),
            upstream_connections=tap_stats.cap + tap_stats.slack,
        )
        tasks.append(
            asyncio.ensure_future(
                naming_the_flag(config.tap_listen_address, "--tap.listen-address", serving)
            )
        )
    return tasks


def listen_error(err: OSError, address: str, flag: str) -> OSError:
    """The OS error, naming the address and the flag that chose it."""
    return OSError(err.errno, f"cannot listen on {address} ({flag}): {err.strerror or err}")


async def naming_the_flag(address: str, flag: str, serving: Awaitable[None]) -> None:
    try:
        await serving
    except OSError as err:
        raise listen_error(err, address, flag) from None
