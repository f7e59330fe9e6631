"""What the process-level benchmarks share: the exporter as a child process, its memory read
from /proc, and probes that hit it the way Prometheus and a proxy do.

Used by ``bench_hostile.py`` and ``bench_soak.py`` (run as scripts from any directory: this
folder is on ``sys.path`` then). The exporter is started as deployed,
``python -m exporter run --web.listen-address 127.0.0.1:<free port>``, from the repository
root, so the code measured is the checkout's.
"""

from __future__ import annotations

import asyncio
import gzip
import math
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")

# What Prometheus 2.x sends on every scrape: OpenMetrics preferred, gzip accepted.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,"
    "application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROMETHEUS_HEADERS = {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"}
TEXT_HEADERS = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "gzip"}
# Prometheus' default scrape_timeout: a scrape slower than this is a failed scrape.
PROMETHEUS_SCRAPE_TIMEOUT = 10.0


# ---- the exporter as a child process ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def proc_memory(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) in bytes, or None once the process is gone (or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, amount = line.split(":", 1)
            values[key] = int(amount.split()[0]) * 1024
    if "VmRSS" not in values:
        return None
    return values["VmRSS"], values.get("VmHWM", values["VmRSS"])


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class ExporterProcess:
    """``python -m exporter run`` on a free 127.0.0.1 port, its output in ``log_path``.

    Limits are set on the child with prlimit(2) right after it is spawned rather than in a
    ``preexec_fn`` (not safe once the bench has threads): ``nofile`` caps its open files
    (``ulimit -n``), and the limits this bench lowered for itself are given back.
    """

    def __init__(
        self,
        workdir: Path,
        extra_args: Sequence[str] = (),
        nofile: int | None = None,
        inherited_limits: dict[int, tuple[int, int]] | None = None,
        root: Path = ROOT,
    ) -> None:
        self.root = root  # the checkout whose exporter runs
        self.port = free_port()
        self.log_path = workdir / "exporter.log"
        self.extra_args = list(extra_args)
        self.nofile = nofile
        self.inherited_limits = inherited_limits or {}
        self.process: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None  # set when it ended on its own

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "exporter",
            "run",
            "--web.listen-address",
            f"127.0.0.1:{self.port}",
            *self.extra_args,
        ]

    def start(self, ready_within: float = 60.0) -> None:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command,
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        for limit, values in self.inherited_limits.items():
            resource.prlimit(self.pid, limit, values)
        if self.nofile is not None:
            resource.prlimit(self.pid, resource.RLIMIT_NOFILE, (self.nofile, self.nofile))
        self._wait_healthy(ready_within)

    def _wait_healthy(self, ready_within: float) -> None:
        deadline = time.monotonic() + ready_within
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the exporter exited with {self.process.returncode} at "
                    f"start; see {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/-/healthy", timeout=1):
                    return
            except (OSError, urllib.error.URLError):
                time.sleep(0.1)  # another process: no event to await, poll with a deadline
        raise RuntimeError(f"the exporter did not answer /-/healthy within {ready_within}s")

    def alive(self) -> bool:
        if self.process is None:
            return False
        if self.process.poll() is None:
            return True
        if self.exit_code is None:
            self.exit_code = self.process.returncode
        return False

    def kill(self) -> None:
        """SIGKILL the whole process group (the guard's hard stop; safe from any thread)."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        if self.process is None:
            return
        self.alive()
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            self.kill()
            self.process.wait(timeout=10)

    def log_bytes(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, self.log_bytes() - 8192))
                return b"\n".join(log.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""

    def log_counts(self) -> dict[str, int]:
        """Tracebacks and ERROR lines in the log, read in blocks (it can be large)."""
        counts = {"tracebacks": 0, "error_lines": 0}
        try:
            with open(self.log_path, "rb") as log:
                tail = b""
                while block := log.read(4 * MiB):
                    lines = (tail + block).split(b"\n")
                    tail = lines.pop()
                    for line in lines:
                        counts["tracebacks"] += line.startswith(b"Traceback (most recent")
                        counts["error_lines"] += b"ERROR" in line
        except OSError:
            pass
        return counts


@dataclass
class MemorySample:
    at: float  # monotonic seconds
    rss: int
    hwm: int


class MemorySampler(threading.Thread):
    """Reads the exporter's VmRSS/VmHWM every ``interval`` and is the machine's guard.

    A thread, so that a busy bench event loop neither delays the samples nor the guard: if
    the exporter's RSS passes ``guard_bytes``, or the case outlives ``deadline`` (monotonic),
    the exporter is killed and the reason kept.
    """

    def __init__(
        self,
        exporter: ExporterProcess,
        interval: float,
        guard_bytes: int,
        deadline: float | None = None,
    ) -> None:
        super().__init__(name="memory-sampler", daemon=True)
        self.exporter = exporter
        self.interval = interval
        self.guard_bytes = guard_bytes
        self.deadline = deadline
        self.samples: list[MemorySample] = []
        self.killed_for: str | None = None
        self._stopped = threading.Event()

    def run(self) -> None:
        pid = self.exporter.pid
        while True:
            memory = proc_memory(pid)
            now = time.monotonic()
            if memory is None:
                return
            self.samples.append(MemorySample(now, *memory))
            if memory[0] > self.guard_bytes:
                self.killed_for = (
                    f"RSS {memory[0] / MiB:,.0f} MB passed the guard "
                    f"({self.guard_bytes / MiB:,.0f} MB)"
                )
                self.exporter.kill()
                return
            if self.deadline is not None and now > self.deadline:
                self.killed_for = "the case ran past its time limit"
                self.exporter.kill()
                return
            if self._stopped.wait(self.interval):
                return

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=5)

    def latest(self) -> MemorySample | None:
        return self.samples[-1] if self.samples else None

    def peak_between(self, start: float, end: float) -> int | None:
        values = [s.rss for s in self.samples if start <= s.at <= end]
        return max(values) if values else None

    def rss_at(self, moment: float) -> int | None:
        """The last sample taken at or before ``moment``."""
        before = [s.rss for s in self.samples if s.at <= moment]
        return before[-1] if before else None

    def timeline(self, origin: float, step: float = 1.0) -> list[tuple[float, float]]:
        """(seconds since origin, RSS MB), at most one point per ``step``, for --json."""
        points: list[tuple[float, float]] = []
        next_at = origin
        for sample in self.samples:
            if sample.at >= next_at:
                points.append((round(sample.at - origin, 2), round(sample.rss / MiB, 1)))
                next_at = sample.at + step
        return points


# ---- probes --------------------------------------------------------------------------


@dataclass
class Probe:
    started: float  # monotonic
    seconds: float
    status: int | None  # None: no answer (error says why)
    error: str | None = None
    size: int = 0


@dataclass
class Prober:
    """One request at a time, one every ``interval`` (or right after a slower one), each on a
    new connection, as a Prometheus that was just (re)started would open it: a server that
    stops accepting connections shows up here even while old keep-alive sockets still work.
    """

    name: str
    method: str
    url: str
    headers: dict[str, str]
    interval: float
    timeout: float
    body: bytes | None = None
    probes: list[Probe] = field(default_factory=list)
    running: asyncio.Event = field(default_factory=asyncio.Event)
    busy: bool = False
    _finished: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        self.running.set()
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            while True:
                await self.running.wait()
                started = time.monotonic()
                self.busy = True
                self.probes.append(await self._one(session, started))
                self.busy = False
                finished, self._finished = self._finished, asyncio.Event()
                finished.set()
                await asyncio.sleep(max(0.0, started + self.interval - time.monotonic()))

    async def next_probe(self) -> Probe:
        """The next probe to finish (the one in flight, if any)."""
        await self._finished.wait()
        return self.probes[-1]

    async def pause_when_idle(self) -> None:
        """Stop probing; returns once no probe is in flight (so it cannot skew a timing)."""
        self.running.clear()
        if self.busy:
            await self.next_probe()

    async def _one(self, session: aiohttp.ClientSession, started: float) -> Probe:
        try:
            async with session.request(
                self.method, self.url, headers=self.headers, data=self.body
            ) as response:
                payload = await response.read()
                return Probe(
                    started, time.monotonic() - started, response.status, None, len(payload)
                )
        except asyncio.TimeoutError:
            return Probe(started, time.monotonic() - started, None, "timeout")
        except (aiohttp.ClientError, OSError) as err:
            return Probe(started, time.monotonic() - started, None, type(err).__name__)

    def resume(self) -> None:
        self.running.set()


def quantile(values: Sequence[float], fraction: float) -> float | None:
    """Nearest-rank quantile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def summarize(
    probes: Sequence[Probe], start: float, end: float, slow: float = PROMETHEUS_SCRAPE_TIMEOUT
) -> dict[str, Any]:
    """Probes started in [start, end): how many, how many answered 200 within ``slow``
    seconds (a usable answer), the longest time without one, and the latency of those that
    got any answer."""
    window = [p for p in probes if start <= p.started < end]
    answered = [p.seconds for p in window if p.status is not None]
    errors: dict[str, int] = {}
    for probe in window:
        if probe.status is None:
            errors[probe.error or "?"] = errors.get(probe.error or "?", 0) + 1
        elif probe.status != 200:
            errors[f"HTTP {probe.status}"] = errors.get(f"HTTP {probe.status}", 0) + 1
    usable = sorted(
        min(p.started + p.seconds, end) for p in window if p.status == 200 and p.seconds <= slow
    )
    edges = [start, *usable, end]
    return {
        "probes": len(window),
        # The longest stretch of the window without a usable answer.
        "longest_gap_s": round(max(b - a for a, b in pairwise(edges)), 1),
        "ok": sum(1 for p in window if p.status == 200 and p.seconds <= slow),
        "slow": sum(1 for p in window if p.status is not None and p.seconds > slow),
        "errors": errors,
        "p50_s": quantile(answered, 0.5),
        "p99_s": quantile(answered, 0.99),
        "max_s": max(answered) if answered else None,
        "median_s": statistics.median(answered) if answered else None,
    }


# ---- reading /metrics ----------------------------------------------------------------


async def fetch(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], timeout: float
) -> tuple[float, int, bytes, dict[str, str]]:
    """(seconds, status, body as sent on the wire, headers); gzip is not undone here."""
    started = time.monotonic()
    async with session.get(
        url, headers=headers, auto_decompress=False, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as response:
        wire = await response.read()
        return (
            time.monotonic() - started,
            response.status,
            wire,
            {key.lower(): value for key, value in response.headers.items()},
        )


def decoded(wire: bytes, headers: dict[str, str]) -> bytes:
    return gzip.decompress(wire) if headers.get("content-encoding") == "gzip" else wire


def sample_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def sample_value(text: str, name_and_labels: str) -> float | None:
    """The value of the one sample written exactly ``name{labels}`` (or ``name``)."""
    for line in text.splitlines():
        if line.startswith(name_and_labels + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def sum_samples(text: str, name: str, label_filter: str = "") -> float:
    """Sum of every sample of ``name`` whose label text contains ``label_filter``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if label_filter in line.split("}", 1)[0]:
                total += float(line.rsplit(" ", 1)[1])
    return total


# Families per caller or per vLLM target: everything else in vllm_cache_* is about the
# exporter itself (ingest, rejections, the caller cap, and whatever the exporter adds for
# its connections and bodies later), and is what the benches report.
_NOT_SELF = (
    "vllm_cache_requests_",
    "vllm_cache_prompt_tokens_",
    "vllm_cache_cached_tokens_",
    "vllm_cache_unreported_prompt_tokens_",
    "vllm_cache_ttft_seconds",
    "vllm_cache_queue_wait_seconds",
    "vllm_cache_granularity_tokens",
    "vllm_cache_engine_",
    "vllm_cache_exporter_build_info",
)


def self_metrics(text: str, limit: int = 60) -> list[str]:
    """The exporter's own samples (not per caller, per target or build info), non-zero
    first; ``process_*`` and ``python_gc_*`` if a process collector is registered."""
    picked = [
        line
        for line in sample_lines(text)
        if (line.startswith("vllm_cache_") and not line.startswith(_NOT_SELF))
        or line.startswith("process_")
    ]
    picked.sort(key=lambda line: line.rsplit(" ", 1)[1] in ("0", "0.0"))
    return picked[:limit]


def machine() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return f"{os.cpu_count()} CPUs ({model}), Python {sys.version.split()[0]}"


def commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "exporter"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" (exporter/ modified)" if dirty else "")


def mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MiB:,.0f}"


def seconds_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.1f} s"
