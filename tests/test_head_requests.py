"""HEAD on every route of both listeners, sent on a raw socket with a GET pipelined behind
it: the HEAD gets a GET's status and headers and no body, so the next answer on the
connection is read from its own first byte (``HEAD /metrics`` used to send the metrics text
after its headers, and a pipelined request's answer was read out of it)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from exporter.config import Config
from exporter.limits import LimitedRunner, ListenerStats
from exporter.server import create_app
from exporter.wiring import signals_state, tap_app
from tests.tap.conftest import MockUpstream, Reply, upstream  # noqa: F401 (fixture)

HEALTHY = b"vllm-cache-exporter is healthy.\n"


async def serve(app: web.Application) -> tuple[LimitedRunner, int]:
    runner = LimitedRunner(app, ListenerStats("test", 16), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on one connection, read until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


def head_then(path: str, after: str) -> bytes:
    return (
        f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n"
        f"GET {after} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    ).encode()


def split_head(wire: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, everything after the blank line) of the first answer."""
    head, separator, rest = wire.partition(b"\r\n\r\n")
    assert separator, wire[:200]
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split(" ")[1]), headers, rest


@pytest.mark.parametrize(
    "path, status",
    [
        ("/metrics", 200),
        ("/metrics?x=1", 200),
        ("/", 200),
        ("/-/healthy", 200),
        ("/-/ready", 200),
        ("/v1/usage", 405),
        ("/no-such-page", 404),
    ],
)
async def test_head_on_the_web_listener_sends_no_body(path, status):
    runner, port = await serve(create_app(Config(), initial_refresh=False))
    try:
        got, headers, rest = split_head(await exchange(port, head_then(path, "/-/healthy")))
        # The pipelined GET's answer starts right after the HEAD's headers.
        assert rest.startswith(b"HTTP/1.1 200 OK\r\n"), rest[:120]
        assert rest.endswith(b"\r\n\r\n" + HEALTHY)
        assert got == status
        if path.startswith("/metrics"):
            assert headers["content-type"].startswith("text/plain; version=0.0.4")
            assert int(headers["content-length"]) > 1000  # a GET's length, not sent
    finally:
        await runner.cleanup()


async def test_head_metrics_declares_the_length_a_get_gets():
    runner, port = await serve(create_app(Config(), initial_refresh=False))
    try:
        for _ in range(2):  # the second scrape: the render's own timings are in the body
            get_wire = await exchange(
                port,
                b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
                b"Accept-Encoding: gzip\r\nConnection: close\r\n\r\n",
            )
        _, get_headers, get_body = split_head(get_wire)
        _, headers, rest = split_head(
            await exchange(
                port,
                b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n"
                b"Connection: close\r\n\r\n",
            )
        )
        assert rest == b""
        assert headers["content-encoding"] == get_headers["content-encoding"] == "gzip"
        assert int(get_headers["content-length"]) == len(get_body)
        assert abs(int(headers["content-length"]) - len(get_body)) < 64  # a timing or two
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    "path, status", [("/v1/models", 200), ("/v1/chat/completions", 200), ("/no-such-route", 404)]
)
async def test_head_through_the_tap_sends_no_body(
    upstream: MockUpstream,  # noqa: F811
    path,
    status,
):
    upstream.reply("/v1/models", Reply(body=b'{"object": "list", "data": []}'))
    upstream.reply("/v1/chat/completions", Reply(body=b'{"a": 1}'))
    config = Config(tap_listen_address="127.0.0.1:0", tap_upstream=upstream.url)
    runner, port = await serve(tap_app(config, signals_state(config).usage))
    try:
        got, headers, rest = split_head(await exchange(port, head_then(path, "/v1/models")))
        assert got == status
        assert rest.startswith(b"HTTP/1.1 200 OK\r\n"), rest[:120]
        assert rest.endswith(b"\r\n\r\n" + b'{"object": "list", "data": []}')
        assert [(seen.method, seen.path_qs) for seen in upstream.received] == [
            ("HEAD", path),
            ("GET", "/v1/models"),
        ]
        if status == 200:
            assert headers["content-length"] == str(len(upstream.replies[path].body))
    finally:
        await runner.cleanup()
