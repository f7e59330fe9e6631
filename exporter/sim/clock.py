"""Scenario time, and an event loop whose time is virtual.

``SimClock`` is the one notion of time the engine runner and the traffic driver share: the
event loop's monotonic clock times ``speed``, so a ten-minute scenario plays in a minute at
``speed=10`` and every duration the simulator reports (TTFT, queue time) is in scenario
seconds.

``VirtualTimeLoop`` is an asyncio loop whose clock only moves when nothing is ready to run: it
then jumps straight to the next timer instead of waiting for it. Run the engine runner and
the driver on it (with the in-process client, no sockets) and a scenario of hours plays in the
CPU time its events cost, deterministically, with the same code that serves real HTTP.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
from typing import Any


class SimClock:
    def __init__(self, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.speed = speed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._origin = 0.0

    def _bind(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._origin = self._loop.time()
        return self._loop

    def now(self) -> float:
        """Scenario seconds since the clock was first read."""
        return (self._bind().time() - self._origin) * self.speed

    def real_seconds(self, scenario_seconds: float) -> float:
        return max(0.0, scenario_seconds) / self.speed

    async def sleep(self, scenario_seconds: float) -> None:
        self._bind()
        await asyncio.sleep(self.real_seconds(scenario_seconds))


class _VirtualSelector(selectors.BaseSelector):
    """Polls the real selector without blocking; a wait for a timer becomes a time jump."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            # No timer at all: only another thread (an executor) can wake the loop.
            return self._real.select(0.05)
        self._loop.jump(timeout)
        return []

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop for discrete-event runs: no socket I/O, timers fire without waiting."""

    def __init__(self) -> None:
        self._virtual_now = 0.0
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def jump(self, seconds: float) -> None:
        self._virtual_now += seconds


def run_virtual(coroutine: Any) -> Any:
    """Run ``coroutine`` to completion on a fresh VirtualTimeLoop and close the loop.

    Called from a thread whose loop is running (an async caller), it runs in a worker thread
    of its own: one thread holds one running loop.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_virtual_here(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_run_virtual_here, coroutine).result()


def _run_virtual_here(coroutine: Any) -> Any:
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
