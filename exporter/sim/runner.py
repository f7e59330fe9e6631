"""Drive the pure engine from an event loop: one task sleeps until the engine's next event.

The runner is the only place where the engine meets time: it reads the shared ``SimClock``,
hands the engine ``now``, and turns what the engine reports into resolved futures for the
request handlers (HTTP front or in-process client) and into samples for /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from exporter.sim.clock import SimClock
from exporter.sim.engine import (
    Admitted,
    Engine,
    EngineEvent,
    Finished,
    FirstToken,
    Rejected,
    Request,
)


@dataclass
class Handle:
    """A submitted request: awaitable first token and end, in scenario seconds."""

    request: Request
    first_token: asyncio.Future[float] = field(repr=False)
    done: asyncio.Future[Finished | Rejected] = field(repr=False)


Observer = Callable[[EngineEvent], None]


class EngineRunner:
    def __init__(self, engine: Engine, clock: SimClock, observers: Sequence[Observer] = ()) -> None:
        self.engine = engine
        self.clock = clock
        self.observers = list(observers)
        self._handles: dict[str, Handle] = {}
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self.clock.now()  # bind the clock to this loop before anything is timed
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for handle in self._handles.values():
            for future in (handle.first_token, handle.done):
                if not future.done():
                    future.cancel()
        self._handles.clear()

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids):08x}"

    def submit(
        self,
        prompt: Sequence[int],
        output: Sequence[int],
        max_tokens: int,
        request_id: str,
        declared_max_tokens: int = 0,
    ) -> Handle:
        loop = asyncio.get_running_loop()
        now = self.clock.now()
        request = Request(
            request_id, prompt, output, now, max_tokens, declared_max_tokens=declared_max_tokens
        )
        handle = Handle(request, loop.create_future(), loop.create_future())
        self._handles[request_id] = handle
        self.engine.submit(request, now)
        self._pump()
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> None:
        if request_id in self._handles:
            self.engine.abort(request_id, self.clock.now())
            self._pump()
            self._wake.set()

    def generated(self, request_id: str) -> int:
        """Output tokens of a running request so far (to stream them as they come)."""
        self.engine.advance(self.clock.now())
        self._pump()
        handle = self._handles.get(request_id)
        return handle.request.generated_tokens if handle else 0

    def refresh(self) -> None:
        """Bring the engine up to now (before rendering /metrics)."""
        self.engine.advance(self.clock.now())
        self._pump()

    def _pump(self) -> None:
        for event in self.engine.drain():
            for observer in self.observers:
                observer(event)
            handle = self._handles.get(event.seq.request_id)
            if handle is None or isinstance(event, Admitted):
                continue
            if isinstance(event, FirstToken):
                if not handle.first_token.done():
                    handle.first_token.set_result(event.time)
            elif isinstance(event, (Finished, Rejected)):
                # first_token stays pending when there was none: wait on both futures.
                if not handle.done.done():
                    handle.done.set_result(event)
                del self._handles[event.seq.request_id]

    async def _run(self) -> None:
        engine = self.engine
        clock = self.clock
        while True:
            engine.advance(clock.now())
            self._pump()
            when = engine.next_event_time()
            self._wake.clear()
            timeout = None if when is None else clock.real_seconds(when - clock.now())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
