"""/metrics on the wire: gzip when asked, one render shared by scrapes that arrive together
(never a body staler than the shared vLLM read), and an event loop that stays responsive
while a large exposition renders, in both formats.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import time

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from exporter.config import Config
from exporter.metrics import build_registry
from exporter.metrics.exposition import OPENMETRICS, TEXT, choose_format, generate
from exporter.metrics.scrape import (
    MAX_BODIES,
    MetricsBodies,
    gzip_accepted,
    gzip_compress,
)
from exporter.server import BODIES_KEY, REGISTRY_KEY, create_app
from exporter.signals.classify import STATES
from exporter.signals.state import SignalsState
from exporter.signals.usage import SERIES_PER_PAIR
from exporter.values import UsageEvent
from exporter.wiring import signals_state
from tests.helpers import value

OPENMETRICS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


def event(caller: str = "agent-1", model: str = "m") -> UsageEvent:
    return UsageEvent(caller, model, 90_000, 86_016, ttft_seconds=1.5, queue_seconds=0.2)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- Accept-Encoding ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "wanted"),
    [
        ("gzip", True),
        ("gzip, deflate, br", True),  # what aiohttp and browsers send
        ("GZip;Q=0.5", True),
        ("x-gzip", True),
        ("*", True),
        ("deflate, *;q=0.1", True),
        ("identity;q=1, gzip;q=0.001", True),
        ("", False),
        ("identity", False),
        ("deflate, br", False),
        ("gzip;q=0", False),  # q=0: "not acceptable"
        ("gzip;q=0.000", False),
        ("*;q=0", False),
        ("gzip;q=0, *", False),  # named beats the wildcard
        ("gzip;q=abc", False),  # a malformed item is ignored
        ("gzip;q=1.5", False),
        ("gzip;q=abc, *;q=1", True),
    ],
)
def test_gzip_accepted(header, wanted):
    assert gzip_accepted(header) is wanted


def test_gzip_body_is_stable_and_decodes():
    body = generate(build_registry(signals_state(Config())), TEXT)
    packed = gzip_compress([body[:100], body[100:]])
    assert gzip.decompress(packed) == body
    assert gzip_compress([body[:100], body[100:]]) == packed  # mtime 0: no clock in it


# ---- over HTTP ---------------------------------------------------------------------------


async def usage_only_client(aiohttp_client, **overrides: object):
    config = Config(signals_granularity=2048, **overrides)  # type: ignore[arg-type]
    state = signals_state(config)
    for index in range(30):
        for _ in STATES[:3]:
            state.usage.record(event(f"agent-{index}"), "http")
    client = await aiohttp_client(create_app(config, state=state, initial_refresh=False))
    return client, state


@pytest.mark.parametrize("accept", ["", OPENMETRICS_ACCEPT], ids=["text", "openmetrics"])
async def test_gzip_when_asked_decodes_to_the_identity_body(aiohttp_client, accept):
    client, _ = await usage_only_client(aiohttp_client)
    registry = client.app[REGISTRY_KEY]
    packed = await client.get(
        "/metrics", auto_decompress=False, headers={"Accept": accept, "Accept-Encoding": "gzip"}
    )
    assert packed.headers["Content-Encoding"] == "gzip"
    assert "Accept-Encoding" in packed.headers["Vary"]
    plain = await client.get("/metrics", headers={"Accept": accept, "Accept-Encoding": "identity"})
    assert "Content-Encoding" not in plain.headers
    assert packed.headers["Content-Type"] == plain.headers["Content-Type"]
    body = await plain.read()
    expected = (openmetrics_latest if accept else generate_latest)(registry)
    assert body == expected  # client_python's bytes, in the negotiated format
    compressed = await packed.read()
    assert gzip.decompress(compressed) == body
    assert len(compressed) * 5 < len(body)


@pytest.mark.parametrize(
    "headers",
    [
        {"Accept-Encoding": "identity"},
        {"Accept-Encoding": "gzip;q=0, deflate"},
        {"Accept-Encoding": "br"},
        {},  # no Accept-Encoding at all
    ],
)
async def test_identity_unless_gzip_is_allowed(aiohttp_client, headers):
    client, _ = await usage_only_client(aiohttp_client)
    response = await client.get(
        "/metrics", headers=headers, auto_decompress=False, skip_auto_headers=["Accept-Encoding"]
    )
    assert response.status == 200
    assert "Content-Encoding" not in response.headers
    body = await response.read()
    assert body == generate_latest(client.app[REGISTRY_KEY])


async def test_concurrent_scrapes_share_one_read_and_one_render(fake_vllm, exporter_for):
    client = await exporter_for(fake_vllm.url)
    bodies = client.app[BODIES_KEY]
    fake_vllm.hang = True
    pending = [
        asyncio.ensure_future(client.get("/metrics", auto_decompress=False)) for _ in range(4)
    ]
    while fake_vllm.requests == 0:
        await asyncio.sleep(0)
    fake_vllm.release.set()
    answers = [await (await scrape).read() for scrape in pending]
    assert fake_vllm.requests == 1
    assert bodies.renders == 1
    assert len(set(answers)) == 1
    assert (
        value(gzip.decompress(answers[0]).decode(), "vllm_cache_engine_up", target=fake_vllm.url)
        == 1
    )


async def test_each_scrape_after_a_read_reads_and_renders_again(fake_vllm, exporter_for):
    """A body is never staler than the vLLM read its scrape waited for."""
    client = await exporter_for(fake_vllm.url)
    bodies = client.app[BODIES_KEY]
    first = await (await client.get("/metrics")).text()
    fake_vllm.status = 500
    second = await (await client.get("/metrics")).text()
    assert (fake_vllm.requests, bodies.renders) == (2, 2)
    assert value(first, "vllm_cache_engine_up", target=fake_vllm.url) == 1
    assert value(second, "vllm_cache_engine_up", target=fake_vllm.url) == 0


# ---- sharing rules, without HTTP ----------------------------------------------------------


class Gate:
    """A pause between render slices that holds the render until the test opens it."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.open = asyncio.Event()

    async def __call__(self) -> None:
        self.entered.set()
        await self.open.wait()


async def no_targets(_timeout: float) -> None:
    return None


async def settle() -> None:
    """Let ready tasks run until they block (no I/O involved: the order is deterministic)."""
    for _ in range(10):
        await asyncio.sleep(0)


def usage_bodies(
    clock: Clock | None = None, **kwargs: object
) -> tuple[MetricsBodies, SignalsState]:
    state = signals_state(Config(signals_granularity=2048))
    state.usage.record(event(), "http")
    bodies = MetricsBodies(
        build_registry(state), state, no_targets, monotonic=clock or Clock(), **kwargs
    )  # type: ignore[arg-type]
    return bodies, state


async def test_same_second_and_no_change_reuses_the_body():
    clock = Clock()
    bodies, state = usage_bodies(clock)
    first = await bodies.body(TEXT, False, 5.0)
    clock.now += 0.9
    assert await bodies.body(TEXT, False, 5.0) is first
    assert bodies.renders == 1
    clock.now += 0.1  # a second after the render finished: render again
    assert await bodies.body(TEXT, False, 5.0) == first
    assert bodies.renders == 2


async def test_any_usage_change_renders_again():
    bodies, state = usage_bodies()
    first = await bodies.body(TEXT, False, 5.0)
    state.usage.record(event("agent-2"), "http")
    second = await bodies.body(TEXT, False, 5.0)
    assert bodies.renders == 2
    assert b'caller="agent-2"' in second and b'caller="agent-2"' not in first
    state.usage.reject("http", "bad_json")
    third = await bodies.body(TEXT, False, 5.0)
    assert bodies.renders == 3 and third != second
    state.usage.reject_request("unauthorized")
    await bodies.body(TEXT, False, 5.0)
    assert bodies.renders == 4


async def test_formats_and_encodings_are_kept_apart():
    bodies, _ = usage_bodies()
    text = await bodies.body(TEXT, False, 5.0)
    packed = await bodies.body(TEXT, True, 5.0)
    om = await bodies.body(OPENMETRICS, False, 5.0)
    om_packed = await bodies.body(choose_format(OPENMETRICS_ACCEPT), True, 5.0)
    assert bodies.renders == 4
    assert gzip.decompress(packed) == text
    assert gzip.decompress(om_packed) == om and om.endswith(b"# EOF\n")
    assert bodies.held() == 4


async def test_a_scrape_during_a_render_joins_it_unless_the_state_changed():
    bodies, state = usage_bodies(reuse_seconds=0.0)  # only a render in flight can be shared
    gate = Gate()
    bodies.pause = gate
    first = asyncio.ensure_future(bodies.body(TEXT, False, 5.0))
    await gate.entered.wait()
    joined = asyncio.ensure_future(bodies.body(TEXT, False, 5.0))
    await settle()  # joined is now waiting for the first render
    state.usage.record(event("agent-late"), "http")
    fresh = asyncio.ensure_future(bodies.body(TEXT, False, 5.0))
    gate.open.set()
    assert await joined is await first
    assert b'caller="agent-late"' in await fresh
    assert bodies.renders == 2


async def test_a_failed_render_is_not_reused():
    bodies, _ = usage_bodies()

    class Broken:
        calls = 0

        def collect(self):
            Broken.calls += 1
            if Broken.calls == 1:
                raise RuntimeError("collector bug")
            return []

    bodies.registry.register(Broken())
    with pytest.raises(RuntimeError):
        await bodies.body(TEXT, False, 5.0)
    assert bodies.held() == 0
    assert b"vllm_cache_requests_total" in await bodies.body(TEXT, False, 5.0)
    assert bodies.renders == 2


async def test_bodies_held_are_bounded_and_released():
    bodies, _ = usage_bodies(reuse_seconds=0.0)
    for minor in range(MAX_BODIES + 4):  # many distinct formats (client_python >= 0.23)
        fmt = choose_format(f"application/openmetrics-text;version=1.{minor}.0")
        await bodies.body(fmt, False, 5.0)
        assert bodies.held() <= MAX_BODIES
    await settle()  # the release runs reuse_seconds (here 0) after each render
    assert bodies.held() == 0


async def test_the_first_read_is_shared_and_the_timeout_passed_on():
    reads: list[float] = []
    release = asyncio.Event()

    async def read(timeout: float) -> None:
        reads.append(timeout)
        await release.wait()

    state = signals_state(Config(vllm_url=("http://127.0.0.1:1/metrics",)))
    bodies = MetricsBodies(build_registry(state), state, read)
    scrapes = [asyncio.ensure_future(bodies.body(TEXT, True, 3.5)) for _ in range(3)]
    await asyncio.sleep(0)
    release.set()
    assert len(set(await asyncio.gather(*scrapes))) == 1
    assert reads == [3.5] and bodies.renders == 1
    await bodies.body(TEXT, True, 3.5)  # after the read ended: a new read, a new render
    assert len(reads) == 2 and bodies.renders == 2


# ---- the event loop stays responsive while a large exposition renders ---------------------


class LoopTicker:
    """Measures the longest turn of the event loop, in the loop thread's own CPU time.

    CPU time of the loop thread between two of its ticks is the work some callback held the
    loop for; unlike wall time it does not grow when other processes take the CPU.
    """

    def __init__(self) -> None:
        self.longest = 0.0
        self.stopped = False

    async def run(self) -> None:
        last = time.thread_time()
        while not self.stopped:
            await asyncio.sleep(0)
            now = time.thread_time()
            self.longest = max(self.longest, now - last)
            last = now


def worst_case_state(callers: int, models: int) -> tuple[Config, SignalsState]:
    """Every caller on every model with every state timed and a queue wait: 95 samples a
    series, the most the per-caller families print for one."""
    config = Config(
        signals_granularity=2048,
        callers_max=callers,
        callers_detailed=callers,  # every caller's histograms its own: the costliest render
        callers_max_series=callers * models * SERIES_PER_PAIR,
    )
    state = signals_state(config)
    turns = [
        (91_070, 86_016, None),
        (60_000, 30_720, None),
        (40_000, 0, None),
        (100, 0, None),
        (5_000, None, None),
        (5_000, 0, 500),
    ]
    for index in range(callers):
        for model in range(models):
            for prompt, cached, status in turns:
                state.usage.record(
                    UsageEvent(
                        f"agent-{index:04d}",
                        f"model-{model}",
                        prompt,
                        cached,
                        ttft_seconds=2.5,
                        queue_seconds=0.5,
                        status=status,
                    ),
                    "http",
                )
    return config, state


@pytest.mark.parametrize(
    "accept", ["text/plain;version=0.0.4", OPENMETRICS_ACCEPT], ids=["text", "openmetrics"]
)
async def test_ingest_answers_during_a_large_render(aiohttp_client, accept):
    """3,000 series of 95 samples (26 MB of exposition): a POST sent during the render is
    answered before the render ends, within 100 ms of the loop thread's time, and no turn of
    the loop lasts long. Times are the loop thread's CPU time, which other processes on a
    loaded machine do not inflate; the wall time is in the failure message."""
    config, state = worst_case_state(callers=1000, models=3)
    client = await aiohttp_client(create_app(config, state=state, initial_refresh=False))
    # Building the state (and earlier tests' garbage) makes a full collection of Python's GC
    # due; it would land in whatever runs next, the render or not. Run it now.
    gc.collect()
    bodies = client.app[BODIES_KEY]
    slices = 0
    render_began = asyncio.Event()

    async def counted_pause() -> None:
        nonlocal slices
        slices += 1
        render_began.set()
        await asyncio.sleep(0)

    bodies.pause = counted_pause
    loop = asyncio.get_running_loop()
    ticker = LoopTicker()
    ticking = asyncio.ensure_future(ticker.run())
    scrape = asyncio.ensure_future(
        client.get(
            "/metrics", auto_decompress=False, headers={"Accept": accept, "Accept-Encoding": "gzip"}
        )
    )
    await render_began.wait()
    sent, sent_cpu = loop.time(), time.thread_time()
    answer = await client.post(
        "/v1/usage",
        data=json.dumps({"caller": "agent-0001", "model": "model-0", "prompt_tokens": 100}),
    )
    latency, latency_cpu = loop.time() - sent, time.thread_time() - sent_cpu
    slices_at_answer = slices
    response = await scrape
    compressed = await response.read()
    ticker.stopped = True
    await ticking

    assert answer.status == 200 and (await answer.json())["accepted"] == 1
    assert slices_at_answer < slices  # answered while the render was still going
    timing = (
        f"POST answered in {latency_cpu * 1000:.0f} ms of loop CPU "
        f"({latency * 1000:.0f} ms wall), longest loop turn {ticker.longest * 1000:.0f} ms"
    )
    assert latency_cpu < 0.1, timing
    assert ticker.longest < 0.05, timing
    body = gzip.decompress(compressed)
    assert body.count(b"\n") > 3000 * 95
    assert body.endswith(b"# EOF\n") is ("openmetrics" in accept)
