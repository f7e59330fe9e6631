"""Clients the traffic driver sends through: OpenAI HTTP (any vLLM), or the simulator in-process.

Both read a response the way a proxy does: the text of the choices, the usage (and vLLM's
per-request ``metrics``, when the server sends them) from the body or, in a stream, from the
final chunk whose ``choices`` is empty, and the time to first token measured at the client
(first chunk carrying a choice). A non-streamed response has no
measurable TTFT and reports none. The HTTP client converts what it measures into scenario
seconds when the server says it runs faster than real time (``X-Simulator-Speed``); a real
vLLM sends no such header and its TTFT is taken as measured.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from exporter.sim.api import CHAT, ApiError, SimService
from exporter.sim.clock import SimClock
from exporter.sim.server import SPEED_HEADER

PATHS = {CHAT: "/v1/chat/completions", "completion": "/v1/completions"}


@dataclass(frozen=True)
class Completion:
    """What came back: ``status`` is the HTTP status, or a word when there was no response."""

    status: int | str
    model: str | None = None
    usage: Mapping[str, Any] | None = None
    ttft_seconds: float | None = None
    text: str = ""
    error: str | None = None
    metrics: Mapping[str, Any] | None = None  # vLLM's per-request metrics, as sent

    @property
    def ok(self) -> bool:
        return isinstance(self.status, int) and 200 <= self.status < 300


class Client(Protocol):
    async def send(
        self, kind: str, body: dict[str, Any], caller: str, session: str | None = None
    ) -> Completion: ...

    async def close(self) -> None: ...


class StreamReader:
    """Accumulates streamed chunks: text, model, and the usage of the final chunk."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.usage: Mapping[str, Any] | None = None
        self.metrics: Mapping[str, Any] | None = None
        self.model: str | None = None
        self.started = False

    def feed(self, chunk: Any) -> bool:
        """Fold one chunk in; True when it is the first one carrying a choice (first token)."""
        if not isinstance(chunk, Mapping):
            return False
        if isinstance(chunk.get("model"), str):
            self.model = chunk["model"]
        if isinstance(chunk.get("usage"), Mapping):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("metrics"), Mapping):
            self.metrics = chunk["metrics"]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            return False
        for choice in choices:
            if not isinstance(choice, Mapping):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, Mapping) else choice.get("text")
            if isinstance(text, str):
                self.parts.append(text)
        first = not self.started
        self.started = True
        return first

    @property
    def text(self) -> str:
        return "".join(self.parts)


def response_text(body: Mapping[str, Any]) -> str:
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return ""
    choice = choices[0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, Mapping) else choice.get("text")
    return text if isinstance(text, str) else ""


def _error_message(body: Any, fallback: str) -> str:
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping) and isinstance(error.get("message"), str):
            return error["message"][:300]
        if isinstance(body.get("message"), str):
            return body["message"][:300]
    return fallback


class HttpClient:
    """POSTs to an OpenAI-compatible server; the caller goes in ``user`` and ``X-Caller``,
    the conversation in ``X-Session-Id`` (the tap's headers: through it, a turn is judged
    against its own conversation's previous one, and a miss can be told evicted)."""

    def __init__(
        self,
        base_url: str,
        timeout: float = 3600.0,
        caller_header: str = "X-Caller",
        api_key: str = "",
        session_header: str = "X-Session-Id",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.timeout = timeout
        self.caller_header = caller_header
        self.session_header = session_header
        self.api_key = api_key
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=10)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def models(self) -> list[str]:
        async with self._client().get(self.base_url + "/v1/models") as response:
            body = await response.json(content_type=None)
        data = body.get("data") if isinstance(body, Mapping) else None
        return [
            item["id"]
            for item in data or []
            if isinstance(item, Mapping) and isinstance(item.get("id"), str)
        ]

    async def send(
        self, kind: str, body: dict[str, Any], caller: str, session: str | None = None
    ) -> Completion:
        body = dict(body, user=caller)
        headers = {self.caller_header: caller}
        if session is not None:
            headers[self.session_header] = session
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with self._client().post(
                self.base_url + PATHS[kind], json=body, headers=headers
            ) as response:
                scale = _speed(response.headers.get(SPEED_HEADER))
                if response.status >= 400 or not body.get("stream"):
                    payload = await _json_or_none(response)
                    if response.status >= 400:
                        return Completion(
                            response.status,
                            error=_error_message(payload, f"HTTP {response.status}"),
                        )
                    if not isinstance(payload, Mapping):
                        return Completion("bad_response", error="response is not JSON")
                    usage = payload.get("usage")
                    metrics = payload.get("metrics")
                    return Completion(
                        response.status,
                        payload.get("model"),
                        usage if isinstance(usage, Mapping) else None,
                        None,
                        response_text(payload),
                        metrics=metrics if isinstance(metrics, Mapping) else None,
                    )
                reader = StreamReader()
                ttft: float | None = None
                async for data in _sse_data(response):
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        continue
                    if reader.feed(chunk):
                        ttft = (loop.time() - started) * scale
                return Completion(
                    response.status,
                    reader.model,
                    reader.usage,
                    ttft,
                    reader.text,
                    metrics=reader.metrics,
                )
        except asyncio.TimeoutError:
            return Completion("timeout", error=f"no complete answer within {self.timeout:g}s")
        except aiohttp.ClientConnectorError as err:
            return Completion("connect_error", error=str(err.os_error or err))
        except aiohttp.ClientError as err:
            return Completion("http_error", error=f"{type(err).__name__}: {err}")


def _speed(raw: str | None) -> float:
    try:
        value = float(raw) if raw else 1.0
    except ValueError:
        return 1.0
    return value if math.isfinite(value) and value > 0 else 1.0


async def _json_or_none(response: aiohttp.ClientResponse) -> Any:
    try:
        return json.loads(await response.read())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


async def _sse_data(response: aiohttp.ClientResponse) -> Any:
    """The ``data:`` payloads of a server-sent event stream (lines of any length)."""
    pending = b""
    async for chunk in response.content.iter_any():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw_line in lines:
            line = raw_line.decode("utf-8", "replace").strip()
            if line.startswith("data:"):
                yield line[5:].strip()
    line = pending.decode("utf-8", "replace").strip()
    if line.startswith("data:"):
        yield line[5:].strip()


class InProcessClient:
    """Talks to a simulator in the same event loop: no sockets, so it runs in virtual time.

    Responses are built by the same code that answers HTTP and read back by the same
    ``StreamReader``, so what the driver reports is what it would report over HTTP.
    """

    def __init__(self, service: SimService, clock: SimClock) -> None:
        self.service = service
        self.clock = clock

    async def close(self) -> None:
        return None

    async def send(
        self, kind: str, body: dict[str, Any], caller: str, session: str | None = None
    ) -> Completion:
        service = self.service
        started = self.clock.now()
        try:
            request = service.parse(kind, dict(body, user=caller))
        except ApiError as err:
            return Completion(err.status, error=err.message)
        running = service.start(request)
        try:
            got_first = await service.first_token(running)
            first_at = self.clock.now()
            outcome = await service.outcome(running)
        except ApiError as err:
            return Completion(err.status, error=err.message)
        finally:
            if not running.handle.done.done():
                service.abort(running)
        if not request.stream:
            payload = service.response(running, outcome)
            return Completion(
                200,
                payload["model"],
                payload["usage"],
                None,
                response_text(payload),
                metrics=payload["metrics"],
            )
        reader = StreamReader()
        chunks: list[dict[str, Any]] = []
        if kind == CHAT:
            chunks.append(service.chunk(running, None, role=True))
        chunks.append(service.chunk(running, running.reply.text(0, outcome.completion_tokens)))
        chunks.append(service.chunk(running, "", finish_reason=outcome.finish_reason))
        if request.include_usage:
            chunks.append(service.usage_chunk(running, outcome))
        for chunk in chunks:
            reader.feed(json.loads(json.dumps(chunk)))
        ttft = first_at - started if got_first else None
        return Completion(
            200, reader.model, reader.usage, ttft, reader.text, metrics=reader.metrics
        )
