"""What one client can take from the exporter is bounded: connections, idle time, the memory
of a reader that never reads, and the log. Each case is sent as a client would send it."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import os
import socket
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from exporter import limits, server
from exporter.config import Config
from exporter.limits import (
    LimitedRunner,
    LimitsCollector,
    ListenerStats,
    RateLimitedLogs,
    connection_cap,
    keep_freed_memory,
)
from exporter.server import REGISTRY_KEY, create_app
from exporter.usage.event import validate
from exporter.usage.tail import FileFollower
from exporter.values import UsageEvent
from exporter.wiring import signals_state, tap_app
from tests.helpers import value
from tests.tap.conftest import Reply, fixture_bytes, upstream  # noqa: F401 (fixture)

GOOD = {"caller": "alice", "model": "m", "prompt_tokens": 4096, "cached_tokens": 2048}


async def start(app: web.Application, stats: ListenerStats, **kwargs) -> tuple[LimitedRunner, int]:
    runner = LimitedRunner(app, stats, access_log=None, handle_signals=False, **kwargs)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, port


async def wait_for(condition, seconds: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)  # connection bookkeeping has no event to await


async def test_at_the_cap_the_oldest_idle_connection_makes_room(monkeypatch):
    """A flood of idle sockets cannot lock Prometheus out: its new connection is served and
    the oldest idle one goes."""
    config = Config()
    app = create_app(config, initial_refresh=False)
    stats = ListenerStats("web", cap=3)
    app[REGISTRY_KEY].register(LimitsCollector([stats], None))
    runner, port = await start(app, stats)
    try:
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await wait_for(lambda: stats.open == 3)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                assert response.status == 200
                text = await response.text()
        assert await asyncio.wait_for(idle[0][0].read(), 10) == b""  # the oldest: closed
        assert value(text, "vllm_cache_exporter_connections_evicted_total", listener="web") == 1
        for _, writer in idle:
            writer.close()
        await wait_for(lambda: stats.open == 0)
    finally:
        await runner.cleanup()


async def test_past_the_slack_a_connection_gets_503_and_the_log_stays_quiet(monkeypatch, caplog):
    monkeypatch.setattr(limits, "HARD_SLACK", 0)
    app = create_app(Config(), initial_refresh=False)
    stats = ListenerStats("web", cap=2)
    runner, port = await start(app, stats)
    try:
        caplog.set_level(logging.DEBUG)
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await wait_for(lambda: stats.open == 2)
        for _ in range(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answer = await asyncio.wait_for(reader.read(), 10)
            assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
            writer.close()
        assert stats.refused == 20
        for _, writer in idle:
            writer.close()
        await wait_for(lambda: stats.open == 0)
        assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    "partial", [b"", b"GET /metrics HTTP/1.1\r\nHost: x\r\n"], ids=["silent", "headers-trickling"]
)
async def test_a_connection_without_a_whole_request_is_closed_after_the_idle_time(partial):
    app = web.Application()

    async def hello(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/", hello)
    stats = ListenerStats("web", cap=10)
    runner, port = await start(app, stats, keepalive_timeout=0.5)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        opened = loop.time()
        for _ in range(3):  # a byte now and then does not keep it open
            writer.write(partial[:1])
            partial = partial[1:]
            await asyncio.sleep(0.2)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
        assert loop.time() - opened < 5
        writer.close()
        await wait_for(lambda: stats.open == 0)
    finally:
        await runner.cleanup()


def slow_app() -> tuple[web.Application, asyncio.Event, asyncio.Event]:
    """An app whose one route answers once ``release`` is set (``started`` says it runs)."""
    app = web.Application()
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(_request: web.Request) -> web.Response:
        started.set()
        await release.wait()
        return web.Response(text="answered")

    app.router.add_get("/slow", slow)
    return app, started, release


async def ask_slowly(
    port: int, started: asyncio.Event
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose request the slow route is now answering."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(started.wait(), 10)
    return reader, writer


async def test_an_evicted_connection_finishes_the_request_it_is_answering():
    """At the cap the oldest connection goes, but one busy answering is closed only once its
    answer is out; an idle one would be cut at once."""
    app, started, release = slow_app()
    stats = ListenerStats("web", cap=1)
    runner, port = await start(app, stats)
    try:
        reader, writer = await ask_slowly(port, started)
        newcomer = await asyncio.open_connection("127.0.0.1", port)  # evicts the busy one
        await wait_for(lambda: stats.evicted == 1)
        release.set()
        answer = await asyncio.wait_for(reader.read(), 10)  # then closed
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"answered")
        writer.close()
        newcomer[1].close()
        await wait_for(lambda: stats.open == 0)
    finally:
        await runner.cleanup()


async def test_a_long_answer_is_not_taken_for_an_idle_connection():
    app, started, release = slow_app()
    stats = ListenerStats("web", cap=10)
    runner, port = await start(app, stats, keepalive_timeout=0.3)
    try:
        reader, writer = await ask_slowly(port, started)
        await asyncio.sleep(1.0)  # several idle times: only the clock can pass them
        release.set()
        head = await asyncio.wait_for(reader.readuntil(b"answered"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        assert stats.idle_closed == 0
        # Idle after its answer, it is closed after the idle time as any other.
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        await wait_for(lambda: stats.open == 0)
    finally:
        await runner.cleanup()


def test_the_cap_stays_below_the_descriptors_the_process_has():
    assert connection_cap(512, 1024) == 512
    assert connection_cap(2048, 1024) == 1024 - limits.RESERVED_FDS - limits.HARD_SLACK
    assert connection_cap(512, 10) == 1


async def test_a_reader_that_never_reads_holds_a_bounded_buffer_and_is_cut(monkeypatch):
    monkeypatch.setattr(server, "SEND_TIMEOUT_SECONDS", 1.0)
    config = Config(callers_max=2000, callers_detailed=2000, callers_max_series=10_000_000)
    state = signals_state(config)
    for index in range(2000):  # a body of several MB
        state.usage.record(
            UsageEvent(f"caller-{index:05d}", "m", 9000, 8192, ttft_seconds=1.0, queue_seconds=0.1),
            "http",
        )
    app = create_app(config, state, initial_refresh=False)
    stats = ListenerStats("web", cap=10)
    runner, port = await start(app, stats)
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n\r\n")
        await wait_for(lambda: app[server.SEND_KEY].cut == 1, 30)
        await wait_for(lambda: stats.open == 0)
        received = b""
        sock.setblocking(False)
        try:
            while chunk := sock.recv(1 << 20):
                received += chunk
        except BlockingIOError:
            pass
        sock.close()
        # It never had the whole body, and the server never buffered it all for it either.
        header_end = received.find(b"\r\n\r\n")
        declared = int(received[:header_end].split(b"Content-Length: ")[1].split(b"\r\n")[0])
        assert declared > 4 * 1024 * 1024
        assert len(received) - header_end - 4 < declared
    finally:
        await runner.cleanup()


def test_a_flood_of_one_message_is_counted_not_written():
    now = [0.0]
    logs = RateLimitedLogs(window=60, burst=3, clock=lambda: now[0])
    logger = logging.getLogger("tests.flood")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    handler.addFilter(logs)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for attempt in range(10_000):
            try:
                raise ValueError(attempt)
            except ValueError:
                logger.warning("a usage line could not be converted", exc_info=True)
        logger.warning("something else")
        assert len(records) == 4 and logs.suppressed_total == 9_997
        now[0] = 61.0
        logger.warning("a usage line could not be converted")
        summary = [
            record.getMessage() for record in records if "more message" in record.getMessage()
        ]
        assert summary == [
            "9997 more message(s) like 'a usage line could not be converted' "
            "were not logged in the last window"
        ]
    finally:
        logger.removeHandler(handler)


FAULTS_PER_ROUND = """
import os, resource, sys
from exporter.limits import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory({})

def one_round():  # a 100k-token request's buffers: two of 400 KB alive together
    body = os.urandom(16) * 25_000
    copy = body + b"x"
    del body, copy

for _ in range(50):
    one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(500):
    one_round()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 500)
"""


def faults_per_round(mode: str) -> float:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"
    }
    done = subprocess.run(
        [sys.executable, "-c", FAULTS_PER_ROUND, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return float(done.stdout)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="not glibc")
def test_large_bodies_reuse_freed_memory_instead_of_faulting_it_in_again():
    """By default glibc gives two freed 400 KB buffers back to the system and faults them in
    again on the next request (hundreds of page faults a round); with the thresholds fixed
    the memory is reused."""
    assert faults_per_round("default") > 50  # what the setting is for, on this glibc
    assert faults_per_round("kept") < 1


def test_malloc_tuning_from_the_environment_is_left_alone():
    assert not keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "1000"})
    assert not keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000"})


async def test_connections_trickling_bodies_cannot_fill_the_tap(upstream):  # noqa: F811
    """The issue's case, scaled to a cap of 8: more connections than the cap and its slack
    trickle request bodies, and every other call is still served. A connection still
    sending its request (here: its body) is closed at once to make room, as an idle one is;
    none is answered 503."""
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("01_chat_cold.json")))
    config = Config(tap_listen_address="127.0.0.1:0", tap_upstream=upstream.url)
    state = signals_state(config)
    stats = ListenerStats("tap", cap=8, slack=2)
    runner, port = await start(tap_app(config, state.usage), stats)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
    )
    try:
        tricklers = []
        for _ in range(3 * (stats.cap + stats.slack)):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            await writer.drain()
            tricklers.append((reader, writer))
        await wait_for(lambda: stats.open <= stats.cap)
        async with aiohttp.ClientSession() as session:
            for index in range(5):
                async with session.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"model": "tiny-llama", "messages": []},
                    headers={"X-Caller": f"caller-{index}"},
                ) as response:
                    assert response.status == 200
                    await response.read()
        assert stats.refused == 0
        assert stats.evicted >= 2 * (stats.cap + stats.slack)
        closed = [await asyncio.wait_for(reader.read(), 10) for reader, _ in tricklers[:16]]
        assert closed == [b""] * 16  # the oldest were cut without an answer
        assert state.usage.events.get("tap") == 5
        assert [body for body in upstream.received if body.body.startswith(b"{\n")] == []
        for _, writer in tricklers:
            writer.close()
        await wait_for(lambda: stats.open == 0)
    finally:
        await runner.cleanup()


def test_descriptors_are_shared_by_the_listeners_the_tap_sockets_and_the_files():
    """Under a hard limit of 1,024 the default caps (512 web + 512 tap, each tap connection
    also holding a socket to vLLM) would need 1,728 descriptors: each gets the same
    fraction, and every use together stays within the limit."""
    asked = {"web": (512, 1), "tap": (512, limits.TAP_DESCRIPTORS_PER_CONNECTION)}
    plan = limits.plan_descriptors(1024, asked, follow_files=True)
    reserved = plan.reserved()
    assert sum(reserved.values()) == 1024
    assert reserved["process"] >= limits.RESERVED_FDS
    assert reserved["files"] == (1024 - limits.RESERVED_FDS) // 8 == plan.files
    assert reserved["tap"] == (plan.caps["tap"] + plan.slacks["tap"]) * 2
    assert plan.caps == {"web": 245, "tap": 245} and plan.lowered({"web": 512})
    roomy = limits.plan_descriptors(1 << 20, asked, follow_files=True)
    assert roomy.caps == {"web": 512, "tap": 512}
    assert roomy.slacks == {"web": limits.HARD_SLACK, "tap": limits.HARD_SLACK}
    assert not roomy.lowered({"web": 512, "tap": 512})
    alone = limits.plan_descriptors(1024, {"web": (512, 1)})
    assert (alone.caps, alone.files) == ({"web": 512}, 0)  # nothing else asks: as before
    tiny = limits.plan_descriptors(100, asked)  # 36 left after the process's own
    assert tiny.caps == {"web": 11, "tap": 11} and tiny.slacks == {"web": 1, "tap": 1}
    assert sum(tiny.reserved().values()) == 100


def test_the_followed_files_share_is_asked_before_each_open(tmp_path):
    """A follower handed the budget holds no more files open than its share: past it, the
    least recently written is closed and reopened when it changes, read from where it was
    left, so every file's new lines count once (those written before start: never), and
    closing the follower gives every descriptor back."""
    files = limits.FileDescriptors(2)
    paths = [tmp_path / f"usage-{index}.jsonl" for index in range(3)]
    for path in paths:
        path.write_text(json.dumps(GOOD) + "\n")  # before start: not counted
    rows: list = []
    follower = FileFollower(
        [str(tmp_path / "*.jsonl")],
        validate,
        rows.extend,
        lambda reason: None,
        acquire_descriptor=files.acquire,
        release_descriptor=files.release,
    )
    follower.poll()
    assert len(follower.files) == 3 and files.in_use == 2  # as many open as the share
    for round_ in range(3):
        for path in paths:
            with path.open("a") as handle:
                handle.write(json.dumps({**GOOD, "caller": f"{path.stem}-{round_}"}) + "\n")
        while follower.poll():
            assert files.in_use <= 2
    assert sorted(row.caller for row in rows) == sorted(
        f"usage-{index}-{round_}" for index in range(3) for round_ in range(3)
    )
    assert files.in_use == 2 and follower.reopens >= 3
    follower.close()
    assert files.in_use == 0


async def test_a_closed_connection_is_not_kept_alive_by_its_idle_timer():
    """Each connection's idle check is cancelled when it closes: a flood of short-lived
    connections (a client reconnecting as fast as it is cut off) would otherwise keep every
    one of them, buffers and all, until its timer fired 30 s later."""
    app = web.Application()
    stats = ListenerStats("web", cap=1000)
    runner, port = await start(app, stats)
    try:
        for _ in range(50):
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await writer.wait_closed()
        await wait_for(lambda: stats.open == 0)
        gc.collect()
        alive = [obj for obj in gc.get_objects() if isinstance(obj, RequestHandler)]
        assert len(alive) < 5, f"{len(alive)} closed connections still held"
    finally:
        await runner.cleanup()
