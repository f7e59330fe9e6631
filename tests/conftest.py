"""Fixtures shared by every test package: a fake vLLM /metrics and the exporter app."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import ProcessCollector

from exporter import metrics, wiring
from exporter.config import Config
from exporter.server import create_app
from tests.helpers import FakeVllm

# The run fails if it leaves untracked files in the checkout (tests/git_clean.py).
pytest_plugins = ["tests.git_clean"]


@pytest.fixture(autouse=True)
def no_new_series_hold(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Most tests read a count right after sending it, which the hold (60 s by default, so
    that Prometheus sees every new series at zero first) would show as 0. The tests of the
    hold itself, and the end-to-end tests that give it their own value, are marked
    ``new_series_hold``; exporter processes the tests start inherit the variable."""
    if request.node.get_closest_marker("new_series_hold"):
        return
    real = wiring.usage_settings
    monkeypatch.setattr(
        wiring,
        "usage_settings",
        lambda config: dataclasses.replace(real(config), new_series_hold=0.0),
    )
    monkeypatch.setenv("VLLM_CACHE_EXPORTER_USAGE_NEW_SERIES_HOLD", "0")


FAKE_PROC = str(Path(__file__).resolve().parent / "fixtures" / "proc")


@pytest.fixture(autouse=True)
def fixed_process_metrics(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process_* series read a recorded /proc (tests/fixtures/proc), so that expositions
    compare byte for byte; tests marked ``real_process_metrics`` read the real one."""
    if request.node.get_closest_marker("real_process_metrics"):
        return
    monkeypatch.setattr(
        metrics, "ProcessCollector", functools.partial(ProcessCollector, proc=FAKE_PROC)
    )


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


# Tests proven on asyncio's own connection handling (slow readers, connection caps,
# slowloris) also run on uvloop's loop, which ``run`` uses by default when it is installed.
BOTH_LOOPS = ("tests.test_limits", "tests.tap.test_hostile")


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every async test on asyncio's loop; those of BOTH_LOOPS on uvloop's too."""
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    uvloop_factory = _uvloop_factory()
    module = getattr(item, "module", None)
    if uvloop_factory is not None and module is not None and module.__name__ in BOTH_LOOPS:
        factories["uvloop"] = uvloop_factory
    return factories
