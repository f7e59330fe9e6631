"""Where the driver's per-request usage goes: the exporter's POST /v1/usage, stdout, or a list.

The driver reports what a proxy in front of vLLM would: the caller, the model the response
names, the usage the response carried (``cached_tokens`` null when the response had no
``prompt_tokens_details``: never a made-up 0), the TTFT measured at the client, vLLM's own
TTFT and queue wait when the response carried its per-request ``metrics``
(``--enable-per-request-metrics``), the session, when it finished and how it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TextIO

import aiohttp

from exporter.sim.client import Completion

log = logging.getLogger(__name__)

MAX_PENDING = 10_000  # events kept while the exporter is unreachable
MAX_BATCH = 500
RETRY_SECONDS = (0.5, 1.0, 2.0, 5.0)


def usage_event(
    caller: str,
    session: str | None,
    completion: Completion,
    finished_at: float,
    max_tokens: int | None = None,
    backend: str | None = None,
) -> dict[str, Any] | None:
    """The native usage event for one request; None when a success carried no usage.
    ``max_tokens`` is what the request declared, as a proxy that sees the request knows;
    ``backend`` the vLLM it was sent to (its base URL, without credentials)."""
    event: dict[str, Any] = {"caller": caller, "time": round(finished_at, 3)}
    if backend:
        event["backend"] = backend
    if session:
        event["session"] = session
    if completion.model:
        event["model"] = completion.model
    if not completion.ok:
        event["status"] = completion.status
        return event
    usage = completion.usage
    if not isinstance(usage, Mapping) or type(usage.get("prompt_tokens")) is not int:
        return None
    event["prompt_tokens"] = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    event["cached_tokens"] = cached if type(cached) is int else None
    if type(usage.get("completion_tokens")) is int:
        event["completion_tokens"] = usage["completion_tokens"]
    if max_tokens is not None:
        event["max_tokens"] = max_tokens
    if completion.ttft_seconds is not None:
        event["ttft_seconds"] = round(completion.ttft_seconds, 6)
    metrics = completion.metrics
    if metrics is not None:
        for key, field in (
            ("time_to_first_token_ms", "engine_ttft_seconds"),
            ("queue_time_ms", "engine_queue_seconds"),
        ):
            value = metrics.get(key)
            # As sent (the exporter checks the range), if it is a number a float can hold.
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and -1e15 < value < 1e15
            ):
                event[field] = value / 1000
    event["status"] = completion.status
    return event


class Reporter(Protocol):
    def report(self, event: dict[str, Any]) -> None: ...

    async def close(self) -> None: ...


class ListReporter:
    """Keeps events with the scenario time they were reported at (tests, virtual runs)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.events: list[tuple[float, dict[str, Any]]] = []

    def report(self, event: dict[str, Any]) -> None:
        self.events.append((self.clock(), event))

    async def close(self) -> None:
        return None


class LineReporter:
    """One JSON object per line (a JSONL file the exporter's --usage.file can follow)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.closed = False

    def report(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        try:
            self.stream.write(json.dumps(event, separators=(",", ":")) + "\n")
            self.stream.flush()
        except BrokenPipeError:  # the reader went away (| head): stop writing, quietly
            self.closed = True
            with contextlib.suppress(OSError, ValueError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.stream.fileno())

    async def close(self) -> None:
        return None


class HttpReporter:
    """POSTs batches to the exporter's /v1/usage from a background task, retrying failures.

    Reporting never slows the conversations down: events queue (bounded by ``MAX_PENDING``;
    beyond it the oldest are dropped and counted) and go out as JSON arrays.
    """

    def __init__(
        self,
        exporter_url: str,
        token: str = "",
        timeout: float = 10.0,
        retry_seconds: tuple[float, ...] = RETRY_SECONDS,
        max_pending: int = MAX_PENDING,
    ) -> None:
        base = exporter_url.rstrip("/")
        self.url = base if base.endswith("/v1/usage") else base + "/v1/usage"
        self.token = token
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self.max_pending = max_pending
        self.pending: deque[dict[str, Any]] = deque()
        self.sent = 0
        self.dropped = 0
        self.failures = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._closing = False

    def report(self, event: dict[str, Any]) -> None:
        if len(self.pending) >= self.max_pending:
            self.pending.popleft()
            self.dropped += 1
        self.pending.append(event)
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        self._wake.set()

    async def close(self, flush_seconds: float = 5.0) -> None:
        """Send what is pending (for at most ``flush_seconds``), then stop."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), flush_seconds)
            except asyncio.TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        if self._session is not None:
            await self._session.close()
        if self.pending:
            log.warning("%d usage event(s) not delivered to %s", len(self.pending), self.url)

    async def _run(self) -> None:
        attempt = 0
        while True:
            if not self.pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self.pending[i] for i in range(min(MAX_BATCH, len(self.pending)))]
            if await self._post(batch):
                for _ in batch:
                    self.pending.popleft()
                self.sent += len(batch)
                attempt = 0
                continue
            self.failures += 1  # retried until delivered, or until close() gives up
            delays = self.retry_seconds
            await asyncio.sleep(delays[min(attempt, len(delays) - 1)])
            attempt += 1

    async def _post(self, batch: list[dict[str, Any]]) -> bool:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            async with self._session.post(
                self.url, data=json.dumps(batch), headers=headers
            ) as response:
                text = await response.text()
                if response.status < 300:
                    return True
                if 400 <= response.status < 500 and response.status not in (408, 429):
                    # Our events or our token are wrong: retrying cannot help; drop the batch.
                    log.error(
                        "exporter refused %d usage event(s): HTTP %d %s",
                        len(batch),
                        response.status,
                        text[:200],
                    )
                    self.dropped += len(batch)
                    for _ in batch:
                        self.pending.popleft()
                    return False
                log.warning(
                    "exporter answered HTTP %d to usage events; will retry", response.status
                )
                return False
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            log.warning("cannot reach %s (%s); will retry", self.url, type(err).__name__)
            return False
