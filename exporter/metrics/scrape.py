"""The bodies /metrics answers with: negotiated, rendered in slices, gzipped, shared.

A scrape first needs a fresh read of every vLLM target, then a render of the registry in the
negotiated format, then (when ``Accept-Encoding`` allows it) gzip. ``MetricsBodies`` does the
three so that scrapes arriving together pay for them once, and never hands out a body staler
than ``EnginePoller.refresh`` would:

- One engine read is shared by the scrapes that arrive while it is in flight, as the poller
  does; a scrape arriving after it ended starts the next read.
- A body is shared by scrapes of the same format and encoding that awaited the same engine
  read and saw the same usage counters (accepted, rejected and refused events: every change
  to the usage state moves one of them) when they looked for it. While it renders, or for
  ``reuse_seconds`` after, a scrape that matches gets it; any other renders its own. With
  vLLM targets each new read is a new generation, so a finished body is only reused by
  scrapes that shared its read; without targets (usage only) a scrape in the same second with
  no new event gets the same body.
- The render gives the event loop a turn between slices (``generate_async``) and gzip runs in
  a worker thread (zlib releases the GIL), so usage ingest keeps flowing during a scrape.

Bounds: at most ``MAX_BODIES`` bodies are kept (one per format, escaping and encoding seen
lately), each released ``reuse_seconds`` after it was rendered.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from exporter.metrics.exposition import Format, render_pieces
from exporter.signals.state import SignalsState
from exporter.signals.usage import UsageState

# zlib level for gzip answers: chosen by measurement (bench/bench_render.py; the figures are
# in docs/performance.md): the exposition is so repetitive that level 1 already takes it
# well under the size goal, for a fraction of the CPU of the higher levels.
GZIP_LEVEL = 1
REUSE_SECONDS = 1.0
MAX_BODIES = 8
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # a gzip member (header with mtime 0, deflate, trailer)
_GZIP_CODINGS = ("gzip", "x-gzip")


def _quality(params: str) -> float | None:
    """The ``q`` of one Accept-Encoding item (1 when absent); None when malformed."""
    quality = 1.0
    for param in params.split(";"):
        name, _, raw = param.partition("=")
        if name.strip().lower() != "q":
            continue
        try:
            quality = float(raw.strip())
        except ValueError:
            return None
        if not 0.0 <= quality <= 1.0:
            return None
    return quality


def gzip_accepted(accept_encoding: str) -> bool:
    """Whether ``Accept-Encoding`` allows gzip: named (or ``*``) with a q above 0.

    ``gzip;q=0`` refuses it, and so does ``*;q=0`` when gzip is not named; an item with a
    malformed q is ignored. Anything else gets the identity body.
    """
    named: float | None = None
    wildcard: float | None = None
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        quality = _quality(params)
        if quality is None:
            continue
        if coding in _GZIP_CODINGS:
            named = quality if named is None else max(named, quality)
        elif coding == "*":
            wildcard = quality
    if named is not None:
        return named > 0
    return wildcard is not None and wildcard > 0


def gzip_compress(pieces: Iterable[bytes], level: int = GZIP_LEVEL) -> bytes:
    """The concatenated ``pieces`` as one gzip member; the same bytes for the same input
    (mtime 0). zlib lets go of the GIL while it compresses: run it in a worker thread."""
    compressor = zlib.compressobj(level, zlib.DEFLATED, _GZIP_WBITS)
    packed = [compressor.compress(piece) for piece in pieces]
    packed.append(compressor.flush())
    return b"".join(packed)


def usage_version(usage: UsageState) -> tuple[int, int, int]:
    """Counters that move on every change to the usage state: accepted, rejected, refused."""
    return (
        sum(usage.events.values()),
        sum(usage.rejected.values()),
        sum(usage.ingest_requests_rejected.values()),
    )


@dataclass
class _Body:
    version: tuple[int, tuple[int, int, int]]
    task: asyncio.Future[bytes]
    finished: float | None = field(default=None)


async def _next_loop_turn() -> None:
    await asyncio.sleep(0)


class MetricsBodies:
    """Renders /metrics bodies; scrapes that arrive together share the read and the render."""

    def __init__(
        self,
        registry: CollectorRegistry,
        state: SignalsState,
        refresh: Callable[[float], Awaitable[None]],
        monotonic: Callable[[], float] = time.monotonic,
        reuse_seconds: float = REUSE_SECONDS,
        gzip_level: int = GZIP_LEVEL,
    ) -> None:
        self.registry = registry
        self.state = state
        self._refresh = refresh
        self._monotonic = monotonic
        self.reuse_seconds = reuse_seconds
        self.gzip_level = gzip_level
        # Awaited between render slices; a test may wrap it to see the render run.
        self.pause: Callable[[], Awaitable[None]] = _next_loop_turn
        self.renders = 0  # renders started (each shared by the scrapes that matched it)
        self._read: asyncio.Future[int] | None = None
        self._generation = 0
        self._bodies: dict[tuple[str, ...], _Body] = {}

    def held(self) -> int:
        """Bodies kept for reuse now (at most ``MAX_BODIES``)."""
        return len(self._bodies)

    async def body(self, fmt: Format, gzip: bool, timeout: float) -> bytes:
        """The body for one scrape: ``fmt``, gzipped or not, after a (shared) engine read."""
        generation = await self._engine_read(timeout)
        key = (*fmt.key, "gzip" if gzip else "identity")
        version = (generation, usage_version(self.state.usage))
        entry = self._bodies.get(key)
        if entry is None or not self._reusable(entry, version):
            entry = self._start(key, version, self._render(fmt, gzip))
        return await asyncio.shield(entry.task)

    async def engine_read(self, timeout: float) -> int:
        """Join the engine read in flight, else start one; its generation once done (the
        status page reads vLLM through this too, sharing reads with scrapes)."""
        return await self._engine_read(timeout)

    async def _engine_read(self, timeout: float) -> int:
        """Join the engine read in flight, else start one; its generation once done."""
        if self._read is None or self._read.done():
            self._read = asyncio.ensure_future(self._read_targets(timeout))
        return await asyncio.shield(self._read)

    async def _read_targets(self, timeout: float) -> int:
        await self._refresh(timeout)
        if self.state.engine.targets:  # a read of no targets changes nothing
            self._generation += 1
        return self._generation

    def _reusable(self, entry: _Body, version: tuple[int, tuple[int, int, int]]) -> bool:
        if entry.version != version:
            return False
        if not entry.task.done():
            return True
        return (
            entry.finished is not None and self._monotonic() - entry.finished < self.reuse_seconds
        )

    def _start(
        self,
        key: tuple[str, ...],
        version: tuple[int, tuple[int, int, int]],
        render: Awaitable[bytes],
    ) -> _Body:
        entry = _Body(version, asyncio.ensure_future(render))
        self._bodies.pop(key, None)
        while len(self._bodies) >= MAX_BODIES:  # the oldest goes first
            self._bodies.pop(next(iter(self._bodies)))
        self._bodies[key] = entry
        entry.task.add_done_callback(lambda task: self._finished(key, entry))
        return entry

    def _finished(self, key: tuple[str, ...], entry: _Body) -> None:
        if entry.task.cancelled() or entry.task.exception() is not None:
            self._forget(key, entry)
            return
        entry.finished = self._monotonic()
        asyncio.get_running_loop().call_later(self.reuse_seconds, self._expire, key, entry)

    def _expire(self, key: tuple[str, ...], entry: _Body) -> None:
        """Release a body once it can no longer be reused (by the injected clock)."""
        if self._bodies.get(key) is not entry:
            return
        if self._reusable(entry, entry.version):
            asyncio.get_running_loop().call_later(self.reuse_seconds, self._expire, key, entry)
        else:
            self._forget(key, entry)

    def _forget(self, key: tuple[str, ...], entry: _Body) -> None:
        if self._bodies.get(key) is entry:
            del self._bodies[key]

    async def _render(self, fmt: Format, gzip: bool) -> bytes:
        self.renders += 1
        pieces = await render_pieces(self.registry, fmt, self.pause)
        if gzip:
            return await asyncio.to_thread(gzip_compress, pieces, self.gzip_level)
        return await asyncio.to_thread(b"".join, pieces)
