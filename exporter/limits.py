"""Bounds on what clients can take from the process: connections, idle time, log volume.

- Connections: each listener keeps at most ``max_connections`` open. A new one beyond that
  makes the oldest close once its current request (if any) is answered, so a flood of idle
  sockets cannot lock out Prometheus: the newest connections, which are about to send a
  request, are served, and the oldest, mostly idle ones, go. One still sending its request
  (its line, headers or body: nothing of it is being answered yet) goes at once, so
  connections trickling bodies cannot hold a listener either. Past ``HARD_SLACK`` more
  (closes still in progress) a connection is answered ``503`` and closed. Both are counted.
- Descriptors: the process's soft file-descriptor limit is raised to its hard limit at start
  (as Go programs do), and one budget (``plan_descriptors``) splits it between the web
  listener's connections, the tap's (each counted twice: a tap call also holds a socket to
  vLLM, whose number the tap's session is held to), the followed usage files (a share the
  follower asks before opening a file, ``FileDescriptors``) and the rest of the process
  (``RESERVED_FDS``), so descriptors (and with them ``/metrics``) never run out.
- Idle time: a connection that has not sent a complete request within ``IDLE_SECONDS`` of
  opening, or of its last response, is closed, also while its request line and headers
  trickle in byte by byte (recent aiohttp does this itself; the exporter's own timer does it
  whatever aiohttp's version).
- Log volume: a message repeated within ``LOG_WINDOW_SECONDS`` is written
  ``LOG_BURST`` times, then counted instead; the count is logged once the window passes,
  and exported. A flood of bad input writes a counter, not megabytes of tracebacks.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import resource
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client.core import Metric

from exporter import families

log = logging.getLogger(__name__)

IDLE_SECONDS = 30.0
# File descriptors kept free of client connections (vLLM reads, the tap's upstream
# connections, followed files, the listening sockets).
RESERVED_FDS = 64
LOG_WINDOW_SECONDS = 60.0
LOG_BURST = 5
LOG_KEYS_MAX = 1024
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 24\r\n\r\ntoo many connections now\n"
)


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


# glibc's malloc: blocks from this size up are mapped on their own; free memory at the top of
# the heap is given back to the system only past the trim size.
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 16 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_MALLOC_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Fix glibc malloc's thresholds (MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES); True when
    set.

    By default glibc adapts both to the largest block freed: the tap's 100k-token requests
    (two 400 KB buffers alive together) then leave more than the trim size free at the top
    of the heap, which is given back to the system and faulted in again by the next request,
    about 100 page faults and 0.2 ms of system time a request: a quarter of the tap's CPU on
    such a request (docs/performance.md). Fixed, the freed memory is reused: at most
    TRIM_THRESHOLD_BYTES of it is kept beyond what is in use, and blocks from
    MMAP_THRESHOLD_BYTES up (a rare request or answer of several MB) are mapped and
    unmapped on their own as before. Left alone where the environment already tunes malloc,
    and where the C library is not glibc.
    """
    if any(name in (os.environ if environ is None else environ) for name in _MALLOC_ENVIRONMENT):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


# Connections open beyond the cap while the oldest ones finish their requests.
HARD_SLACK = 64
# Descriptors one connection of a listener holds: the tap's also holds one to vLLM.
TAP_DESCRIPTORS_PER_CONNECTION = 2
# The followed files' share of the budget when usage files are followed (one in this many).
FILES_SHARE_DIVISOR = 8


@dataclass(frozen=True)
class DescriptorPlan:
    """How the process's descriptors are shared out (``plan_descriptors``)."""

    limit: int
    caps: dict[str, int]  # listener -> connections served at once
    slacks: dict[str, int]  # listener -> connections open beyond that while others close
    per_connection: dict[str, int]  # listener -> descriptors one connection holds
    files: int  # followed usage files open at once

    def reserved(self) -> dict[str, int]:
        """Descriptors set aside for each use: every listener, ``files``, and ``process``
        (what is left: vLLM reads, listening sockets, logs, the interpreter)."""
        shares = {
            name: (cap + self.slacks[name]) * self.per_connection[name]
            for name, cap in self.caps.items()
        }
        shares["files"] = self.files
        shares["process"] = max(0, self.limit - sum(shares.values()))
        return shares

    def lowered(self, requested: Mapping[str, int]) -> bool:
        return any(self.caps[name] < wanted for name, wanted in requested.items())


def plan_descriptors(
    fd_limit: int, listeners: Mapping[str, tuple[int, int]], follow_files: bool = False
) -> DescriptorPlan:
    """Share ``fd_limit`` descriptors out: ``listeners`` maps a name to (connections asked
    for, descriptors per connection).

    ``RESERVED_FDS`` stay with the rest of the process; followed files get an eighth of the
    remainder when there are any; the listeners get what they asked for (and their slack)
    when it fits, else the same fraction of it each, a listener's slack then an eighth of
    its connections (at most ``HARD_SLACK``), never fewer than one connection.
    """
    available = max(0, fd_limit - RESERVED_FDS)
    files = max(1, available // FILES_SHARE_DIVISOR) if follow_files else 0
    room = max(0, available - files)
    wanted = {name: (asked + HARD_SLACK) * cost for name, (asked, cost) in listeners.items()}
    scale = min(1.0, room / sum(wanted.values())) if wanted and sum(wanted.values()) else 1.0
    caps: dict[str, int] = {}
    slacks: dict[str, int] = {}
    for name, (asked, cost) in listeners.items():
        if scale >= 1.0:
            caps[name], slacks[name] = asked, HARD_SLACK
            continue
        connections = int(wanted[name] * scale) // cost  # cap and slack together
        slacks[name] = min(HARD_SLACK, connections // 8)
        caps[name] = max(1, min(asked, connections - slacks[name]))
    return DescriptorPlan(
        fd_limit, caps, slacks, {name: cost for name, (_asked, cost) in listeners.items()}, files
    )


def connection_cap(requested: int, fd_limit: int) -> int:
    """The cap in force for a listener alone: what was asked, kept below the descriptors
    the process has (with room for the slack)."""
    return plan_descriptors(fd_limit, {"web": (requested, 1)}).caps["web"]


class FileDescriptors:
    """The followed files' share of the descriptors: the follower asks for one before it
    opens a file (``acquire``; False: put the file off to a later poll) and gives it back
    when it lets the file go (``release``)."""

    def __init__(self, share: int) -> None:
        self.share = share
        self.in_use = 0
        self.refused = 0

    def acquire(self) -> bool:
        if self.in_use >= self.share:
            self.refused += 1
            return False
        self.in_use += 1
        return True

    def release(self) -> None:
        self.in_use = max(0, self.in_use - 1)


class FollowedFiles(Protocol):
    """What ``FollowedFilesCollector`` reads of the usage-file follower (exporter/usage/tail.py
    ``FileFollower``; limits imports nothing of the package)."""

    @property
    def files(self) -> Mapping[Any, Any]: ...
    @property
    def max_open(self) -> int: ...
    @property
    def reopens(self) -> int: ...
    @property
    def over_limit(self) -> int: ...
    @property
    def lost_bytes(self) -> Mapping[str, int]: ...
    @property
    def open_files(self) -> int: ...


class FollowedFilesCollector:
    """``vllm_cache_usage_files``, ``_files_open_max``, ``_file_reopens_total`` and
    ``_file_lost_bytes_total``: the bounds on followed files, and what they cost."""

    def __init__(self, follower: FollowedFiles) -> None:
        self.follower = follower

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        follower = self.follower
        files = families.gauge(families.USAGE_FILES)
        open_now = follower.open_files
        files.add_metric(["open"], float(open_now))
        files.add_metric(["closed"], float(len(follower.files) - open_now))
        files.add_metric(["not_followed"], float(follower.over_limit))
        yield files
        most = families.gauge(families.USAGE_FILES_OPEN_MAX)
        most.add_metric([], float(follower.max_open))
        yield most
        reopens = families.counter(families.USAGE_FILE_REOPENS)
        reopens.add_metric([], float(follower.reopens))
        yield reopens
        lost = families.counter(families.USAGE_FILE_LOST_BYTES)
        for reason, count in sorted(follower.lost_bytes.items()):
            lost.add_metric([reason], float(count))
        yield lost


class ListenerStats:
    """Connection counts of one listener, for the self collector."""

    def __init__(self, name: str, cap: int, slack: int | None = None) -> None:
        self.name = name
        self.cap = cap
        self._slack = slack
        self.open = 0
        self.evicted = 0
        self.refused = 0
        self.idle_closed = 0

    @property
    def slack(self) -> int:
        """Connections open beyond the cap while the oldest close (``HARD_SLACK`` unless
        the descriptor plan gave less)."""
        return HARD_SLACK if self._slack is None else self._slack


def limit_connections(
    server: web.Server,
    stats: ListenerStats,
    busy: dict[object, web.BaseRequest] | None = None,
    last_done: dict[object, float] | None = None,
    idle_seconds: float | None = None,
) -> None:
    """Make aiohttp's connection manager refuse connections beyond ``stats.cap``.

    It wraps the two public callbacks every connection goes through, so it holds whatever
    aiohttp builds the server from.
    """
    made, lost = server.connection_made, server.connection_lost
    oldest_first: dict[RequestHandler, None] = {}  # open connections, in order of arrival
    closing: set[RequestHandler] = set()
    # connections with a request being answered, and that request
    busy = busy if busy is not None else {}
    last_done = last_done if last_done is not None else {}  # when each last finished one
    idle = IDLE_SECONDS if idle_seconds is None else idle_seconds
    loop = asyncio.get_running_loop()
    timers: dict[RequestHandler, asyncio.TimerHandle] = {}  # each open one's idle check

    def expire(handler: RequestHandler) -> None:
        if handler not in oldest_first or handler in closing:
            return
        quiet = loop.time() - last_done.get(handler, 0.0)
        if handler in busy or quiet < idle:
            timers[handler] = loop.call_later(
                idle if handler in busy else idle - quiet, expire, handler
            )
            return
        stats.idle_closed += 1
        closing.add(handler)
        handler.force_close()

    def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
        made(handler, transport)
        stats.open += 1
        if stats.open > stats.cap + stats.slack:
            stats.refused += 1
            # After aiohttp has started serving it (closing within connection_made would
            # leave its request task without a manager).
            asyncio.get_running_loop().call_soon(_refuse, transport)
            return
        oldest_first[handler] = None
        last_done[handler] = loop.time()
        timers[handler] = loop.call_later(idle, expire, handler)
        while len(oldest_first) - len(closing) > stats.cap:
            oldest = next(handler for handler in oldest_first if handler not in closing)
            closing.add(oldest)
            stats.evicted += 1
            request = busy.get(oldest)
            if request is not None and request.content.is_eof():
                oldest.close()  # once its request is answered
            else:
                # Idle, or still sending its request line, headers or body (the handlers
                # answer nothing before a body is whole): nothing is lost.
                oldest.force_close()

    def connection_lost(handler: RequestHandler, exc: BaseException | None = None) -> None:
        lost(handler, exc)
        stats.open -= 1
        oldest_first.pop(handler, None)
        timer = timers.pop(handler, None)
        if timer is not None:  # else it would keep the closed connection alive until it fires
            timer.cancel()
        closing.discard(handler)
        last_done.pop(handler, None)

    server.connection_made = connection_made  # type: ignore[method-assign]
    server.connection_lost = connection_lost  # type: ignore[method-assign]


def _refuse(transport: asyncio.Transport) -> None:
    if not transport.is_closing():
        transport.write(REFUSAL)
        transport.close()


class LimitedRunner(web.AppRunner):
    """An AppRunner whose server caps connections and closes idle ones."""

    def __init__(self, app: web.Application, stats: ListenerStats, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", IDLE_SECONDS)
        super().__init__(app, **kwargs)
        self.stats = stats
        self.idle_seconds = float(kwargs["keepalive_timeout"])
        self.busy: dict[object, web.BaseRequest] = {}
        self.last_done: dict[object, float] = {}

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        limit_connections(server, self.stats, self.busy, self.last_done, self.idle_seconds)
        # Which connections are answering a request (an evicted one finishes it): the
        # server's own request handler, wrapped. Each connection takes the handler when it
        # opens, so this is before the first one. (Not an app middleware: with one, aiohttp
        # runs its middleware chain for every request: 1.5% of a tap request's
        # instructions.)
        handle = server.request_handler
        busy, last_done = self.busy, self.last_done

        async def mark_busy(request: web.BaseRequest) -> web.StreamResponse:
            protocol = request.protocol
            busy[protocol] = request
            try:
                return await handle(request)
            finally:
                busy.pop(protocol, None)
                if protocol in last_done:
                    last_done[protocol] = asyncio.get_running_loop().time()

        server.request_handler = mark_busy
        return server


class RateLimitedLogs(logging.Filter):
    """Lets a message through ``burst`` times per ``window``, then counts it.

    Keyed by logger, level and the unformatted message, so one bad input repeated a
    million times is one key. The clock is injected for tests.
    """

    def __init__(
        self,
        window: float = LOG_WINDOW_SECONDS,
        burst: int = LOG_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.window = window
        self.burst = burst
        self.clock = clock
        self.suppressed_total = 0
        self._keys: dict[tuple[str, int, str], list[float]] = {}  # key -> [start, count]

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "rate_limited_summary", False):
            return True
        # The first line only: asyncio puts each task's repr after it, one key per task.
        key = (record.name, record.levelno, str(record.msg).split("\n", 1)[0][:200])
        now = self.clock()
        entry = self._keys.get(key)
        if entry is None or now - entry[0] >= self.window:
            if entry is not None and entry[1] > self.burst:
                self._summarize(record, int(entry[1]) - self.burst)
            if entry is None and len(self._keys) >= LOG_KEYS_MAX:
                self._keys.pop(next(iter(self._keys)))
            self._keys[key] = [now, 1]
            return True
        entry[1] += 1
        if entry[1] <= self.burst:
            return True
        self.suppressed_total += 1
        return False

    @staticmethod
    def _summarize(record: logging.LogRecord, count: int) -> None:
        logging.getLogger(record.name).log(
            record.levelno,
            "%d more message(s) like %r were not logged in the last window",
            count,
            str(record.msg)[:120],
            extra={"rate_limited_summary": True},
        )


def install_log_limits(filter_: RateLimitedLogs) -> None:
    """Put the filter on every handler of the root logger (where records are written)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(filter_)


class SendStats:
    """What sending /metrics bodies cost: readers cut off for being too slow."""

    def __init__(self) -> None:
        self.cut = 0


class SendStatsCollector:
    def __init__(self, stats: SendStats) -> None:
        self.stats = stats

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        cut = families.counter(families.EXPORTER_SCRAPES_CUT)
        cut.add_metric([], float(self.stats.cut))
        yield cut


class LimitsCollector:
    """``vllm_cache_exporter_connections``, ``_connections_refused_total``,
    ``_log_messages_suppressed_total`` and, given the plan, the descriptor budget
    (``_fds_reserved``, ``_fds_refused_total``)."""

    def __init__(
        self,
        listeners: list[ListenerStats],
        logs: RateLimitedLogs | None,
        plan: DescriptorPlan | None = None,
        files: FileDescriptors | None = None,
    ) -> None:
        self.listeners = listeners
        self.logs = logs
        self.plan = plan
        self.files = files

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        open_now = families.gauge(families.EXPORTER_CONNECTIONS)
        cap = families.gauge(families.EXPORTER_CONNECTIONS_MAX)
        evicted = families.counter(families.EXPORTER_CONNECTIONS_EVICTED)
        refused = families.counter(families.EXPORTER_CONNECTIONS_REFUSED)
        for stats in self.listeners:
            open_now.add_metric([stats.name], float(stats.open))
            cap.add_metric([stats.name], float(stats.cap))
            evicted.add_metric([stats.name], float(stats.evicted))
            refused.add_metric([stats.name], float(stats.refused))
        yield open_now
        yield cap
        yield evicted
        yield refused
        if self.plan is not None:
            reserved = families.gauge(families.EXPORTER_FDS_RESERVED)
            for use, count in self.plan.reserved().items():
                reserved.add_metric([use], float(count))
            yield reserved
            denied = families.counter(families.EXPORTER_FDS_REFUSED)
            denied.add_metric(["files"], float(self.files.refused if self.files else 0))
            yield denied
        if self.logs is not None:
            suppressed = families.counter(
                families.EXPORTER_LOG_MESSAGES_SUPPRESSED,
                families.EXPORTER_LOG_MESSAGES_SUPPRESSED.help.format(
                    burst=LOG_BURST, window=LOG_WINDOW_SECONDS
                ),
            )
            suppressed.add_metric([], float(self.logs.suppressed_total))
            yield suppressed
