"""The tap's cost: direct connection vs nginx vs the tap, in front of one mock vLLM, same run.

    python bench/bench_tap.py [--rounds 3] [--requests 1000] [--quick]

Four processes: a mock vLLM (aiohttp, replays the real vLLM 0.32.0 captures), nginx 1.22
(Debian package, plain reverse proxy: keepalive upstream, proxy_buffering off so streams are
not held), the exporter itself (``python -m exporter run --tap.listen-address ...``, i.e.
the tap as deployed) and this load generator, which speaks HTTP/1.1 over raw asyncio
streams so its own cost stays small. Each round measures every target in turn, in this
order: direct, nginx, tap. Reported: the median over rounds of each figure, and the tap's
CPU time per request (its process's user+system time over the phase / requests).

Phases (each after a warm-up):
- whole answers (chat, 02_chat_warm.json) at concurrency 1 and 32: latency p50/p99,
  throughput at 32;
- streams (chat, 03_chat_stream_warm.sse.txt, the client does not ask for usage, so the tap
  injects include_usage and strips the usage chunk) at concurrency 1: time to first chunk
  and to the last byte;
- a long prompt (a 400 KB body, about a 100k-token agent turn) at concurrency 1, because
  the tap reads the request body to name the caller.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm-0.32.0-cpu"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- the mock vLLM (runs in its own process: python bench_tap.py --serve-upstream PORT) ---


def serve_upstream(port: int) -> None:
    from aiohttp import web

    whole = (FIXTURES / "02_chat_warm.json").read_bytes()
    events = [
        part + b"\n\n"
        for part in (FIXTURES / "03_chat_stream_warm.sse.txt").read_bytes().split(b"\n\n")
        if part
    ]
    usage_events = [e for e in events if b'"choices":[],"usage"' in e]

    async def chat(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=whole, content_type="application/json")
        with_usage = (body.get("stream_options") or {}).get("include_usage")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:  # one write per event, as vLLM does
            if with_usage or event not in usage_events:
                await response.write(event)
        await response.write_eof()
        return response

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# ---- the floor: a bare aiohttp pass-through (python bench_tap.py --serve-passthrough ...) --

PASSTHROUGH_DROP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def serve_passthrough(upstream_port: int, port: int, loop: str) -> None:
    """What any aiohttp reverse proxy must do, and nothing the tap adds: read the request,
    forward it without hop-by-hop headers on a client session with the tap's own settings
    (``new_session``), relay the answer (whole, or chunk by chunk for a stream). No request
    parsing, no usage reading, no recording, no connection limits."""
    from aiohttp import web

    from exporter.usage.tap.proxy import new_session

    target = f"http://127.0.0.1:{upstream_port}"
    sessions = []

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in PASSTHROUGH_DROP}
        async with sessions[0].request(
            request.method,
            target + request.raw_path,
            data=body,
            headers=headers,
            allow_redirects=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        ) as upstream:
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in PASSTHROUGH_DROP}
            if upstream.content_type != "text/event-stream":
                return web.Response(status=upstream.status, body=await upstream.read(), headers=out)
            response = web.StreamResponse(status=upstream.status, headers=out)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def main() -> None:
        sessions.append(new_session())
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    if loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


# ---- a minimal HTTP/1.1 keep-alive client ----------------------------------------------


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**22)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def request(self, raw: bytes) -> tuple[float, float, bytes]:
        """(seconds to the first body byte, seconds to the last, body)."""
        started = time.perf_counter()
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {head!r}")
        headers = {
            line.split(b":", 1)[0].strip().lower(): line.split(b":", 1)[1].strip()
            for line in head.split(b"\r\n")[1:]
            if b":" in line
        }
        first = None
        if b"content-length" in headers:
            body = await self.reader.readexactly(int(headers[b"content-length"]))
            first = time.perf_counter()
        else:
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                parts.append((await self.reader.readexactly(size + 2))[:-2])
                if first is None:
                    first = time.perf_counter()
            body = b"".join(parts)
        return first - started, time.perf_counter() - started, body

    def close(self) -> None:
        self.writer.close()


def http_request(path: str, payload: dict, port: int) -> bytes:
    body = json.dumps(payload).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nAuthorization: Bearer sk-bench-key\r\n"
        f"X-Caller: bench\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def chat_payload(stream: bool, prompt_chars: int) -> dict:
    # Prose: words and sentence ends (which is where the tap's prompt-order fingerprint cuts
    # its blocks, so a 400 KB prompt costs it close to its most blocks).
    words = "kalo miren tasvu pedor. silny quabex torela fingru. " * (prompt_chars // 50 + 1)
    return {
        "model": "tiny-llama",
        "max_tokens": 8,
        "stream": stream,
        "messages": [
            {"role": "system", "content": words[:prompt_chars]},
            {"role": "user", "content": "next step please"},
        ],
    }


@dataclass
class Phase:
    name: str
    first: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    wall: float = 0.0
    cpu: float | None = None  # proxy process CPU seconds over the phase

    def p(self, values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_phase(
    port: int, raw: bytes, requests: int, concurrency: int, check: bytes | None = None
) -> Phase:
    connections = [await Connection.open(port) for _ in range(concurrency)]
    phase = Phase("")
    per_worker = requests // concurrency

    async def worker(connection: Connection) -> None:
        for _ in range(per_worker):
            first, total, body = await connection.request(raw)
            if check is not None and check in body:
                raise RuntimeError("the stream still carries the injected usage chunk")
            phase.first.append(first)
            phase.total.append(total)

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in connections))
    phase.wall = time.perf_counter() - started
    for connection in connections:
        connection.close()
    return phase


# ---- processes ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_port(port: int, process: subprocess.Popen, what: str, deadline: float = 30) -> None:
    started = time.monotonic()
    while time.monotonic() - started < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)  # no readiness event from another process: poll with a deadline
    raise RuntimeError(f"{what} did not listen on {port} within {deadline}s")


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


NGINX_CONF = """
{user}worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
  client_max_body_size 64m;
  keepalive_requests 1000000;
  upstream vllm {{ server 127.0.0.1:{upstream}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://vllm;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""


@dataclass
class Target:
    name: str
    port: int
    pids: list[int]


def stop_processes(stack: list[subprocess.Popen]) -> None:
    """Stop every process started (each in its own session, with its children), last first."""
    for process in reversed(stack):
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(process.pid, signal.SIGKILL)


def start_processes(
    tmp: Path,
    stack: list[subprocess.Popen],
    loop: str,
    before: Path | None = None,
    also_asyncio: bool = False,
    order_off: bool = False,
) -> dict[str, Target]:
    upstream_port, nginx_port, bare_port, tap_port, web_port = (free_port() for _ in range(5))
    upstream = subprocess.Popen(
        [sys.executable, __file__, "--serve-upstream", str(upstream_port)], start_new_session=True
    )
    stack.append(upstream)
    wait_port(upstream_port, upstream, "mock upstream")

    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    conf = tmp / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            user="user root;\n" if os.geteuid() == 0 else "",
            tmp=tmp,
            upstream=upstream_port,
            port=nginx_port,
        )
    )
    nginx_process = subprocess.Popen(
        [nginx, "-c", str(conf), "-p", str(tmp)], start_new_session=True
    )
    stack.append(nginx_process)
    wait_port(nginx_port, nginx_process, "nginx")

    bare = subprocess.Popen(
        [sys.executable, __file__, "--serve-passthrough", str(upstream_port), str(bare_port), loop],
        cwd=ROOT,
        start_new_session=True,
    )
    stack.append(bare)
    wait_port(bare_port, bare, "bare aiohttp pass-through")

    tap = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exporter",
            "run",
            "--web.listen-address",
            f"127.0.0.1:{web_port}",
            "--tap.listen-address",
            f"127.0.0.1:{tap_port}",
            "--tap.upstream",
            f"http://127.0.0.1:{upstream_port}",
            "--log.level",
            "warning",
        ],
        cwd=ROOT,
        start_new_session=True,
    )
    stack.append(tap)
    wait_port(tap_port, tap, "exporter with the tap")
    targets: dict[str, Target] = {}
    if order_off:  # the same tap without the prompt-order diagnosis
        off_port, off_web = free_port(), free_port()
        off = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "exporter",
                "run",
                "--web.listen-address",
                f"127.0.0.1:{off_web}",
                "--tap.listen-address",
                f"127.0.0.1:{off_port}",
                "--tap.upstream",
                f"http://127.0.0.1:{upstream_port}",
                "--log.level",
                "warning",
                "--tap.prompt-order-bytes",
                "0",
            ],
            cwd=ROOT,
            start_new_session=True,
        )
        stack.append(off)
        wait_port(off_port, off, "exporter with the tap, prompt order off")
        targets["order-off"] = Target("order-off", off_port, [off.pid])
    if before is not None:  # the same exporter command, from another checkout
        before_port, before_web = free_port(), free_port()
        earlier = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "exporter",
                "run",
                "--web.listen-address",
                f"127.0.0.1:{before_web}",
                "--tap.listen-address",
                f"127.0.0.1:{before_port}",
                "--tap.upstream",
                f"http://127.0.0.1:{upstream_port}",
                "--log.level",
                "warning",
            ],
            cwd=before,
            start_new_session=True,
        )
        stack.append(earlier)
        wait_port(before_port, earlier, f"exporter from {before}")
        targets["before"] = Target("before", before_port, [earlier.pid])
    if also_asyncio:  # the same tap and pass-through on asyncio's own loop
        aio_port, aio_web, aio_bare_port = free_port(), free_port(), free_port()
        tap_aio = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "exporter",
                "run",
                "--web.listen-address",
                f"127.0.0.1:{aio_web}",
                "--tap.listen-address",
                f"127.0.0.1:{aio_port}",
                "--tap.upstream",
                f"http://127.0.0.1:{upstream_port}",
                "--log.level",
                "warning",
                "--no-web.uvloop",
            ],
            cwd=ROOT,
            start_new_session=True,
        )
        stack.append(tap_aio)
        wait_port(aio_port, tap_aio, "exporter with the tap, on asyncio's loop")
        bare_aio = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve-passthrough",
                str(upstream_port),
                str(aio_bare_port),
                "asyncio",
            ],
            cwd=ROOT,
            start_new_session=True,
        )
        stack.append(bare_aio)
        wait_port(aio_bare_port, bare_aio, "bare aiohttp pass-through on asyncio")
        targets["tap-aio"] = Target("tap-aio", aio_port, [tap_aio.pid])
        targets["bare-aio"] = Target("bare-aio", aio_bare_port, [bare_aio.pid])
    return targets | {
        "direct": Target("direct", upstream_port, []),
        "nginx": Target("nginx", nginx_port, children(nginx_process.pid) + [nginx_process.pid]),
        "bare": Target("bare", bare_port, [bare.pid]),
        "tap": Target("tap", tap_port, [tap.pid]),
        "_web": Target("exporter web", web_port, []),
    }


def tap_events(web_port: int) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{web_port}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith('vllm_cache_usage_events_total{reader="tap"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- the measurement ------------------------------------------------------------------

TARGETS = ("direct", "nginx", "bare", "tap")
targets_measured = list(TARGETS)  # plus "before" with --before, two more with --also-asyncio

PHASES = (
    # name, stream, prompt chars, concurrency, request share
    ("whole c=1", False, 4_000, 1, 1.0),
    ("whole c=32", False, 4_000, 32, 3.2),
    ("stream c=1", True, 4_000, 1, 1.0),
    ("long prompt c=1", False, 400_000, 1, 0.3),
)


async def measure(
    targets: dict[str, Target],
    rounds: int,
    requests: int,
    phases: tuple[tuple[str, bool, int, int, float], ...] = PHASES,
) -> dict[tuple[str, str], list[Phase]]:
    results: dict[tuple[str, str], list[Phase]] = {}
    usage_marker = b'"choices":[],"usage"'
    for _ in range(rounds):
        for phase_name, stream, chars, concurrency, share in phases:
            count = max(concurrency, int(requests * share) // concurrency * concurrency)
            for target in targets_measured:
                port = targets[target].port
                raw = http_request("/v1/chat/completions", chat_payload(stream, chars), port)
                await run_phase(port, raw, max(concurrency * 4, count // 10), concurrency)
                before = cpu_seconds(targets[target].pids) if targets[target].pids else None
                marker = usage_marker if stream and target.startswith("tap") else None
                phase = await run_phase(port, raw, count, concurrency, marker)
                if before is not None:
                    phase.cpu = cpu_seconds(targets[target].pids) - before
                phase.name = phase_name
                results.setdefault((phase_name, target), []).append(phase)
    return results


def med(values: list[float]) -> float:
    return statistics.median(values)


def report(results: dict[tuple[str, str], list[Phase]]) -> dict[str, dict[str, float]]:
    """Print the table; return, per phase, the tap's figures against the bare pass-through's.

    Added latency is the target's p50 minus the direct p50 of the same round, so the ratio
    of medians compares what each proxy adds, not the mock's own time.
    """
    print(
        f"{'phase':18} {'target':8} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} "
        f"{'first p50':>10} {'req/s':>8} {'CPU ms/req':>11}"
    )
    figures: dict[str, dict[str, float]] = {}
    for phase_name in dict.fromkeys(name for name, _target in results):
        direct = [p.p(p.total, 0.5) for p in results[(phase_name, "direct")]]
        added: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for target in targets_measured:
            runs = results[(phase_name, target)]
            p50 = med([p.p(p.total, 0.5) for p in runs])
            p99 = med([p.p(p.total, 0.99) for p in runs])
            first = med([p.p(p.first, 0.5) for p in runs])
            rate = med([len(p.total) / p.wall for p in runs])
            added[target] = med(
                [p.p(p.total, 0.5) - base for p, base in zip(runs, direct, strict=True)]
            )
            cpu_text = f"{'-':>11}"
            if runs[0].cpu is not None:
                cpu[target] = med([(p.cpu or 0.0) / len(p.total) for p in runs])
                cpu_text = f"{cpu[target] * 1e3:11.3f}"
            added_text = f"{added[target] * 1e3:+10.3f}" if target != "direct" else f"{'':>10}"
            print(
                f"{phase_name:18} {target:8} {p50 * 1e3:8.3f} {p99 * 1e3:8.3f} {added_text} "
                f"{first * 1e3:10.3f} {rate:8.0f} {cpu_text}"
            )
        figures[phase_name] = {
            "tap_added_ms": added["tap"] * 1e3,
            "bare_added_ms": added["bare"] * 1e3,
            "added_ratio": added["tap"] / added["bare"] if added["bare"] > 0 else float("inf"),
            "tap_cpu_ms": cpu["tap"] * 1e3,
            "bare_cpu_ms": cpu["bare"] * 1e3,
            "cpu_ratio": cpu["tap"] / cpu["bare"] if cpu["bare"] > 0 else float("inf"),
        }
        if "tap-aio" in added:
            figures[phase_name] |= {
                "aio_tap_added_ms": added["tap-aio"] * 1e3,
                "aio_bare_added_ms": added["bare-aio"] * 1e3,
                "aio_tap_cpu_ms": cpu["tap-aio"] * 1e3,
                "aio_bare_cpu_ms": cpu["bare-aio"] * 1e3,
            }
        if "order-off" in added:
            figures[phase_name] |= {
                "off_added_ms": added["order-off"] * 1e3,
                "off_cpu_ms": cpu["order-off"] * 1e3,
            }
        if "before" in added:
            figures[phase_name] |= {
                "before_added_ms": added["before"] * 1e3,
                "before_cpu_ms": cpu["before"] * 1e3,
                "before_added_ratio": added["before"] / added["bare"]
                if added["bare"] > 0
                else float("inf"),
                "before_cpu_ratio": cpu["before"] / cpu["bare"]
                if cpu["bare"] > 0
                else float("inf"),
            }
    return figures


# The goals: (phase, figure, at most), for the one-client phases.
GOALS = (
    ("whole c=1", "added_ratio", 1.3),
    ("whole c=1", "tap_added_ms", 0.5),
    ("whole c=1", "cpu_ratio", 1.5),
    ("whole c=1", "tap_cpu_ms", 0.4),
    ("long prompt c=1", "tap_added_ms", 1.2),
)


def report_goals(figures: dict[str, dict[str, float]]) -> bool:
    print("\nthe tap against the bare aiohttp pass-through (medians over rounds):")
    print(
        f"{'phase':18} {'added: tap':>11} {'bare':>8} {'ratio':>6} {'CPU: tap':>10} "
        f"{'bare':>8} {'ratio':>6}"
    )
    for phase_name, f in figures.items():
        print(
            f"{phase_name:18} {f['tap_added_ms']:+10.3f}ms {f['bare_added_ms']:+7.3f}ms "
            f"{f['added_ratio']:6.2f} {f['tap_cpu_ms']:8.3f}ms {f['bare_cpu_ms']:6.3f}ms "
            f"{f['cpu_ratio']:6.2f}"
        )
    if any("before_added_ms" in f for f in figures.values()):
        print("\nthe tap of --before against the same bare pass-through:")
        for phase_name, f in figures.items():
            print(
                f"{phase_name:18} {f['before_added_ms']:+10.3f}ms {f['bare_added_ms']:+7.3f}ms "
                f"{f['before_added_ratio']:6.2f} {f['before_cpu_ms']:8.3f}ms "
                f"{f['bare_cpu_ms']:6.3f}ms {f['before_cpu_ratio']:6.2f}"
            )
    if any("aio_tap_cpu_ms" in f for f in figures.values()):
        print("\nthe same on asyncio's own loop (--no-web.uvloop), and what uvloop saves:")
        print(
            f"{'phase':18} {'added: tap':>11} {'bare':>8} {'CPU: tap':>10} {'bare':>8} "
            f"{'CPU tap uvloop/asyncio':>23} {'bare':>6}"
        )
        for phase_name, f in figures.items():
            print(
                f"{phase_name:18} {f['aio_tap_added_ms']:+10.3f}ms "
                f"{f['aio_bare_added_ms']:+7.3f}ms {f['aio_tap_cpu_ms']:8.3f}ms "
                f"{f['aio_bare_cpu_ms']:6.3f}ms {f['tap_cpu_ms'] / f['aio_tap_cpu_ms']:23.2f} "
                f"{f['bare_cpu_ms'] / f['aio_bare_cpu_ms']:6.2f}"
            )
    if any("off_cpu_ms" in f for f in figures.values()):
        print(
            "\nthe tap with the prompt-order diagnosis against the same tap without it "
            "(--tap.prompt-order-bytes 0):"
        )
        print(
            f"{'phase':18} {'CPU: with':>10} {'without':>8} {'ratio':>6} {'added: with':>12} "
            f"{'without':>8}"
        )
        for phase_name, f in figures.items():
            print(
                f"{phase_name:18} {f['tap_cpu_ms']:8.3f}ms {f['off_cpu_ms']:6.3f}ms "
                f"{f['tap_cpu_ms'] / f['off_cpu_ms']:6.2f} {f['tap_added_ms']:+10.3f}ms "
                f"{f['off_added_ms']:+7.3f}ms"
            )
    met = True
    for phase_name, key, limit in GOALS:
        if phase_name not in figures:
            continue
        value = figures[phase_name][key]
        ok = value <= limit
        met &= ok
        print(f"goal {phase_name}: {key} {value:.2f} <= {limit}: {'met' if ok else 'MISSED'}")
    return met


def machine() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return (
        f"{os.cpu_count()} CPUs ({model}), Python {sys.version.split()[0]}, "
        f"{subprocess.run(['nginx', '-v'], capture_output=True, text=True).stderr.strip()}"
    )


def default_loop() -> str:
    """The event loop the exporter runs on (the bare pass-through uses the same)."""
    try:
        from exporter.runtime import event_loop_name
    except ImportError:
        return "asyncio"
    return event_loop_name()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="1 round of 200 requests")
    parser.add_argument(
        "--phase",
        action="append",
        choices=[name for name, *_ in PHASES],
        help="only these phases (default: all)",
    )
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default=default_loop(),
        help="the bare pass-through's event loop (default: the exporter's)",
    )
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="also measure the tap of the exporter in this checkout (e.g. "
        "the main branch), as target 'before'",
    )
    parser.add_argument(
        "--also-asyncio",
        action="store_true",
        help="also measure the tap with --no-web.uvloop and the bare "
        "pass-through on asyncio's loop, between the others",
    )
    parser.add_argument(
        "--order-off",
        action="store_true",
        help="also measure the same tap with the prompt-order diagnosis off "
        "(--tap.prompt-order-bytes 0), as target 'order-off'",
    )
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-passthrough", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return 0
    if args.serve_passthrough:
        upstream_port, port, loop = args.serve_passthrough
        serve_passthrough(int(upstream_port), int(port), loop)
        return 0
    if args.quick:
        args.rounds, args.requests = 1, 200
    stack: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="bench-tap-") as tmp_name:
        tmp = Path(tmp_name)
        os.chmod(tmp, 0o755)
        try:
            targets = start_processes(
                tmp, stack, args.loop, args.before, args.also_asyncio, args.order_off
            )
            if args.before is not None:
                targets_measured.append("before")
            if args.also_asyncio:
                targets_measured.extend(("tap-aio", "bare-aio"))
            if args.order_off:
                targets_measured.append("order-off")
            events_before = tap_events(targets["_web"].port)
            phases = tuple(p for p in PHASES if not args.phase or p[0] in args.phase)
            results = asyncio.run(measure(targets, args.rounds, args.requests, phases))
            recorded = tap_events(targets["_web"].port) - events_before
        finally:
            stop_processes(stack)
    print(f"machine: {machine()}")
    print(
        f"rounds: {args.rounds}, medians over rounds; the tap recorded {recorded:.0f} "
        "events (every request it proxied, warm-ups included)"
    )
    print(f"event loop of the bare pass-through: {args.loop}")
    figures = report(results)
    return 0 if report_goals(figures) else 1


if __name__ == "__main__":
    sys.exit(main())
