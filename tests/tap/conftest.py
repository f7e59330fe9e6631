"""A scriptable stand-in for vLLM's OpenAI API, and the tap in front of it.

The mock upstream answers with the real vLLM 0.32.0 captures in tests/fixtures, in whatever
chunks a test asks for, and can be told to wait for an event between chunks, fail, hang or
close the connection. It remembers every request it got (headers and exact body bytes).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from exporter.config import Config
from exporter.signals.state import SignalsState
from exporter.wiring import signals_state, tap_app
from tests.helpers import FIXTURES

VLLM = FIXTURES / "vllm-0.32.0-cpu"


def fixture_bytes(name: str) -> bytes:
    return (VLLM / name).read_bytes()


def sse_events(raw: bytes) -> list[bytes]:
    """Split a capture into its events, each with its blank-line terminator."""
    return [part + b"\n\n" for part in raw.split(b"\n\n") if part]


def without_usage_chunk(raw: bytes) -> bytes:
    """What vLLM sends a client that did not ask for usage, from a stream that has it: no
    usage chunk, and its ``system_fingerprint`` on the terminal chunks instead (see
    ``23_chat_stream_no_usage.sse.txt`` beside ``24_chat_stream_usage.sse.txt``)."""
    events = sse_events(raw)
    fingerprint = re.search(
        rb'"choices":\[\],"usage".*?("system_fingerprint":"[^"]*")', b"".join(events)
    )
    kept = [event for event in events if b'"choices":[],"usage"' not in event]
    if fingerprint is None:
        return b"".join(kept)
    return b"".join(
        event.replace(b"}\n\n", b"," + fingerprint.group(1) + b"}\n\n")
        if b'"finish_reason":"' in event
        else event
        for event in kept
    )


@dataclass
class Received:
    method: str
    path_qs: str
    headers: CIMultiDict[str]
    body: bytes


@dataclass
class Reply:
    """One scripted answer. ``chunks`` are written one by one; a chunk that is an
    asyncio.Event is awaited instead of written (so a test decides when the stream goes on)."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes | asyncio.Event | Callable[[], None]] | None = None
    hang: bool = False
    cut_after_chunks: bool = False  # close the connection instead of ending the stream


class MockUpstream:
    def __init__(self) -> None:
        self.replies: dict[str, Reply] = {}
        self.received: list[Received] = []
        self.cancelled = asyncio.Event()  # an upstream handler saw its client go away
        self.release = asyncio.Event()
        self.url = ""

    def reply(self, path: str, reply: Reply) -> None:
        self.replies[path] = reply

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(
            Received(request.method, request.path_qs, request.headers.copy(), body)
        )
        reply = self.replies.get(request.path)
        if reply is None:
            return web.Response(
                status=404, text=f"no route {request.path}", headers={"X-Mock": "404"}
            )
        try:
            if reply.hang:
                await self.release.wait()
            if reply.chunks is None:
                return web.Response(
                    status=reply.status,
                    body=reply.body,
                    headers={"Content-Type": reply.content_type, **reply.headers},
                )
            response = web.StreamResponse(
                status=reply.status, headers={"Content-Type": reply.content_type, **reply.headers}
            )
            await response.prepare(request)
            for chunk in reply.chunks:
                if isinstance(chunk, asyncio.Event):
                    await chunk.wait()
                elif callable(chunk):
                    chunk()
                else:
                    await response.write(chunk)
            if reply.cut_after_chunks:
                assert request.transport is not None
                request.transport.close()
                return response
            await response.write_eof()
            return response
        except (asyncio.CancelledError, ConnectionError):
            self.cancelled.set()
            raise


class RecordingUsage:
    """Stands in for the usage signals where a test checks exactly what the tap handed over."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.rejected: list[tuple[str, str]] = []
        self.recorded = asyncio.Event()

    def record(self, event: Any, reader: str = "") -> str:
        assert reader == "tap"
        self.events.append(event)
        self.recorded.set()
        return "accepted"

    def record_prompt(self, event: Any, prompt: Any) -> None:
        """The prompt-order step (its own tests read the real signals)."""

    def reject(self, reader: str, reason: str) -> None:
        assert reader == "tap"
        self.rejected.append((reader, reason))

    async def next_event(self, timeout: float = 5.0) -> Any:
        """Events are recorded when the tap's handler ends, which may be after the client
        has its answer: wait for it."""
        await asyncio.wait_for(self.recorded.wait(), timeout)
        self.recorded.clear()
        return self.events[-1]


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> Callable[[], None]:
        def step() -> None:
            self.now += seconds

        return step


@dataclass
class TapHarness:
    upstream: MockUpstream
    usage: RecordingUsage
    clock: FakeClock
    url: str
    session: aiohttp.ClientSession
    state: SignalsState

    async def post(
        self,
        path: str,
        payload: Any = None,
        *,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, CIMultiDict[str], bytes]:
        body = data if data is not None else json.dumps(payload).encode()
        async with self.session.post(
            self.url + path,
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
        ) as response:
            return response.status, response.headers.copy(), await response.read()


TapFactory = Callable[..., Awaitable[TapHarness]]


@pytest.fixture
async def upstream(aiohttp_server: Callable[..., Awaitable[TestServer]]):
    mock = MockUpstream()
    # Bodies as sent, as vLLM (uvicorn) takes them: it decodes no content coding.
    app = web.Application(client_max_size=1024**3, handler_args={"auto_decompress": False})
    app.router.add_route("*", "/{tail:.*}", mock.handle)
    server = await aiohttp_server(app)
    mock.url = str(server.make_url("")).rstrip("/")
    yield mock
    mock.release.set()


@pytest.fixture
async def start_tap(upstream: MockUpstream, aiohttp_server: Callable[..., Awaitable[TestServer]]):
    """Start a tap in front of the mock upstream; keyword arguments override Config."""
    sessions: list[aiohttp.ClientSession] = []

    async def start(
        usage: Any = None, upstream_url: str | None = None, **overrides: Any
    ) -> TapHarness:
        config = Config(
            tap_listen_address="127.0.0.1:0", tap_upstream=upstream_url or upstream.url, **overrides
        )
        state = signals_state(config)
        recording = RecordingUsage()
        state.usage = usage if usage is not None else recording
        clock = FakeClock()
        server = await aiohttp_server(tap_app(config, state.usage, monotonic=clock))
        session = aiohttp.ClientSession(auto_decompress=False)
        sessions.append(session)
        return TapHarness(
            upstream, recording, clock, str(server.make_url("")).rstrip("/"), session, state
        )

    yield start
    for session in sessions:
        await session.close()
