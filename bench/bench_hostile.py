"""Hostile input and overload against the exporter as deployed: memory, /metrics, ingest.

    python bench/bench_hostile.py --case 3|3a|3b|4|5|6|6a|6b|n1|n2|n4|net|f5|f6|f6s|files|all
        [--json]
        [--exporter-args='--flag value ...'] [--hold 40] [--settle 20]

Each case starts a fresh ``python -m exporter run --web.listen-address 127.0.0.1:<port>``
(plus ``--exporter-args``), its log to a file, and while a case runs:

- a thread reads the exporter's VmRSS and VmHWM from /proc every 50 ms, and kills it if its
  RSS passes ``--rss-guard-mb`` or the case outlives ``--case-timeout`` (the machine is
  shared: a runaway must not take it down);
- a Prometheus-like prober GETs /metrics every ``--probe-interval`` seconds with
  Prometheus' Accept (OpenMetrics preferred) and Accept-Encoding: gzip, one at a time, each
  on a new connection; a scrape counts as ok when it answers 200 within 10 s (Prometheus'
  default scrape_timeout);
- an ingest prober POSTs one event to /v1/usage the same way.

The cases (inputs are deterministic, from ``--seed``):

- 3a: ``--bodies`` (4) concurrent 16 MiB bodies of ``1\\n`` (8 Mi lines, each a rejected
  event) to POST /v1/usage, on raw sockets.
- 3b: the same with 16 MiB of valid NDJSON events (agent conversations).
- 4: 101 callers x 33 models, every pair in every state (warm, partial, cold, short, unknown,
  error; TTFT and queue wait on each, so the histograms exist), then the series count and
  ``--renders`` timed renders of /metrics in the 0.0.4 text format and with Prometheus'
  Accept (OpenMetrics), the /metrics prober paused meanwhile; the ingest prober keeps going
  and shows how long ingest stalls behind a render.
- 5: case 4's series, then ``--readers`` (30) clients with a tiny SO_RCVBUF that send
  ``GET /metrics`` and never read, held ``--hold`` seconds, then closed.
- 6a: the exporter under ``ulimit -n 1024``; ``--connections`` (1,100) idle connections held
  ``--hold`` seconds.
- 6b: the same limit; as many slowloris connections, each sending a request line and then
  one header line every ``--slowloris-interval`` seconds, never finishing the headers.

The network cases of issue 29 (``net``: n1, n2, n4) also probe ``/-/healthy`` every
``--healthy-interval`` (0.1 s) and count its answers within 100 ms; those with the tap start
it (``--tap.listen-address``) in front of a vLLM stand-in on its own thread (chat
completions with usage; a stream sends one event a second for ``--stream-seconds``) and
probe a tap call (non-streamed) like ingest:

- n1: ``--trickle-bodies`` (4) connections each send a chunked ``POST /v1/usage`` and then
  one byte every ``--trickle-interval`` (2 s) for ``--hold`` seconds; a connection the
  exporter closes is opened again at once (a persistent attacker; ``--no-trickle-reconnect``:
  once each).
- n2: the same against the tap with ``--trickle-tap`` (580) connections.
- n4: the exporter and its tap under ``ulimit -n 1024``; ``--streams`` (700) streaming tap
  calls at once, each held by the stand-in for ``--stream-seconds`` (the hold).

The followed-file cases of issue 29 (``files``: f5, f6, f6s) also probe ``/-/healthy``;
each follows ``--usage.file '<dir>/*.jsonl'``:

- f5: ``--idle-files`` (10,000) files there at start, the exporter under ``ulimit -n
  4096``; idle for ``--hold`` seconds (its CPU and descriptors meanwhile), then one line
  written to each of ``--woken-files`` (500) of them, twice (the second time each is
  reopened), each counted exactly.
- f6: ``--burst-files`` (40) files of ``--burst-mib`` (8) MiB each, written aside and
  renamed into the glob at once; read to their end, every line counted.
- f6s: the same files there at start with ``--usage.file.from-start`` (a restart over
  rotated files).

Reported per case: RSS when the attack started, the peak (VmHWM) and the RSS
``--settle`` seconds after the attackers left (and the share of the growth given back),
/metrics and ingest latency (p50, max, ok of probes) during the attack and after it,
whether the exporter survived, log bytes and tracebacks written, the TCP state of the
attack's sockets at the end of the hold (did the exporter close any?), the case's own
figures, and the exporter's self-metrics. One Markdown table; ``--json`` for all of it,
RSS timelines included.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import random
import resource
import shlex
import shutil
import signal
import socket
import struct
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from harness import (
    PROMETHEUS_HEADERS,
    TEXT_HEADERS,
    ExporterProcess,
    MemorySampler,
    MiB,
    Prober,
    commit,
    cpu_seconds,
    decoded,
    fetch,
    free_port,
    machine,
    open_fds,
    proc_memory,
    sample_lines,
    sample_value,
    seconds_text,
    self_metrics,
    summarize,
)

GRANULE = 2048
# A one-event ingest probe with no cached count: it never feeds the granularity learner.
PROBE_EVENT = json.dumps(
    {
        "caller": "caller-000",
        "model": "model-00",
        "prompt_tokens": 20_000,
        "ttft_seconds": 1.5,
        "queue_seconds": 0.1,
    }
).encode()
TCP_STATES = {
    1: "established",
    7: "closed",
    8: "closed by exporter (FIN)",
    4: "fin_wait1",
    5: "fin_wait2",
    6: "time_wait",
    9: "last_ack",
    11: "closing",
}


TAP_CALL = json.dumps(
    {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
).encode()
HEALTHY_WITHIN = 0.1  # seconds: a liveness probe's answer is usable when this fast


# ---- one case's run ------------------------------------------------------------------


@dataclass
class CaseRun:
    """Everything one case touches and finds; its sockets are closed by the caller."""

    args: argparse.Namespace
    exporter: ExporterProcess
    sockets: list[socket.socket]
    metrics_probe: Prober
    ingest_probe: Prober
    healthy_probe: Prober | None = None
    tap_probe: Prober | None = None
    tap_port: int | None = None
    marks: dict[str, float] = field(default_factory=dict)
    found: dict[str, Any] = field(default_factory=dict)
    log_marks: dict[str, int] = field(default_factory=dict)
    cpu_marks: dict[str, float | None] = field(default_factory=dict)
    hwm_marks: dict[str, int | None] = field(default_factory=dict)
    final_metrics: str | None = None
    files_dir: Path | None = None  # the followed files' folder (f5, f6, f6s)

    @classmethod
    def create(
        cls,
        args: argparse.Namespace,
        exporter: ExporterProcess,
        sockets: list[socket.socket],
        case: Case | None = None,
        tap_port: int | None = None,
    ) -> CaseRun:
        url = exporter.base_url
        run = cls(
            args,
            exporter,
            sockets,
            Prober(
                "metrics",
                "GET",
                url + "/metrics",
                PROMETHEUS_HEADERS,
                args.probe_interval,
                args.probe_timeout,
            ),
            Prober(
                "ingest",
                "POST",
                url + "/v1/usage",
                {"Content-Type": "application/x-ndjson"},
                args.probe_interval,
                args.probe_timeout,
                body=PROBE_EVENT,
            ),
        )
        if case is not None and case.healthy:
            run.healthy_probe = Prober(
                "healthy", "GET", url + "/-/healthy", {}, args.healthy_interval, args.probe_timeout
            )
        if tap_port is not None:
            run.tap_port = tap_port
            run.tap_probe = Prober(
                "tap",
                "POST",
                f"http://127.0.0.1:{tap_port}/v1/chat/completions",
                {"Content-Type": "application/json", "X-Caller": "probe"},
                args.probe_interval,
                args.probe_timeout,
                body=TAP_CALL,
            )
        return run

    def probers(self) -> list[Prober]:
        return [
            prober
            for prober in (
                self.metrics_probe,
                self.ingest_probe,
                self.healthy_probe,
                self.tap_probe,
            )
            if prober is not None
        ]

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic()
        self.log_marks[name] = self.exporter.log_bytes()
        self.cpu_marks[name] = cpu_seconds(self.exporter.pid)
        memory = proc_memory(self.exporter.pid)
        self.hwm_marks[name] = memory[1] if memory else None


@dataclass(frozen=True)
class Case:
    key: str
    title: str  # formatted with the arguments
    attack: Callable[[CaseRun], Awaitable[None]]
    nofile: int | None = None  # the exporter's ulimit -n
    tap: bool = False  # start the tap, in front of the vLLM stand-in
    healthy: bool = False  # probe /-/healthy too
    # Files to create before the exporter starts, in the given folder; returns its flags.
    prepare: Callable[[Path, argparse.Namespace], list[str]] | None = None


async def run_case(case: Case, run: CaseRun) -> None:
    probers = [asyncio.ensure_future(prober.run()) for prober in run.probers()]
    try:
        run.mark("start")
        await asyncio.sleep(run.args.warmup)
        await case.attack(run)  # marks attack_start and attack_end
        await asyncio.sleep(run.args.settle)
        run.mark("end")
        run.final_metrics = await final_scrape(run)
    finally:
        for task in probers:
            task.cancel()
        await asyncio.gather(*probers, return_exceptions=True)


async def final_scrape(run: CaseRun) -> str | None:
    try:
        async with aiohttp.ClientSession() as session:
            _, status, wire, headers = await fetch(
                session, run.exporter.base_url + "/metrics", TEXT_HEADERS, run.args.probe_timeout
            )
        return decoded(wire, headers).decode() if status == 200 else None
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return None


# ---- raw sockets ---------------------------------------------------------------------


async def connect(
    run: CaseRun, timeout: float = 2.0, receive_buffer: int | None = None
) -> socket.socket | None:
    """A non-blocking TCP connection to the exporter, registered for cleanup; None if the
    handshake did not complete within ``timeout`` (the listen backlog is full)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    run.sockets.append(sock)
    sock.setblocking(False)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    try:
        await asyncio.wait_for(
            asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", run.exporter.port)), timeout
        )
    except (asyncio.TimeoutError, OSError):
        sock.close()
        return None
    return sock


async def connect_many(run: CaseRun, count: int, concurrency: int = 100) -> list[socket.socket]:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> socket.socket | None:
        async with gate:
            return await connect(run)

    return [sock for sock in await asyncio.gather(*(one() for _ in range(count))) if sock]


def tcp_state(sock: socket.socket) -> str:
    try:
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except OSError:
        return "closed"
    return TCP_STATES.get(state, f"state {state}")


def queued_bytes(sock: socket.socket) -> int:
    """Bytes received and not read yet (FIONREAD): has the exporter begun to answer?"""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
    except OSError:
        return 0


def state_counts(sockets: list[socket.socket]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for sock in sockets:
        state = tcp_state(sock)
        counts[state] = counts.get(state, 0) + 1
    return counts


async def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 response with a Content-Length."""
    loop = asyncio.get_running_loop()
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            raise ConnectionError("the exporter closed the connection without an answer")
        buffer += chunk
    head, _, body = buffer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            break
        body += chunk
    return status, body


async def post_body(run: CaseRun, body: bytes) -> dict[str, Any]:
    """POST one body on its own raw connection; what came back and how long it took."""
    started = time.monotonic()
    sock = await connect(run, timeout=10)
    if sock is None:
        return {"error": "connect timeout", "seconds": time.monotonic() - started}
    head = (
        f"POST /v1/usage HTTP/1.1\r\nHost: 127.0.0.1:{run.exporter.port}\r\n"
        f"Content-Type: application/x-ndjson\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    outcome: dict[str, Any] = {}
    try:
        await loop.sock_sendall(sock, head)
        await loop.sock_sendall(sock, body)
    except OSError as err:  # refused early (413): the answer may still be there to read
        outcome["send_error"] = type(err).__name__
    try:
        status, reply = await asyncio.wait_for(read_response(sock), run.args.attack_timeout)
    except asyncio.TimeoutError:
        outcome.update(
            error=f"no answer within {run.args.attack_timeout:.0f} s",
            seconds=round(time.monotonic() - started, 2),
        )
        return outcome
    except OSError as err:
        outcome.update(error=type(err).__name__, seconds=round(time.monotonic() - started, 2))
        return outcome
    finally:
        sock.close()
    outcome.update(status=status, seconds=round(time.monotonic() - started, 2))
    try:
        parsed = json.loads(reply)
        outcome.update(
            accepted=parsed.get("accepted"),
            rejected=parsed.get("rejected"),
            reason=parsed.get("error"),
        )
    except ValueError:
        outcome["reply_bytes"] = len(reply)
    return outcome


# ---- inputs --------------------------------------------------------------------------


def junk_lines_body(size: int) -> bytes:
    """``1\\n`` repeated: every line is valid JSON and a rejected event (not an object)."""
    return b"1\n" * (size // 2)


def valid_ndjson_body(size: int, seed: int) -> tuple[bytes, int]:
    """Agent conversations, all ten fields, up to ``size`` bytes; (body, events)."""
    rng = random.Random(seed)
    prompts = {f"agent-{index:03d}": rng.randrange(3_000, 60_000) for index in range(200)}
    lines: list[bytes] = []
    total = 0
    now = 1_800_000_000.0
    while True:
        caller = f"agent-{rng.randrange(200):03d}"
        prompt = prompts[caller] = prompts[caller] + rng.randrange(500, 4_000)
        if prompt > 180_000:
            prompt = prompts[caller] = rng.randrange(3_000, 20_000)
        cached = max(0, (prompt - 2_500) // GRANULE * GRANULE) if rng.random() < 0.8 else 0
        now += 0.01
        line = json.dumps(
            {
                "caller": caller,
                "model": "qwen3.8-27b",
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "completion_tokens": rng.randrange(50, 800),
                "ttft_seconds": round(rng.uniform(0.5, 90.0), 3),
                "queue_seconds": round(rng.uniform(0.0, 2.0), 3),
                "session": f"{caller}-s{rng.randrange(4)}",
                "time": round(now, 3),
                "status": 200,
            },
            separators=(",", ":"),
        ).encode()
        if total + len(line) + 1 > size:
            return b"\n".join(lines) + b"\n", len(lines)
        lines.append(line)
        total += len(line) + 1


# Per (caller, model) pair, in this order, so that every state is reached: "unknown" only
# before the pair first reports a cached count; the two warm counts teach the learner
# G = 2,048 (their gcd); "short" last, since a 1,000-token turn bounds the next one.
STATE_TURNS: tuple[tuple[str, dict[str, Any], tuple[float, float]], ...] = (
    ("unknown", {"prompt_tokens": 20_000}, (1.0, 60.0)),
    ("warm", {"prompt_tokens": 20_000, "cached_tokens": 9 * GRANULE}, (0.5, 5.0)),
    ("warm", {"prompt_tokens": 20_000, "cached_tokens": 7 * GRANULE}, (0.5, 5.0)),
    ("partial", {"prompt_tokens": 20_000, "cached_tokens": 2 * GRANULE}, (5.0, 30.0)),
    ("cold", {"prompt_tokens": 20_000, "cached_tokens": 0}, (20.0, 120.0)),
    ("short", {"prompt_tokens": 1_000, "cached_tokens": 0}, (0.05, 0.5)),
    ("error", {"prompt_tokens": 20_000, "status": 500}, (0.05, 2.0)),
)


def every_state_events(callers: int, models: int, seed: int) -> list[list[bytes]]:
    """One list of NDJSON lines per turn of STATE_TURNS, pairs shuffled within a turn."""
    rng = random.Random(seed)
    pairs = [(f"caller-{c:03d}", f"model-{m:02d}") for c in range(callers) for m in range(models)]
    turns = []
    for _state, fields, (low, high) in STATE_TURNS:
        rng.shuffle(pairs)
        turns.append(
            [
                json.dumps(
                    {
                        "caller": caller,
                        "model": model,
                        **fields,
                        "ttft_seconds": round(rng.uniform(low, high), 3),
                        "queue_seconds": round(rng.uniform(0.0, 2.0), 3),
                    },
                    separators=(",", ":"),
                ).encode()
                for caller, model in pairs
            ]
        )
    return turns


async def load_every_state(run: CaseRun, batch: int = 1000) -> dict[str, int]:
    """Send case 4's events; the replies' totals."""
    turns = every_state_events(run.args.callers, run.args.models, run.args.seed)
    totals = {"sent": 0, "accepted": 0, "rejected": 0, "failed_posts": 0}
    url = run.exporter.base_url + "/v1/usage"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for lines in turns:
            for start in range(0, len(lines), batch):
                body = b"\n".join(lines[start : start + batch])
                totals["sent"] += len(lines[start : start + batch])
                async with session.post(
                    url, data=body, headers={"Content-Type": "application/x-ndjson"}
                ) as response:
                    if response.status not in (200, 422):
                        totals["failed_posts"] += 1
                        continue
                    reply = await response.json()
                    totals["accepted"] += reply["accepted"]
                    totals["rejected"] += reply["rejected"]
    return totals


def pairs_in_every_state(text: str) -> tuple[int, int]:
    """(pairs with a non-zero count in all six states, pairs)."""
    states: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("vllm_cache_requests_total{") and not line.endswith(" 0.0"):
            labels = line.split("}", 1)[0]
            pair = labels.rsplit(",state=", 1)[0]
            states[pair] = states.get(pair, 0) + 1
    return sum(1 for count in states.values() if count == 6), len(states)


# ---- the attacks ---------------------------------------------------------------------


async def big_bodies(run: CaseRun, body: bytes, events_per_body: int) -> None:
    run.found["body_mb"] = round(len(body) / MiB, 1)
    run.found["events_per_body"] = events_per_body
    run.mark("attack_start")
    replies = await asyncio.gather(*(post_body(run, body) for _ in range(run.args.bodies)))
    run.mark("attack_end")
    run.found["replies"] = replies


async def attack_junk_lines(run: CaseRun) -> None:
    size = run.args.body_mib * MiB
    await big_bodies(run, junk_lines_body(size), size // 2)


async def attack_valid_ndjson(run: CaseRun) -> None:
    body, events = valid_ndjson_body(run.args.body_mib * MiB, run.args.seed)
    await big_bodies(run, body, events)


async def attack_series(run: CaseRun) -> None:
    run.mark("attack_start")
    run.found["load"] = await load_every_state(run)
    await run.metrics_probe.pause_when_idle()
    async with aiohttp.ClientSession() as session:
        for fmt, headers in (("text", TEXT_HEADERS), ("prometheus_accept", PROMETHEUS_HEADERS)):
            renders = []
            for _ in range(run.args.renders):
                seconds, status, wire, response_headers = await fetch(
                    session, run.exporter.base_url + "/metrics", headers, run.args.probe_timeout
                )
                renders.append(round(seconds, 3))
            body = decoded(wire, response_headers).decode()
            run.found[fmt] = {
                "content_type": response_headers.get("content-type"),
                "status": status,
                "seconds": renders,
                "wire_mb": round(len(wire) / MiB, 1),
                "body_mb": round(len(body) / MiB, 1),
                "samples": len([line for line in sample_lines(body) if line != "# EOF"]),
            }
            if fmt == "text":
                complete, pairs = pairs_in_every_state(body)
                run.found["pairs_in_all_states"] = f"{complete} of {pairs}"
            del body, wire
    run.metrics_probe.resume()
    run.mark("attack_end")


async def attack_slow_readers(run: CaseRun) -> None:
    run.found["preload"] = await load_every_state(run)
    await run.metrics_probe.next_probe()  # the baseline includes one scrape of the series
    await run.metrics_probe.next_probe()
    run.mark("attack_start")
    request = (f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{run.exporter.port}\r\n\r\n").encode()
    readers = []
    for _ in range(run.args.readers):
        sock = await connect(run, timeout=10, receive_buffer=run.args.receive_buffer)
        if sock is not None:
            sock.send(request)
            readers.append(sock)
    run.found["readers"] = len(readers)
    await asyncio.sleep(run.args.hold)
    run.found["readers_answered_by_end_of_hold"] = sum(
        1 for sock in readers if queued_bytes(sock) > 0
    )
    run.found["reader_sockets_at_end_of_hold"] = state_counts(readers)
    for sock in readers:
        sock.close()
    run.mark("attack_end")


async def attack_idle(run: CaseRun) -> None:
    run.mark("attack_start")
    idle = await connect_many(run, run.args.connections)
    run.found["connected"] = len(idle)
    run.found["exporter_fds_after_connecting"] = open_fds(run.exporter.pid)
    await asyncio.sleep(run.args.hold)
    run.found["exporter_fds_at_end_of_hold"] = open_fds(run.exporter.pid)
    run.found["attack_sockets_at_end_of_hold"] = state_counts(idle)
    for sock in idle:
        sock.close()
    run.mark("attack_end")


async def attack_slowloris(run: CaseRun) -> None:
    run.mark("attack_start")
    slow = await connect_many(run, run.args.connections)
    run.found["connected"] = len(slow)
    request_line = (f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{run.exporter.port}\r\n").encode()
    failed_sends = 0
    for sock in slow:
        try:
            sock.send(request_line)
        except OSError:
            failed_sends += 1
    run.found["exporter_fds_after_connecting"] = open_fds(run.exporter.pid)
    ends = time.monotonic() + run.args.hold
    header = 0
    while (left := ends - time.monotonic()) > 0:
        await asyncio.sleep(min(left, run.args.slowloris_interval))
        header += 1
        for sock in slow:
            try:
                sock.send(f"X-Slow-{header}: {header}\r\n".encode())
            except OSError:
                failed_sends += 1
    run.found["header_lines_sent_each"] = header
    run.found["failed_sends"] = failed_sends
    run.found["exporter_fds_at_end_of_hold"] = open_fds(run.exporter.pid)
    run.found["attack_sockets_at_end_of_hold"] = state_counts(slow)
    for sock in slow:
        sock.close()
    run.mark("attack_end")


# ---- issue 29: slow bodies and descriptors -------------------------------------------


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def trickle_bodies(run: CaseRun, port: int, path: str, count: int) -> None:
    """``count`` connections sending a chunked POST body one byte every
    ``--trickle-interval`` for ``--hold`` seconds, each opened again as soon as the exporter
    closes it; what each connection got (an answer's status, or closed) and how long it
    lasted."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
        "application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode() + _chunk(b"{")
    loop = asyncio.get_running_loop()
    ends = time.monotonic() + run.args.hold
    outcomes: dict[str, int] = {}
    lifetimes: list[float] = []
    opened = 0

    async def one() -> None:
        nonlocal opened
        while time.monotonic() < ends:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 5)
                await loop.sock_sendall(sock, head)
            except (OSError, asyncio.TimeoutError):
                sock.close()
                outcomes["connect failed"] = outcomes.get("connect failed", 0) + 1
                await asyncio.sleep(0.2)
                continue
            opened += 1
            started = time.monotonic()
            outcome = "held to the end"
            try:
                while (left := ends - time.monotonic()) > 0:
                    try:
                        answer = await asyncio.wait_for(
                            loop.sock_recv(sock, 4096), min(left, run.args.trickle_interval)
                        )
                    except asyncio.TimeoutError:
                        await loop.sock_sendall(sock, _chunk(b" "))  # JSON whitespace
                        continue
                    outcome = (
                        answer.split(b" ", 2)[1].decode()
                        if answer.startswith(b"HTTP/")
                        else "closed"
                    )
                    lifetimes.append(time.monotonic() - started)
                    break
            except OSError:
                outcome = "closed"
                lifetimes.append(time.monotonic() - started)
            finally:
                sock.close()
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if not run.args.trickle_reconnect:
                return

    run.mark("attack_start")
    await asyncio.gather(*(one() for _ in range(count)))
    run.mark("attack_end")
    run.found["trickling_connections"] = count
    run.found["connections_opened"] = opened
    run.found["trickler_outcomes"] = outcomes
    if lifetimes:
        ordered = sorted(lifetimes)
        run.found["trickler_lifetime_s"] = {
            "min": round(ordered[0], 1),
            "median": round(ordered[len(ordered) // 2], 1),
            "max": round(ordered[-1], 1),
        }


async def attack_slow_ingest(run: CaseRun) -> None:
    await trickle_bodies(run, run.exporter.port, "/v1/usage", run.args.trickle_bodies)


async def attack_slow_tap(run: CaseRun) -> None:
    assert run.tap_port is not None
    await trickle_bodies(run, run.tap_port, "/v1/chat/completions", run.args.trickle_tap)


async def attack_streams(run: CaseRun) -> None:
    """``--streams`` streaming tap calls at once, each held by the stand-in for
    ``--stream-seconds``; their outcomes, and the exporter's descriptors meanwhile."""
    assert run.tap_port is not None
    url = f"http://127.0.0.1:{run.tap_port}/v1/chat/completions"
    body = json.dumps(
        {"model": "tiny-llama", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    outcomes: dict[str, int] = {}
    fds: list[int] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=run.args.stream_seconds + 120)

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        try:
            async with session.post(
                url,
                data=body,
                headers={"Content-Type": "application/json", "X-Caller": f"agent-{index % 20}"},
            ) as response:
                await response.read()
                outcome = str(response.status)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as err:
            outcome = type(err).__name__
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async def watch_fds() -> None:
        while True:
            count = open_fds(run.exporter.pid)
            if count is not None:
                fds.append(count)
            await asyncio.sleep(0.5)

    run.mark("attack_start")
    watcher = asyncio.ensure_future(watch_fds())
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(one(session, index) for index in range(run.args.streams)))
    watcher.cancel()
    run.mark("attack_end")
    run.found["streams"] = run.args.streams
    run.found["stream_outcomes"] = outcomes
    run.found["exporter_fds_max"] = max(fds) if fds else None


class StubUpstream(threading.Thread):
    """A vLLM stand-in for the tap cases, on its own event loop: chat completions answered
    with usage at once, or streamed one event a second for ``stream_seconds``."""

    def __init__(self, stream_seconds: float) -> None:
        super().__init__(name="stub-upstream", daemon=True)
        self.stream_seconds = stream_seconds
        self.port = free_port()
        self.ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        usage = {
            "prompt_tokens": 4096,
            "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 2048},
        }

        async def chat(request: web.Request) -> web.StreamResponse:
            asked = await request.json()
            if not asked.get("stream"):
                return web.json_response(
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "model": "tiny-llama",
                        "usage": usage,
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "hello"},
                            }
                        ],
                    }
                )
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            chunk = {
                "id": "x",
                "object": "chat.completion.chunk",
                "model": "tiny-llama",
                "choices": [{"index": 0, "delta": {"content": "a"}}],
            }
            try:
                for _ in range(max(1, int(self.stream_seconds))):
                    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    await asyncio.sleep(1.0)
                last = {
                    "id": "x",
                    "object": "chat.completion.chunk",
                    "model": "tiny-llama",
                    "choices": [],
                    "usage": usage,
                }
                await response.write(
                    b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n"
                )
                await response.write_eof()
            except ConnectionError:
                pass
            return response

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.ready.set()
        await self._stopping.wait()
        await runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self.join(timeout=15)


# ---- followed files (issue 29, fails 5 and 6) ---------------------------------------


def followed_flags(folder: Path, from_start: bool = False) -> list[str]:
    return [
        "--usage.file",
        str(folder / "*.jsonl"),
        "--usage.file.poll-interval",
        "1",
        *(["--usage.file.from-start"] if from_start else []),
    ]


def usage_line(caller: str, seq: int) -> bytes:
    return (
        json.dumps(
            {
                "caller": caller,
                "model": "model-00",
                "prompt_tokens": 4096,
                "cached_tokens": 2048,
                "ttft_seconds": 0.5,
                "session": f"s-{seq % 500}",
            }
        ).encode()
        + b"\n"
    )


def prepare_idle_files(folder: Path, args: argparse.Namespace) -> list[str]:
    folder.mkdir()
    for index in range(args.idle_files):
        (folder / f"idle-{index:05d}.jsonl").write_bytes(usage_line("before", index))
    return followed_flags(folder)


def burst_file(path: Path, index: int, size: int) -> int:
    """A file of about ``size`` bytes of events; the number of lines written."""
    one = usage_line(f"agent-{index % 20}", index)
    lines = max(1, size // len(one))
    path.write_bytes(one * lines)
    return lines


def prepare_from_start(folder: Path, args: argparse.Namespace) -> list[str]:
    folder.mkdir()
    lines = sum(
        burst_file(folder / f"rotated-{index:02d}.jsonl", index, args.burst_mib * MiB)
        for index in range(args.burst_files)
    )
    args.expected_file_events = lines
    return followed_flags(folder, from_start=True)


def prepare_empty(folder: Path, args: argparse.Namespace) -> list[str]:
    folder.mkdir()
    return followed_flags(folder)


async def file_events(run: CaseRun) -> float:
    async with aiohttp.ClientSession() as session:
        _, status, wire, headers = await fetch(
            session, run.exporter.base_url + "/metrics", TEXT_HEADERS, run.args.probe_timeout
        )
    if status != 200:
        return -1.0
    text = decoded(wire, headers).decode()
    return sample_value(text, 'vllm_cache_usage_events_total{reader="file"}') or 0.0


async def wait_counted(run: CaseRun, expected: int, name: str) -> None:
    """Until the file reader has counted ``expected`` events (or the attack timeout): how
    long it took, and what it had counted."""
    started = time.monotonic()
    counted = 0.0
    while time.monotonic() - started < run.args.attack_timeout:
        counted = await file_events(run)
        if counted >= expected:
            break
        await asyncio.sleep(0.2)
    run.found[f"{name}_seconds"] = round(time.monotonic() - started, 1)
    run.found[f"{name}_counted"] = f"{counted:,.0f} of {expected:,}"


async def watch_descriptors(run: CaseRun, seen: list[int]) -> None:
    while True:
        count = open_fds(run.exporter.pid)
        if count is not None:
            seen.append(count)
        await asyncio.sleep(0.5)


async def attack_idle_files(run: CaseRun) -> None:
    assert run.files_dir is not None
    fds: list[int] = []
    watcher = asyncio.ensure_future(watch_descriptors(run, fds))
    run.mark("attack_start")
    cpu_before = cpu_seconds(run.exporter.pid)
    await asyncio.sleep(run.args.hold)
    cpu_idle = cpu_seconds(run.exporter.pid)
    if cpu_before is not None and cpu_idle is not None:
        run.found["idle_cpu_share"] = round((cpu_idle - cpu_before) / run.args.hold, 3)
    run.found["idle_fds_max"] = max(fds) if fds else None
    woken = random.Random(run.args.seed).sample(
        range(run.args.idle_files), min(run.args.woken_files, run.args.idle_files)
    )
    base = await file_events(run)
    for wave in range(2):
        for index in woken:
            with open(run.files_dir / f"idle-{index:05d}.jsonl", "ab") as handle:
                handle.write(usage_line(f"woke-{wave}", index))
        await wait_counted(run, int(base) + len(woken) * (wave + 1), f"wave{wave + 1}")
    watcher.cancel()
    run.mark("attack_end")
    run.found["fds_max"] = max(fds) if fds else None


async def attack_burst(run: CaseRun) -> None:
    assert run.files_dir is not None
    staging = run.files_dir.parent / "staging"
    staging.mkdir()
    lines = sum(
        burst_file(staging / f"new-{index:02d}.jsonl", index, run.args.burst_mib * MiB)
        for index in range(run.args.burst_files)
    )
    run.mark("attack_start")
    for path in sorted(staging.iterdir()):
        path.rename(run.files_dir / path.name)  # all there at once, each whole
    await wait_counted(run, lines, "read")
    run.mark("attack_end")


async def attack_from_start(run: CaseRun) -> None:
    run.mark("attack_start")
    await wait_counted(run, run.args.expected_file_events, "read")
    run.mark("attack_end")


CASES = {
    case.key: case
    for case in (
        Case("3a", "{bodies} concurrent {body_mib} MiB bodies of '1\\n'", attack_junk_lines),
        Case(
            "3b", "{bodies} concurrent {body_mib} MiB bodies of valid NDJSON", attack_valid_ndjson
        ),
        Case("4", "{callers} callers x {models} models x every state", attack_series),
        Case(
            "5",
            "{readers} clients that GET /metrics and never read (case 4's series)",
            attack_slow_readers,
        ),
        Case(
            "6a",
            "{connections:,} idle connections, exporter under ulimit -n 1024",
            attack_idle,
            nofile=1024,
        ),
        Case(
            "6b",
            "{connections:,} slowloris connections, exporter under ulimit -n 1024",
            attack_slowloris,
            nofile=1024,
        ),
        Case(
            "n1",
            "{trickle_bodies} connections trickling POST /v1/usage bodies, a byte every "
            "{trickle_interval:g} s",
            attack_slow_ingest,
            healthy=True,
        ),
        Case(
            "n2",
            "{trickle_tap} connections trickling tap request bodies, a byte every "
            "{trickle_interval:g} s",
            attack_slow_tap,
            tap=True,
            healthy=True,
        ),
        Case(
            "n4",
            "{streams} streaming tap calls held {stream_seconds:g} s, exporter under "
            "ulimit -n 1024",
            attack_streams,
            nofile=1024,
            tap=True,
            healthy=True,
        ),
        Case(
            "f5",
            "{idle_files:,} followed files, idle {hold:g} s then {woken_files} written "
            "twice, exporter under ulimit -n 4096",
            attack_idle_files,
            nofile=4096,
            healthy=True,
            prepare=prepare_idle_files,
        ),
        Case(
            "f6",
            "{burst_files} new files of {burst_mib} MiB appearing at once",
            attack_burst,
            healthy=True,
            prepare=prepare_empty,
        ),
        Case(
            "f6s",
            "{burst_files} files of {burst_mib} MiB replayed with --usage.file.from-start",
            attack_from_start,
            healthy=True,
            prepare=prepare_from_start,
        ),
    )
}
GROUPS = {
    "3": ["3a", "3b"],
    "6": ["6a", "6b"],
    "net": ["n1", "n2", "n4"],
    "files": ["f5", "f6", "f6s"],
    "all": list(CASES),
}


# ---- measuring one case in a fresh exporter ------------------------------------------


def measure(
    case: Case, args: argparse.Namespace, inherited_limits: dict[int, tuple[int, int]]
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench-hostile-{case.key}-") as workdir:
        upstream: StubUpstream | None = None
        tap_port: int | None = None
        extra = list(args.exporter_args)
        if case.tap:
            upstream = StubUpstream(args.stream_seconds)
            upstream.start()
            upstream.ready.wait(30)
            tap_port = free_port()
            extra += [
                "--tap.listen-address",
                f"127.0.0.1:{tap_port}",
                "--tap.upstream",
                upstream.url,
            ]
        files_dir = Path(workdir) / "usage" if case.prepare else None
        if case.prepare is not None and files_dir is not None:
            extra += case.prepare(files_dir, args)
        exporter = ExporterProcess(
            Path(workdir),
            extra,
            nofile=case.nofile,
            inherited_limits=inherited_limits,
            **({"root": args.exporter_root} if args.exporter_root else {}),
        )
        sockets: list[socket.socket] = []
        sampler: MemorySampler | None = None
        try:
            exporter.start()
            sampler = MemorySampler(
                exporter,
                0.05,
                args.rss_guard_mb * MiB,
                deadline=time.monotonic() + args.case_timeout + 30,
            )
            sampler.start()
            run = CaseRun.create(args, exporter, sockets, case, tap_port)
            run.files_dir = files_dir
            failure = None
            try:
                asyncio.run(asyncio.wait_for(run_case(case, run), args.case_timeout))
            except asyncio.TimeoutError:
                failure = f"the case did not finish within {args.case_timeout:.0f} s"
            except (OSError, aiohttp.ClientError, RuntimeError, ValueError) as err:
                failure = f"{type(err).__name__}: {err}"
            for sock in sockets:
                sock.close()
            alive = exporter.alive()
            sampler.stop()
            result = report_case(case, run, sampler, alive, failure)
            if args.keep_logs:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                shutil.copy(exporter.log_path, args.keep_logs / f"exporter-{case.key}.log")
            return result
        finally:
            for sock in sockets:
                sock.close()
            if sampler is not None:
                sampler.stop()
            exporter.stop()
            if upstream is not None:
                upstream.stop()


def report_case(
    case: Case, run: CaseRun, sampler: MemorySampler, alive: bool, failure: str | None
) -> dict[str, Any]:
    marks = run.marks
    start = marks.get("start", 0.0)
    attack_start = marks.get("attack_start", start)
    attack_end = marks.get("attack_end", time.monotonic())
    end = marks.get("end", time.monotonic())
    last = sampler.latest()
    before = sampler.rss_at(attack_start)
    # The kernel's high-water mark sees spikes between two samples: it is the attack's peak
    # when it rose during the attack (or the settle after it), else the sampled maximum.
    peak = sampler.peak_between(attack_start, attack_end + run.args.settle)
    hwm_before, hwm_end = run.hwm_marks.get("attack_start"), last.hwm if last else None
    if hwm_before is not None and hwm_end is not None and hwm_end > hwm_before:
        peak = max(peak or 0, hwm_end)
    after = last.rss if alive and last is not None else None
    released = None
    if before is not None and peak is not None and after is not None and peak - before > 16 * MiB:
        released = round((peak - after) / (peak - before), 2)
    log_start = run.log_marks.get("attack_start", 0)
    attack_seconds = max(attack_end - attack_start, 1e-9)
    cpu_start, cpu_end = run.cpu_marks.get("attack_start"), run.cpu_marks.get("attack_end")
    cpu_last = run.cpu_marks.get("end")
    counts = run.exporter.log_counts()
    return {
        "case": case.key,
        "title": case.title.format(**vars(run.args)),
        "command": " ".join(shlex.quote(part) for part in run.exporter.command),
        "ulimit_n": case.nofile,
        "survived": alive and sampler.killed_for is None,
        "exit_code": run.exporter.exit_code,
        "killed_for": sampler.killed_for,
        "failure": failure,
        "rss_before_attack_mb": _mb(before),
        "rss_peak_attack_mb": _mb(peak),
        "rss_peak_sampled_mb": _mb(sampler.peak_between(attack_start, end)),
        "vmhwm_mb": _mb(last.hwm if last else None),
        "rss_after_mb": _mb(after),
        "released_fraction": released,
        "attack_seconds": round(attack_seconds, 1),
        "exporter_cpu_seconds_in_attack": (
            round(cpu_end - cpu_start, 1) if cpu_start is not None and cpu_end is not None else None
        ),
        # Work the exporter still does after the attackers left (abandoned bodies, say).
        "exporter_cpu_share_after": (
            round((cpu_last - cpu_end) / max(end - attack_end, 1e-9), 2)
            if cpu_end is not None and cpu_last is not None
            else None
        ),
        "metrics_during": summarize(run.metrics_probe.probes, attack_start, attack_end),
        "metrics_after": summarize(run.metrics_probe.probes, attack_end, end),
        "ingest_during": summarize(run.ingest_probe.probes, attack_start, attack_end),
        "ingest_after": summarize(run.ingest_probe.probes, attack_end, end),
        "healthy_during": (
            summarize(run.healthy_probe.probes, attack_start, attack_end, slow=HEALTHY_WITHIN)
            if run.healthy_probe
            else None
        ),
        "tap_during": (
            summarize(run.tap_probe.probes, attack_start, attack_end) if run.tap_probe else None
        ),
        "tap_after": (summarize(run.tap_probe.probes, attack_end, end) if run.tap_probe else None),
        "log_bytes": run.exporter.log_bytes(),
        "log_bytes_in_attack": run.log_marks.get("attack_end", log_start) - log_start,
        **counts,
        "found": run.found,
        "marks_s": {name: round(at - start, 1) for name, at in marks.items()},
        "self_metrics": self_metrics(run.final_metrics) if run.final_metrics else None,
        "rss_timeline_mb": sampler.timeline(start),
    }


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / MiB, 1)


# ---- output --------------------------------------------------------------------------


def latency_cell(summary: dict[str, Any]) -> str:
    return (
        f"{seconds_text(summary['p50_s'])} / {seconds_text(summary['max_s'])} / "
        f"{summary['ok']} of {summary['probes']} / {summary['longest_gap_s']:.0f} s"
    )


def notes(result: dict[str, Any]) -> str:
    found = result["found"]
    parts = []
    if "replies" in found:
        replies = found["replies"]
        statuses = ", ".join(str(r.get("status", r.get("error"))) for r in replies)
        slowest = max((r.get("seconds") or 0) for r in replies)
        accepted = sum(r.get("accepted") or 0 for r in replies)
        rejected = sum(r.get("rejected") or 0 for r in replies)
        parts.append(
            f"replies {statuses} in {slowest:.1f} s; {accepted:,} accepted, {rejected:,} rejected"
        )
    if "text" in found:
        text, om = found["text"], found["prometheus_accept"]
        parts.append(
            f"{text['samples']:,} samples, text {text['body_mb']} MB in "
            f"{min(text['seconds']):.2f} s; Prometheus Accept "
            f"({om['content_type'].split(';')[0]}) {om['body_mb']} MB in "
            f"{min(om['seconds']):.1f} s; all 6 states: {found['pairs_in_all_states']}"
        )
    if "readers" in found:
        parts.append(
            f"{found['readers']} readers, "
            f"{found['readers_answered_by_end_of_hold']} of them answered in the hold; "
            "sockets after hold: "
            f"{found['reader_sockets_at_end_of_hold']}"
        )
    if "connected" in found:
        parts.append(
            f"{found['connected']:,} connected; exporter fds "
            f"{found['exporter_fds_after_connecting']}; sockets after hold: "
            f"{found['attack_sockets_at_end_of_hold']}"
        )
    if (result["exporter_cpu_share_after"] or 0) > 0.2:
        parts.append(
            f"still busy after the attack: {result['exporter_cpu_share_after']:.0%} of a CPU"
        )
    if result["tracebacks"] or result["error_lines"]:
        parts.append(f"{result['tracebacks']:,} tracebacks, {result['error_lines']:,} ERROR lines")
    if result["killed_for"]:
        parts.append(f"KILLED: {result['killed_for']}")
    if result["failure"]:
        parts.append(f"bench: {result['failure']}")
    return "; ".join(parts)


def network_notes(result: dict[str, Any]) -> str:
    found = result["found"]
    parts = []
    if "trickler_outcomes" in found:
        parts.append(
            f"{found['trickling_connections']} tricklers, {found['connections_opened']} "
            f"connections opened: {found['trickler_outcomes']}; lifetime "
            f"{found.get('trickler_lifetime_s')}"
        )
    if "read_seconds" in found:
        parts.append(f"read in {found['read_seconds']} s ({found['read_counted']} counted)")
    if "idle_cpu_share" in found:
        parts.append(
            f"idle: {found['idle_cpu_share']:.1%} of a core, {found['idle_fds_max']} "
            f"fds; woken twice in {found.get('wave1_seconds')} s, "
            f"{found.get('wave2_seconds')} s ({found.get('wave1_counted')}, "
            f"{found.get('wave2_counted')}); fds at most {found['fds_max']}"
        )
    if "stream_outcomes" in found:
        parts.append(
            f"{found['streams']} streams: {found['stream_outcomes']}; exporter fds at "
            f"most {found['exporter_fds_max']}"
        )
    if result["tracebacks"] or result["error_lines"]:
        parts.append(f"{result['tracebacks']:,} tracebacks, {result['error_lines']:,} ERROR lines")
    return "; ".join(parts)


def print_table(results: list[dict[str, Any]]) -> None:
    print(
        "| case | survived | RSS at attack | peak RSS | RSS after | released | "
        "/metrics in attack: p50 / max / ok / longest gap | /metrics after | "
        "ingest in attack: p50 / max / ok / longest gap | ingest after | log written | "
        "notes |"
    )
    print("|---|---|---:|---:|---:|---:|---|---|---|---|---:|---|")
    for result in results:
        released = (
            "-" if result["released_fraction"] is None else f"{result['released_fraction']:.0%}"
        )
        print(
            f"| {result['case']} {result['title']} | "
            f"{'yes' if result['survived'] else 'NO'} | "
            f"{_cell_mb(result['rss_before_attack_mb'])} | "
            f"{_cell_mb(result['rss_peak_attack_mb'])} | "
            f"{_cell_mb(result['rss_after_mb'])} | {released} | "
            f"{latency_cell(result['metrics_during'])} | "
            f"{latency_cell(result['metrics_after'])} | "
            f"{latency_cell(result['ingest_during'])} | "
            f"{latency_cell(result['ingest_after'])} | "
            f"{result['log_bytes_in_attack'] / MiB:,.1f} MB | {notes(result)} |"
        )
    network = [result for result in results if result["healthy_during"] is not None]
    if network:
        print(
            "\n| case | /-/healthy in attack: p50 / max / within 100 ms | "
            "tap probe in attack: p50 / max / ok / longest gap | tap probe after | "
            "/metrics in attack: p50 / max | peak RSS | attack |"
        )
        print("|---|---|---|---|---|---:|---|")
        for result in network:
            healthy = result["healthy_during"]
            tap = result["tap_during"]
            print(
                f"| {result['case']} | {seconds_text(healthy['p50_s'])} / "
                f"{seconds_text(healthy['max_s'])} / {healthy['ok']} of "
                f"{healthy['probes']} | {latency_cell(tap) if tap else '-'} | "
                f"{latency_cell(result['tap_after']) if tap else '-'} | "
                f"{seconds_text(result['metrics_during']['p50_s'])} / "
                f"{seconds_text(result['metrics_during']['max_s'])} | "
                f"{_cell_mb(result['rss_peak_attack_mb'])} | {network_notes(result)} |"
            )
    for result in results:
        print(
            f"\n{result['case']}: {result['command']}"
            + (f"  (ulimit -n {result['ulimit_n']})" if result["ulimit_n"] else "")
        )
        print(
            f"  marks (s): {result['marks_s']}; attack {result['attack_seconds']} s, "
            "exporter CPU in it "
            f"{result['exporter_cpu_seconds_in_attack']} s; VmHWM "
            f"{_cell_mb(result['vmhwm_mb'])}; probe errors in attack: "
            f"/metrics {result['metrics_during']['errors'] or 'none'}, ingest "
            f"{result['ingest_during']['errors'] or 'none'}"
        )
        for key, value in result["found"].items():
            if key not in ("replies",):
                print(f"  {key}: {value}")
        for reply in result["found"].get("replies", []):
            print(f"  reply: {reply}")
        if result["self_metrics"]:
            print("  self-metrics at the end:")
            for line in result["self_metrics"]:
                print(f"    {line}")
        elif result["survived"]:
            print("  self-metrics: the final scrape failed")


def _cell_mb(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} MB"


# ---- limits and arguments ------------------------------------------------------------


def guard_bench(max_mb: int, files_needed: int) -> dict[int, tuple[int, int]]:
    """Cap this process's address space and raise its open-file limit; return the limits
    it had, for the exporter to get back."""
    original = {
        limit: resource.getrlimit(limit) for limit in (resource.RLIMIT_AS, resource.RLIMIT_NOFILE)
    }
    soft_as, hard_as = original[resource.RLIMIT_AS]
    cap = max_mb * MiB
    if hard_as == resource.RLIM_INFINITY or cap < hard_as:
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard_as))
    soft_files, hard_files = original[resource.RLIMIT_NOFILE]
    if hard_files != resource.RLIM_INFINITY and hard_files < files_needed:
        hard_files = files_needed  # only root may; the error says what is missing
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft_files, files_needed), hard_files))
    return original


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument(
        "--case",
        default="all",
        help="3, 4, 5, 6, net, files, all, or one variant: " + ", ".join(CASES),
    )
    parser.add_argument(
        "--exporter-args",
        default="",
        type=shlex.split,
        help="extra flags for the exporter, one string: --exporter-args='--callers.max 500'",
    )
    parser.add_argument(
        "--exporter-root",
        type=Path,
        default=None,
        help="run the exporter of another checkout (e.g. a clone of main, "
        "for before/after figures)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--save", type=Path, default=None, help="also write the JSON to this file")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before the attack")
    parser.add_argument(
        "--settle", type=float, default=20.0, help="seconds measured after the attackers left"
    )
    parser.add_argument(
        "--hold", type=float, default=40.0, help="seconds the connections of cases 5 and 6 are held"
    )
    parser.add_argument("--probe-interval", type=float, default=0.5)
    parser.add_argument("--probe-timeout", type=float, default=60.0)
    parser.add_argument("--bodies", type=int, default=4, help="case 3: concurrent bodies")
    parser.add_argument("--body-mib", type=int, default=16, help="case 3: MiB per body")
    parser.add_argument(
        "--attack-timeout",
        type=float,
        default=120.0,
        help="case 3: seconds to wait for each body's answer",
    )
    parser.add_argument("--callers", type=int, default=101, help="cases 4 and 5")
    parser.add_argument("--models", type=int, default=33, help="cases 4 and 5")
    parser.add_argument("--renders", type=int, default=3, help="case 4: timed renders per format")
    parser.add_argument("--readers", type=int, default=30, help="case 5: non-reading clients")
    parser.add_argument(
        "--receive-buffer",
        type=int,
        default=1024,
        help="case 5: SO_RCVBUF of each reader (the kernel's minimum applies)",
    )
    parser.add_argument("--connections", type=int, default=1100, help="case 6")
    parser.add_argument("--slowloris-interval", type=float, default=5.0, help="case 6b")
    parser.add_argument(
        "--trickle-bodies",
        type=int,
        default=4,
        help="case n1: connections trickling /v1/usage bodies",
    )
    parser.add_argument(
        "--trickle-tap",
        type=int,
        default=580,
        help="case n2: connections trickling tap request bodies",
    )
    parser.add_argument(
        "--trickle-interval",
        type=float,
        default=2.0,
        help="cases n1, n2: seconds between two bytes",
    )
    parser.add_argument(
        "--trickle-reconnect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cases n1, n2: open a connection again as soon "
        "as the exporter closes it (a persistent attacker)",
    )
    parser.add_argument(
        "--streams", type=int, default=700, help="case n4: streaming tap calls at once"
    )
    parser.add_argument(
        "--stream-seconds",
        type=float,
        default=40.0,
        help="case n4: seconds the stand-in holds each stream",
    )
    parser.add_argument(
        "--idle-files", type=int, default=10_000, help="case f5: files there at start"
    )
    parser.add_argument(
        "--woken-files", type=int, default=500, help="case f5: files written to after the idle hold"
    )
    parser.add_argument("--burst-files", type=int, default=40, help="cases f6, f6s")
    parser.add_argument("--burst-mib", type=int, default=8, help="cases f6, f6s: MiB per file")
    parser.add_argument(
        "--healthy-interval",
        type=float,
        default=0.1,
        help="network cases: seconds between /-/healthy probes",
    )
    parser.add_argument(
        "--rss-guard-mb", type=int, default=4096, help="kill the exporter above this RSS"
    )
    parser.add_argument(
        "--case-timeout", type=float, default=420.0, help="seconds one case may take"
    )
    parser.add_argument(
        "--bench-max-mb", type=int, default=3072, help="address-space cap of this bench process"
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        help="copy each case's exporter log into this folder",
    )
    args = parser.parse_args(argv)
    keys = GROUPS.get(args.case, [args.case])
    unknown = [key for key in keys if key not in CASES]
    if unknown:
        parser.error(
            f"unknown case {args.case!r}; choose from 3, 4, 5, 6, net, files, all, "
            + ", ".join(CASES)
        )
    args.keys = keys
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up on kill, too
    inherited = guard_bench(
        args.bench_max_mb, max(args.connections, args.trickle_tap, 2 * args.streams, 4096) + 512
    )
    results = []
    for key in args.keys:
        if not args.json:
            print(
                f"case {key}: {CASES[key].title.format(**vars(args))} ...",
                file=sys.stderr,
                flush=True,
            )
        results.append(measure(CASES[key], args, inherited))
    header = {
        "machine": machine(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "exporter_args": args.exporter_args,
    }
    if args.save:
        args.save.write_text(json.dumps({**header, "cases": results}, indent=1) + "\n")
    if args.json:
        print(json.dumps({**header, "cases": results}, indent=1))
    else:
        print(
            f"{header['date']}, commit {header['commit']}, {header['machine']}; "
            f"exporter args: {args.exporter_args or 'none'}\n"
        )
        print_table(results)
    return 0 if all(result["survived"] for result in results) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the finally blocks have stopped the exporter by now
        print("interrupted; the exporter and its sockets were cleaned up", file=sys.stderr)
        sys.exit(130)
