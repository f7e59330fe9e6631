"""Ten thousand callers (issue 32): a gateway's usage stream into the exporter, scraped by a
real Prometheus evaluating the shipped rules; what it costs, and whether the states are right.

    python bench/bench_callers.py [--callers 10000] [--models 1|3] [--rate 5000]
        [--conversations 20000] [--duration 150] [--granularity 16] [--seed 32]
        [--connections 4] [--exporter-flag=--callers.max=10000 ...] [--json PATH]
        [-- --more.exporter-flags ...]
    python bench/bench_callers.py --quick     # 500 callers, 200 events/s, 30 s: a smoke check

The traffic, built before anything starts (so that building it costs the run nothing), from
``--seed``: ``--conversations`` live conversations, each of one caller (of ``--callers``) and
one model (of ``--models``), each event the next turn of one of them, as a gateway sees a
fleet of agents. vLLM's prefix cache is simulated at granularity G (``--granularity``: 16 for
a dense model, 2,048 for a hybrid one), the way docs/metrics.md defines the states: a warm
follow-up finds the whole granules of its previous prompt (on a hybrid model sometimes one
fewer), a partial one some granules of it, a cold one none; a first turn finds the caller's
system prompt (whole granules) or nothing; a one-shot tiny request is short; a failed one is
an error. A conversation ends after a random number of turns (or when its context is long),
and a new one, of a random caller and model, takes its place. Every event carries its
``session``, and the bench knows each event's true state: the rule of docs/metrics.md applied
with the true previous turn. Conversations are shared out among ``--connections`` keep-alive
connections (one sender each), so a conversation's turns arrive in order; bodies are NDJSON of
``--batch-min`` to ``--batch-max`` events, sent open-loop at ``--rate`` events/s in all (a late
one is sent at once), with a bearer token (``--usage.ingest.token-file``).

The processes, as deployed: the exporter (``python -m exporter run``, this checkout, plus every
``--exporter-flag`` and everything after ``--``: nothing about callers is set here) and
Prometheus (Debian's ``prometheus``; ``apt-get install -y prometheus``) on deploy/prometheus.yml
with the addresses rewritten: scrape every 15 s with a 10 s timeout (as
deploy/kubernetes/servicemonitor.yaml), rules evaluated every 15 s, the rule files
``vllm-cache-exporter generate`` writes (alerts/vllm-cache-rules.yaml and
alerts/vllm-cache-alerts.yaml), no Alertmanager.

Reported: samples and bytes of /metrics as Prometheus asks for it (OpenMetrics, gzip: on the
wire and decoded), the bench's own GETs of it every ``--get-interval`` s (time to the last byte,
median), CPU per wall second while feeding (exporter, Prometheus, this bench: /proc), POST
latency (p50/p99/max: all, during a Prometheus scrape, during one of the bench's GETs, during
neither), exporter and Prometheus RSS, Prometheus' ``scrape_duration_seconds``,
``scrape_samples_scraped`` and ``up`` for the exporter, each rule group's evaluation time
against its interval (``/api/v1/rules``, polled every 5 s: max and last), and the confusion of
true states against the exporter's ``vllm_cache_requests_total{caller,model,state}`` once the
new-series hold has passed: per (caller, model) for named callers, and as one aggregate for
``caller="__other__"`` (callers past ``--callers.max`` or folded by the series budget). The
matrix's off-diagonal cells are estimated per pair (each state's shortfall shared among the
states counted too often); its diagonal, the states matched, is exact per pair, an upper bound
of the events classified right.

A benchmark for a quiet machine: the posters are one asyncio process (uvloop when installed),
its CPU reported beside the exporter's so the figures can be read honestly on 2 cores.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import datetime
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from harness import (
    PROMETHEUS_HEADERS,
    TEXT_HEADERS,
    ExporterProcess,
    MemorySampler,
    MiB,
    commit,
    cpu_seconds,
    decoded,
    fetch,
    free_port,
    machine,
    proc_memory,
    quantile,
    sum_samples,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the rule files' paths, as `generate` writes them

from exporter.monitoring.render import ALERTS_PATH, RULES_PATH  # noqa: E402

JOB = "vllm-cache-exporter"  # the job every generated rule selects
SCRAPE_INTERVAL = "15s"  # deploy/kubernetes/servicemonitor.yaml
SCRAPE_TIMEOUT = "10s"
EVALUATION_INTERVAL = "15s"
MODELS = ("qwen3.8-27b", "llama-3.3-70b", "granite-4.0-h-small")
TOKEN = "bench-callers-token"

WARM, PARTIAL, COLD, SHORT, UNKNOWN, ERROR = STATES = (
    "warm",
    "partial",
    "cold",
    "short",
    "unknown",
    "error",
)
STATE_INDEX = {state: index for index, state in enumerate(STATES)}

# The traffic's shape (shares of events, then of follow-up turns).
SHORT_SHARE = 0.01  # one-shot tiny requests (a classifier call): short
ERROR_SHARE = 0.005  # failed turns: error, not a turn of the conversation
FOLLOWUP_WARM = 0.88
FOLLOWUP_PARTIAL = 0.07  # the rest of the follow-ups are cold (evicted)
FIRST_TURN_CACHED = 0.5  # a first turn finds its caller's system prompt cached
HYBRID_ONE_GRANULE_FEWER = 0.3  # G >= 256: a warm turn's last checkpoint one granule back
MEAN_TURNS = 30
MAX_CONTEXT = 131_072  # a conversation this long is compacted: a new one starts
QUEUED_SHARE = 0.1  # events that waited in the gateway's admission queue

QUICK = {"callers": 500, "rate": 200, "duration": 30.0, "conversations": 1000}


# ---- the truth -----------------------------------------------------------------------


def true_state(
    prompt: int, cached: int, granularity: int, previous: int | None, tail_granules: float
) -> str:
    """docs/metrics.md's rule, given the true previous turn (written here from the docs, not
    imported: the exporter is what is measured)."""
    bound = (prompt - 1) // granularity * granularity
    if previous is not None and previous < prompt:
        bound = min(bound, (previous - 1) // granularity * granularity)
    bound = max(bound, cached)
    if bound < granularity:
        return SHORT
    if cached == 0:
        return COLD
    if cached >= bound - tail_granules * granularity:
        return WARM
    return PARTIAL


@dataclass
class Body:
    data: bytes
    events: int
    truth: array.array  # (caller * models + model) * 6 + state, one per event


@dataclass
class Traffic:
    """Every body of every connection, built up front, and the story of what was built."""

    bodies: list[list[Body]]  # per connection, in sending order
    kinds: dict[str, int]  # the generator's intent: first turn, warm follow-up, ...
    new_conversations: int
    seconds_to_build: float


def build_traffic(args: argparse.Namespace) -> Traffic:
    started = time.process_time()
    rng = random.Random(args.seed)
    granule = args.granularity
    tail = args.warm_tail_granules
    models = args.models
    hybrid = granule >= 256
    callers = [f"caller-{index:05d}" for index in range(args.callers)]
    model_names = MODELS[:models]
    system_prompt = [rng.randrange(300, 8_000) for _ in range(args.callers)]
    connections = args.connections
    # Conversation slots: slot i belongs to connection i % connections for good, so each
    # conversation's turns leave in order on one connection.
    slots = args.conversations
    conv_caller = [index % args.callers for index in range(slots)]
    conv_model = [(index // args.callers) % models for index in range(slots)]
    conv_session = [f"s{index:06d}" for index in range(slots)]
    conv_prompt = [0] * slots
    serial = slots
    kinds = dict.fromkeys(
        ("first turn, nothing cached", "first turn, system prompt cached", "warm follow-up",
         "partial follow-up", "cold follow-up", "one-shot short", "failed"),
        0,
    )  # fmt: skip
    per_connection = [list(range(c, slots, connections)) for c in range(connections)]
    total = round(args.rate * args.duration)
    bodies: list[list[Body]] = [[] for _ in range(connections)]
    for connection in range(connections):
        mine = per_connection[connection]
        left = total // connections + (connection < total % connections)
        while left > 0:
            size = min(left, rng.randint(args.batch_min, args.batch_max))
            left -= size
            lines: list[str] = []
            truth = array.array("I")
            for _ in range(size):
                roll = rng.random()
                completion = rng.randrange(20, 1_500)
                if roll < SHORT_SHARE:  # a one-shot tiny request, its own session
                    caller = rng.randrange(args.callers)
                    model = rng.randrange(models)
                    prompt = rng.randint(1, granule)
                    serial += 1
                    session = f"one{serial:07d}"
                    cached, previous = 0, None
                    kinds["one-shot short"] += 1
                else:
                    slot = mine[rng.randrange(len(mine))]
                    caller, model = conv_caller[slot], conv_model[slot]
                    session = conv_session[slot]
                    if roll < SHORT_SHARE + ERROR_SHARE:  # failed: not a turn
                        lines.append(
                            f'{{"caller":"{callers[caller]}","model":"{model_names[model]}",'
                            f'"session":"{session}","status":500}}'
                        )
                        truth.append((caller * models + model) * 6 + 5)
                        kinds["failed"] += 1
                        continue
                    last = conv_prompt[slot]
                    if last == 0:  # the conversation's first turn
                        system = system_prompt[caller]
                        prompt = system + rng.randrange(20, 3_000)
                        previous = None
                        if rng.random() < FIRST_TURN_CACHED:
                            cached = system // granule * granule
                            kinds["first turn, system prompt cached"] += 1
                        else:
                            cached = 0
                            kinds["first turn, nothing cached"] += 1
                    else:
                        prompt = last + rng.randrange(100, 3_000)
                        previous = last
                        reusable = (last - 1) // granule * granule
                        turn = rng.random()
                        if turn < FOLLOWUP_WARM:
                            cached = reusable
                            if hybrid and reusable >= 2 * granule:
                                if rng.random() < HYBRID_ONE_GRANULE_FEWER:
                                    cached -= granule
                            kinds["warm follow-up"] += 1
                        elif turn < FOLLOWUP_WARM + FOLLOWUP_PARTIAL and reusable >= 4 * granule:
                            cached = granule * rng.randint(1, reusable // granule - 3)
                            kinds["partial follow-up"] += 1
                        else:
                            cached = 0
                            kinds["cold follow-up"] += 1
                    if prompt > MAX_CONTEXT or rng.random() < 1 / MEAN_TURNS:
                        # It ends: a new conversation of a random caller and model takes its
                        # slot (and connection).
                        serial += 1
                        conv_caller[slot] = rng.randrange(args.callers)
                        conv_model[slot] = rng.randrange(models)
                        conv_session[slot] = f"s{serial:06d}"
                        conv_prompt[slot] = 0
                    else:
                        conv_prompt[slot] = prompt
                state = true_state(prompt, cached, granule, previous, tail)
                truth.append((caller * models + model) * 6 + STATE_INDEX[state])
                queue = rng.uniform(0.01, 2.0) if rng.random() < QUEUED_SHARE else 0.0
                ttft = queue + 0.04 + (prompt - cached) / 8_000 + rng.uniform(0, 0.05)
                queued = f'"queue_seconds":{queue:.3f},' if queue else ""
                lines.append(
                    f'{{"caller":"{callers[caller]}","model":"{model_names[model]}",'
                    f'"prompt_tokens":{prompt},"cached_tokens":{cached},'
                    f'"completion_tokens":{completion},"ttft_seconds":{ttft:.3f},{queued}'
                    f'"session":"{session}","status":200}}'
                )
            bodies[connection].append(Body("\n".join(lines).encode(), size, truth))
    return Traffic(bodies, kinds, serial - slots, time.process_time() - started)


# ---- Prometheus ----------------------------------------------------------------------


def prometheus_config(exporter: str) -> dict[str, Any]:
    """deploy/prometheus.yml with the exporter's address, the ServiceMonitor's timeout, the
    checkout's rule files, and neither Alertmanager nor the vllm job (no vLLM here)."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text("utf-8"))
    config["global"].update(
        scrape_interval=SCRAPE_INTERVAL,
        scrape_timeout=SCRAPE_TIMEOUT,
        evaluation_interval=EVALUATION_INTERVAL,
    )
    config["rule_files"] = [str(ROOT / RULES_PATH), str(ROOT / ALERTS_PATH)]
    config.pop("alerting", None)
    jobs = [job for job in config["scrape_configs"] if job["job_name"] == JOB]
    assert len(jobs) == 1, f"deploy/prometheus.yml has no job {JOB}"
    jobs[0]["static_configs"] = [{"targets": [exporter]}]
    config["scrape_configs"] = jobs
    return config


class PrometheusProcess:
    """The ``prometheus`` binary on its own port and data directory, log in ``workdir``
    (``pid`` and ``kill`` as ``ExporterProcess``, for harness.MemorySampler)."""

    def __init__(self, binary: str, workdir: Path, exporter: str) -> None:
        self.binary = binary
        self.workdir = workdir
        self.address = f"127.0.0.1:{free_port()}"
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(prometheus_config(exporter)), "utf-8")
        self.log_path = workdir / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                    f"--web.listen-address={self.address}",
                ],
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    async def wait_ready(self, session: aiohttp.ClientSession, within: float = 60.0) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited; see {self.log_path}")
            try:
                async with session.get(self.url + "/-/ready") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)  # another process: poll with a deadline
        raise RuntimeError(f"prometheus not ready within {within}s; see {self.log_path}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


async def range_samples(
    session: aiohttp.ClientSession, prometheus: str, expr: str, seconds: float
) -> list[tuple[float, float]]:
    """Every stored sample of ``expr`` over the last ``seconds``: (timestamp, value)."""
    async with session.post(
        prometheus + "/api/v1/query", data={"query": f"{expr}[{math.ceil(seconds)}s]"}
    ) as response:
        body = await response.json()
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return sorted(
        (float(at), float(value))
        for series in body["data"]["result"]
        for at, value in series["values"]
    )


# ---- the run -------------------------------------------------------------------------


@dataclass
class Post:
    started: float  # wall clock (time.time), to set against Prometheus' scrape timestamps
    seconds: float
    status: int | None
    events: int
    accepted: int = 0
    rejected: int = 0


@dataclass
class Get:
    started: float  # wall clock
    seconds: float
    status: int | None
    wire: int = 0
    plain: int = 0
    samples: int = 0
    exporter_cpu: float | None = None  # the exporter's CPU seconds over the GET (with ingest)


@dataclass
class Run:
    args: argparse.Namespace
    exporter: ExporterProcess
    prometheus: PrometheusProcess
    traffic: Traffic
    posts: list[Post] = field(default_factory=list)
    gets: list[Get] = field(default_factory=list)
    failed_truth: list[array.array] = field(default_factory=list)
    unsent_events: int = 0
    max_lag: float = 0.0
    # (group name, file) -> {lastEvaluation: evaluationTime}; interval; rule errors seen.
    evaluations: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    intervals: dict[tuple[str, str], float] = field(default_factory=dict)
    slowest_rule: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)
    rule_errors: dict[str, str] = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)


async def poster(run: Run, connection: int, t0: float, give_up: float) -> None:
    args = run.args
    bodies = run.traffic.bodies[connection]
    rate = args.rate / args.connections
    url = run.exporter.base_url + "/v1/usage"
    headers = {"Content-Type": "application/x-ndjson", "Authorization": f"Bearer {TOKEN}"}
    timeout = aiohttp.ClientTimeout(total=60)
    loop = asyncio.get_running_loop()
    # The senders start out of phase, as a gateway's workers would.
    offset = connection / args.connections * (args.batch_min + args.batch_max) / 2 / rate
    sent = 0
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for index, body in enumerate(bodies):
            due = t0 + offset + sent / rate
            now = loop.time()
            if now > give_up:
                run.unsent_events += sum(b.events for b in bodies[index:])
                run.failed_truth.extend(b.truth for b in bodies[index:])
                return
            if due > now:
                await asyncio.sleep(due - now)
            else:
                run.max_lag = max(run.max_lag, now - due)
            sent += body.events
            wall, started = time.time(), loop.time()
            post = Post(wall, 0.0, None, body.events)
            try:
                async with session.post(url, data=body.data, headers=headers) as response:
                    reply = await response.read()
                    post.status = response.status
                post.seconds = loop.time() - started
                figures = json.loads(reply) if post.status in (200, 422) else {}
                post.accepted = figures.get("accepted", 0)
                post.rejected = figures.get("rejected", 0)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                post.seconds = loop.time() - started
            if post.status != 200 or post.accepted != body.events:
                run.failed_truth.append(body.truth)  # how many of it counted is unknown
            run.posts.append(post)


def count_samples(wire: bytes, headers: dict[str, str]) -> tuple[int, int]:
    """(decoded bytes, samples): every line that is not a comment or blank (in a thread:
    zlib lets go of the GIL)."""
    plain = decoded(wire, headers)
    lines = plain.count(b"\n") + (not plain.endswith(b"\n"))
    comments = plain.count(b"\n#") + plain.startswith(b"#")
    blanks = plain.count(b"\n\n")
    return len(plain), lines - comments - blanks


async def getter(run: Run, ends: float) -> None:
    """GET /metrics as Prometheus asks for it, every ``--get-interval`` s (time to last byte)."""
    url = run.exporter.base_url + "/metrics"
    loop = asyncio.get_running_loop()
    if run.args.get_interval <= 0:
        return
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(min(7.0, run.args.get_interval / 2))
        while loop.time() < ends:
            tick = loop.time()
            wall = time.time()
            cpu_before = cpu_seconds(run.exporter.pid)
            try:
                seconds, status, wire, headers = await fetch(session, url, PROMETHEUS_HEADERS, 60)
                cpu_after = cpu_seconds(run.exporter.pid)
                get = Get(wall, seconds, status, len(wire))
                if cpu_before is not None and cpu_after is not None:
                    get.exporter_cpu = cpu_after - cpu_before
                get.plain, get.samples = await asyncio.to_thread(count_samples, wire, headers)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                get = Get(wall, loop.time() - tick, None)
            run.gets.append(get)
            await asyncio.sleep(max(0.0, tick + run.args.get_interval - loop.time()))


async def rules_poller(run: Run, ends: float) -> None:
    """/api/v1/rules every 5 s: each group's evaluation time at each evaluation seen."""
    url = run.prometheus.url + "/api/v1/rules"
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        while loop.time() < ends:
            try:
                async with session.get(url) as response:
                    body = await response.json()
                for group in body["data"]["groups"]:
                    key = (group["name"], Path(group["file"]).name)
                    run.intervals[key] = float(group["interval"])
                    last = group.get("lastEvaluation", "")
                    if last and not last.startswith("0001-"):
                        run.evaluations.setdefault(key, {})[last] = float(group["evaluationTime"])
                    slowest = max(group["rules"], key=lambda rule: rule["evaluationTime"])
                    run.slowest_rule[key] = (
                        slowest.get("name", "?"),
                        float(slowest["evaluationTime"]),
                    )
                    for rule in group["rules"]:
                        if rule.get("health") == "err":
                            run.rule_errors[rule["name"]] = rule.get("lastError", "")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError):
                pass
            await asyncio.sleep(5.0)


async def final_counts(run: Run, accepted: int) -> tuple[str, float]:
    """The exporter's text exposition once every accepted event shows in
    ``vllm_cache_requests_total`` (new series are held at zero for a while), or at the
    ``--settle`` deadline: (text, seconds waited)."""
    url = run.exporter.base_url + "/metrics"
    started = time.monotonic()
    text = ""
    async with aiohttp.ClientSession() as session:
        while True:
            _, status, wire, headers = await fetch(session, url, TEXT_HEADERS, 120)
            if status == 200:
                plain = await asyncio.to_thread(decoded, wire, headers)
                text = plain.decode()
                if sum_samples(text, "vllm_cache_requests_total") >= accepted:
                    break
            if time.monotonic() - started > run.args.settle:
                break
            await asyncio.sleep(10.0)  # the hold is the exporter's: poll with a deadline
    return text, time.monotonic() - started


async def drive(run: Run) -> dict[str, Any]:
    args = run.args
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        await run.prometheus.wait_ready(session)
    t0 = loop.time() + 0.5
    feed_ends = t0 + args.duration
    give_up = feed_ends + max(30.0, args.duration / 2)
    run.marks.update(feed_start_wall=time.time() + 0.5, load_start=os.getloadavg()[0])
    pollers_end = feed_ends + args.tail
    pollers = [
        asyncio.ensure_future(getter(run, feed_ends)),
        asyncio.ensure_future(rules_poller(run, pollers_end)),
    ]
    await asyncio.sleep(max(0.0, t0 - loop.time()))
    pids = {"exporter": run.exporter.pid, "prometheus": run.prometheus.pid}
    cpu_start = {name: cpu_seconds(pid) or 0.0 for name, pid in pids.items()}
    bench_start = time.process_time()
    await asyncio.gather(*(poster(run, c, t0, give_up) for c in range(args.connections)))
    fed = loop.time() - t0
    run.marks.update(feed_seconds=fed, feed_end_wall=time.time())
    for name, pid in pids.items():
        run.cpu[name] = ((cpu_seconds(pid) or 0.0) - cpu_start[name]) / fed
    run.cpu["bench"] = (time.process_time() - bench_start) / fed
    await asyncio.gather(*pollers)  # a scrape and an evaluation of the final state
    window = time.time() - run.marks["feed_start_wall"] + 20
    prom: dict[str, list[tuple[float, float]]] = {}
    async with aiohttp.ClientSession() as session:
        for name in ("scrape_duration_seconds", "up", "scrape_samples_scraped"):
            prom[name] = await range_samples(
                session, run.prometheus.url, f'{name}{{job="{JOB}"}}', window
            )
        async with session.get(run.prometheus.url + "/metrics") as response:
            own = await response.text()
    iterations = {
        name: {
            dict(LABEL.findall(labels))["rule_group"].rsplit(";", 1)[-1]: float(value)
            for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)", own, re.M)
        }
        for name in (
            "prometheus_rule_group_iterations_total",
            "prometheus_rule_group_iterations_missed_total",
        )
    }
    run.marks["load_end"] = os.getloadavg()[0]
    accepted = sum(post.accepted for post in run.posts)
    text, waited = await final_counts(run, accepted)
    return {
        "prometheus": prom,
        "iterations": iterations,
        "text": text,
        "settle_seconds": waited,
        "accepted": accepted,
    }


# ---- the confusion matrix ------------------------------------------------------------

LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
REQUESTS = re.compile(r"^vllm_cache_requests_total\{([^}]*)\} (\S+)", re.M)


def exporter_requests(text: str) -> dict[tuple[str, str], list[float]]:
    pairs: dict[tuple[str, str], list[float]] = {}
    for match in REQUESTS.finditer(text):
        labels = dict(LABEL.findall(match.group(1)))
        counts = pairs.setdefault((labels["caller"], labels["model"]), [0.0] * 6)
        counts[STATE_INDEX[labels["state"]]] += float(match.group(2))
    return pairs


def confusion(run: Run, text: str, callers: list[str], models: list[str]) -> dict[str, Any]:
    """True states against the exporter's, per (caller, model) where the caller has its own
    label, as one aggregate for everything counted under __other__."""
    model_count = len(models)
    truth_flat = [0] * (len(callers) * model_count * 6)
    failed = [0] * len(truth_flat)
    for body_list in run.traffic.bodies:
        for body in body_list:
            for index in body.truth:
                truth_flat[index] += 1
    for lost in run.failed_truth:
        for index in lost:
            failed[index] += 1
    exported = exporter_requests(text)
    named = {caller for caller, _ in exported if caller != "__other__"}
    matrix = [[0.0] * 6 for _ in range(6)]
    other_truth = [0.0] * 6
    pairs = exact = 0
    missing_pairs = 0
    compared: list[tuple[list[float], list[float]]] = []
    for caller_index, caller in enumerate(callers):
        for model_index, model in enumerate(models):
            base = (caller_index * model_count + model_index) * 6
            truth = [float(truth_flat[base + s] - failed[base + s]) for s in range(6)]
            if not any(truth):
                continue
            counted = exported.pop((caller, model), None) if caller in named else None
            if counted is None:
                if caller in named:
                    missing_pairs += 1  # its caller is named, the pair folded by the budget
                other_truth = [a + b for a, b in zip(other_truth, truth, strict=True)]
                continue
            pairs += 1
            exact += counted == truth
            compared.append((truth, counted))
    other_counted = [0.0] * 6
    unexpected = []
    for (caller, _model), counted in exported.items():
        if caller == "__other__":
            other_counted = [a + b for a, b in zip(other_counted, counted, strict=True)]
        else:
            unexpected.append(caller)
    if any(other_truth) or any(other_counted):
        compared.append((other_truth, other_counted))
    matched = 0.0
    for truth, counted in compared:
        short = [max(t - c, 0.0) for t, c in zip(truth, counted, strict=True)]
        over = [max(c - t, 0.0) for t, c in zip(truth, counted, strict=True)]
        surplus = sum(over)
        for s in range(6):
            diagonal = min(truth[s], counted[s])
            matrix[s][s] += diagonal
            matched += diagonal
            if short[s] and surplus:
                for o in range(6):
                    matrix[s][o] += short[s] * over[o] / surplus
    total_truth = sum(truth_flat) - sum(failed)
    return {
        "matrix": [[round(value) for value in row] for row in matrix],
        "truth_by_state": dict(zip(STATES, [sum(row) for row in matrix], strict=True)),
        "exporter_by_state": dict(
            zip(STATES, [sum(matrix[s][o] for s in range(6)) for o in range(6)], strict=True)
        ),
        "events_compared": total_truth,
        "states_matched_pct": round(100 * matched / total_truth, 3) if total_truth else None,
        "named_pairs": pairs,
        "named_pairs_exact": exact,
        "named_callers": len(named),
        "pairs_of_named_callers_folded": missing_pairs,
        "other_events_true": int(sum(other_truth)),
        "other_events_counted": int(sum(other_counted)),
        "other_share_pct": round(100 * sum(other_truth) / total_truth, 2) if total_truth else None,
        "unexpected_callers": unexpected[:10],
    }


# ---- the report ----------------------------------------------------------------------


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def latency(posts: Sequence[Post]) -> dict[str, Any]:
    seconds = [post.seconds for post in posts]
    return {
        "posts": len(posts),
        "p50_ms": ms(quantile(seconds, 0.5)),
        "p99_ms": ms(quantile(seconds, 0.99)),
        "max_ms": ms(max(seconds) if seconds else None),
    }


def overlaps(post: Post, windows: Sequence[tuple[float, float]]) -> bool:
    end = post.started + post.seconds
    return any(start < end and post.started < stop for start, stop in windows)


def used_cpu(gets: Sequence[Get]) -> list[float]:
    return [get.exporter_cpu for get in gets if get.exporter_cpu is not None]


def rule_groups(run: Run, iterations: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Each group's evaluation time (max and last seen) against its interval, and
    Prometheus' own count of its iterations and of those it missed (an evaluation still
    running when the next was due)."""
    ran = iterations.get("prometheus_rule_group_iterations_total", {})
    missed = iterations.get("prometheus_rule_group_iterations_missed_total", {})
    groups = []
    for key, seen in sorted(run.evaluations.items()):
        ordered = [seen[at] for at in sorted(seen)]
        interval = run.intervals.get(key, 15.0)
        slowest = run.slowest_rule.get(key, ("?", 0.0))
        groups.append(
            {
                "group": key[0],
                "file": key[1],
                "interval_s": interval,
                "evaluations_seen": len(ordered),
                "max_s": round(max(ordered), 4),
                "last_s": round(ordered[-1], 4),
                "max_pct": round(100 * max(ordered) / interval, 2),
                "last_pct": round(100 * ordered[-1] / interval, 2),
                "slowest_rule_last": slowest[0],
                "slowest_rule_last_s": round(slowest[1], 4),
                "iterations": ran.get(key[0]),
                "iterations_missed": missed.get(key[0]),
            }
        )
    return groups


def report(
    run: Run, found: dict[str, Any], sampler: MemorySampler, prom_sampler: MemorySampler
) -> dict[str, Any]:
    args = run.args
    prom = found["prometheus"]
    text = found["text"]
    durations = prom["scrape_duration_seconds"]
    scrape_windows = [(at, at + seconds) for at, seconds in durations]
    get_windows = [(get.started, get.started + get.seconds) for get in run.gets]
    posts = run.posts
    during_scrape = [post for post in posts if overlaps(post, scrape_windows)]
    during_get = [post for post in posts if overlaps(post, get_windows)]
    quiet = [
        post
        for post in posts
        if not overlaps(post, scrape_windows) and not overlaps(post, get_windows)
    ]
    statuses: dict[str, int] = {}
    for post in posts:
        statuses[str(post.status)] = statuses.get(str(post.status), 0) + 1
    good_gets = [get for get in run.gets if get.status == 200]
    last_get = good_gets[-1] if good_gets else None
    up = [value for _, value in prom["up"]]
    up_at = dict(prom["up"])
    feed_start = run.marks["feed_start_wall"]
    rss = [s.rss for s in sampler.samples]
    callers = [f"caller-{index:05d}" for index in range(args.callers)]
    models = list(MODELS[: args.models])
    sent = sum(post.events for post in posts)
    render_names = sorted(
        {
            line.split("{")[0].split(" ")[0]
            for line in text.splitlines()
            if line.startswith("vllm_cache_exporter_") and "render" in line.split(" ")[0]
        }
    )
    return {
        "callers": args.callers,
        "models": args.models,
        "rate": args.rate,
        "conversations": args.conversations,
        "duration_s": args.duration,
        "granularity": args.granularity,
        "seed": args.seed,
        "connections": args.connections,
        "exporter_command": " ".join(shlex.quote(part) for part in run.exporter.command),
        "traffic": {
            "events_built": sum(b.events for bodies in run.traffic.bodies for b in bodies),
            "bodies": sum(len(bodies) for bodies in run.traffic.bodies),
            "kinds": run.traffic.kinds,
            "new_conversations": run.traffic.new_conversations,
            "build_cpu_s": round(run.traffic.seconds_to_build, 1),
        },
        "feed": {
            "seconds": round(run.marks["feed_seconds"], 1),
            "events_sent": sent,
            "events_unsent": run.unsent_events,
            "achieved_rate": round(sent / run.marks["feed_seconds"]),
            "events_accepted": found["accepted"],
            "events_rejected": sum(post.rejected for post in posts),
            "post_statuses": statuses,
            "sender_max_lag_s": round(run.max_lag, 3),
        },
        "cpu_per_wall_s": {name: round(value, 3) for name, value in run.cpu.items()},
        "post_latency": {
            "all": latency(posts),
            "during_prometheus_scrape": latency(during_scrape),
            "during_bench_get": latency(during_get),
            "neither": latency(quiet),
        },
        "metrics": {
            "samples": last_get.samples if last_get else None,
            "bytes_plain": last_get.plain if last_get else None,
            "bytes_gzip": last_get.wire if last_get else None,
            "bench_gets": len(run.gets),
            "bench_get_failed": len(run.gets) - len(good_gets),
            "bench_get_median_ms": ms(
                statistics.median(g.seconds for g in good_gets) if good_gets else None
            ),
            "bench_get_max_ms": ms(max((g.seconds for g in good_gets), default=None)),
            "bench_get_exporter_cpu_median_s": (
                round(statistics.median(cpus), 3) if (cpus := used_cpu(good_gets)) else None
            ),
            "bench_get_timeline": [
                (
                    round(g.started - feed_start, 1),
                    ms(g.seconds),
                    g.samples,
                    round(g.exporter_cpu or 0, 3),
                )
                for g in run.gets
            ],
            "exporter_render_metrics": render_names or "not exposed",
            "bytes_text_final": len(text.encode()),
        },
        "exporter_rss_mb": {
            "start": round(rss[0] / MiB, 1) if rss else None,
            "peak": round(max(rss) / MiB, 1) if rss else None,
            "end": round(rss[-1] / MiB, 1) if rss else None,
        },
        "prometheus_rss_peak_mb": round(
            max((s.rss for s in prom_sampler.samples), default=0) / MiB, 1
        ),
        "prometheus": {
            "scrape_count": len(durations),
            "scrape_duration_median_ms": ms(
                statistics.median(v for _, v in durations) if durations else None
            ),
            "scrape_duration_max_ms": ms(max((v for _, v in durations), default=None)),
            "scrapes_expected": int(
                (run.marks["feed_end_wall"] + run.args.tail - feed_start) // 15
            ),
            "scrapes": [
                (round(at - feed_start, 1), ms(seconds), up_at.get(at)) for at, seconds in durations
            ],
            "up_samples": len(up),
            "up_zero": sum(1 for value in up if value == 0),
            "samples_scraped_max": max((v for _, v in prom["scrape_samples_scraped"]), default=0),
            "rule_groups": rule_groups(run, found["iterations"]),
            "rule_errors": run.rule_errors,
        },
        "exporter_counters": {
            name: sum_samples(text, name)
            for name in (
                "vllm_cache_callers_overflowed_total",
                "vllm_cache_callers_folded_total",
                "vllm_cache_conversations_dropped_total",
                "vllm_cache_unseen_history_requests_total",
                "vllm_cache_usage_ingest_requests_rejected_total",
                "vllm_cache_usage_events_rejected_total",
                "vllm_cache_exporter_scrapes_cut_total",
            )
        },
        "granularity_exported": [
            line for line in text.splitlines() if line.startswith("vllm_cache_granularity_tokens")
        ],
        "settle_s": round(found["settle_seconds"], 1),
        "load_average_1m": {
            "feed_start": round(run.marks["load_start"], 2),
            "end": round(run.marks["load_end"], 2),
        },
        "confusion": confusion(run, text, callers, models),
        "exporter_survived": run.exporter.alive() and sampler.killed_for is None,
        "killed_for": sampler.killed_for or prom_sampler.killed_for,
        "exporter_log_bytes": run.exporter.log_bytes(),
    }


def print_report(result: dict[str, Any]) -> None:
    feed, cpu, metrics = result["feed"], result["cpu_per_wall_s"], result["metrics"]
    prom, conf = result["prometheus"], result["confusion"]
    print(
        f"{result['callers']:,} callers x {result['models']} model(s), "
        f"{result['conversations']:,} conversations, {result['rate']:,} events/s for "
        f"{result['duration_s']:.0f} s over {result['connections']} connections, "
        f"G = {result['granularity']}, seed {result['seed']}"
    )
    print(f"exporter: {result['exporter_command']}")
    load = result["load_average_1m"]
    print(f"load average (1 min): {load['feed_start']} at the start, {load['end']} at the end")
    traffic = result["traffic"]
    print(
        f"traffic: {traffic['events_built']:,} events in {traffic['bodies']:,} bodies, built "
        f"in {traffic['build_cpu_s']} s; {traffic['new_conversations']:,} conversations began "
        f"during it; " + ", ".join(f"{kind} {count:,}" for kind, count in traffic["kinds"].items())
    )
    rows = [
        ("events sent / accepted / rejected / unsent",
         f"{feed['events_sent']:,} / {feed['events_accepted']:,} / {feed['events_rejected']:,}"
         f" / {feed['events_unsent']:,}"),
        ("achieved rate, sender max lag",
         f"{feed['achieved_rate']:,}/s, {feed['sender_max_lag_s']} s"),
        ("POST statuses", json.dumps(feed["post_statuses"])),
        ("CPU s per wall s: exporter / prometheus / bench",
         f"{cpu['exporter']} / {cpu['prometheus']} / {cpu['bench']}"),
        ("/metrics samples", f"{metrics['samples']:,}" if metrics["samples"] else "-"),
        ("/metrics bytes: OpenMetrics / gzip / final text",
         f"{metrics['bytes_plain'] or 0:,} / {metrics['bytes_gzip'] or 0:,} / "
         f"{metrics['bytes_text_final']:,}"),
        ("bench GET /metrics (gzip): median / max / n",
         f"{metrics['bench_get_median_ms']} / {metrics['bench_get_max_ms']} ms / "
         f"{metrics['bench_gets']}"),
        ("exporter CPU s during a bench GET, median",
         str(metrics["bench_get_exporter_cpu_median_s"])),
        ("exporter's own render timing", str(metrics["exporter_render_metrics"])),
        ("exporter RSS MB: start / peak / end",
         " / ".join(str(v) for v in result["exporter_rss_mb"].values())),
        ("Prometheus RSS MB, peak", str(result["prometheus_rss_peak_mb"])),
        ("scrape_duration_seconds: median / max",
         f"{prom['scrape_duration_median_ms']} / {prom['scrape_duration_max_ms']} ms"),
        ("scrapes stored / expected at 15 s",
         f"{prom['scrape_count']} / {prom['scrapes_expected']}"),
        ("up: samples / up==0", f"{prom['up_samples']} / {prom['up_zero']}"),
        ("scrape_samples_scraped, max", f"{prom['samples_scraped_max']:,.0f}"),
    ]  # fmt: skip
    for name, figures in result["post_latency"].items():
        rows.append(
            (
                f"POST p50 / p99 / max ms ({name})",
                f"{figures['p50_ms']} / {figures['p99_ms']} / {figures['max_ms']} "
                f"(n={figures['posts']:,})",
            )
        )
    for name, value in result["exporter_counters"].items():
        rows.append((name, f"{value:,.0f}"))
    rows.append(("granularity exported", "; ".join(result["granularity_exported"]) or "-"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print("rule groups (evaluationTime vs interval):")
    for group in prom["rule_groups"]:
        print(
            f"  {group['group']:<26} {group['file']:<24} interval {group['interval_s']:.0f} s, "
            f"{group['evaluations_seen']} seen: max {group['max_s'] * 1e3:.1f} ms "
            f"({group['max_pct']}%), last {group['last_s'] * 1e3:.1f} ms ({group['last_pct']}%);"
            f" slowest rule {group['slowest_rule_last']} {group['slowest_rule_last_s'] * 1e3:.1f}"
            f" ms; iterations {group['iterations']}, missed {group['iterations_missed']}"
        )
    if prom["rule_errors"]:
        print(f"  rules in error: {prom['rule_errors']}")
    print(
        f"states (after {result['settle_s']} s for the new-series hold): "
        f"{conf['states_matched_pct']}% of {conf['events_compared']:,} matched; "
        f"{conf['named_callers']:,} named callers, {conf['named_pairs_exact']:,} of "
        f"{conf['named_pairs']:,} (caller, model) pairs exact; __other__: "
        f"{conf['other_events_true']:,} true events ({conf['other_share_pct']}% of traffic), "
        f"{conf['other_events_counted']:,} counted there"
    )
    print("  true \\ exporter " + "".join(f"{state:>10}" for state in STATES))
    for state, row in zip(STATES, conf["matrix"], strict=True):
        print(f"  {state:<16} " + "".join(f"{value:>10,}" for value in row))
    if not result["exporter_survived"] or result["killed_for"]:
        print(f"exporter survived: {result['exporter_survived']} ({result['killed_for']})")


# ---- main ----------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exporter flags after -- are passed through as they are.",
    )
    parser.add_argument("--callers", type=int, default=10_000)
    parser.add_argument("--models", type=int, default=1, choices=range(1, len(MODELS) + 1))
    parser.add_argument("--rate", type=int, default=5_000, help="events per second, in all")
    parser.add_argument("--conversations", type=int, default=20_000, help="live at once")
    parser.add_argument("--duration", type=float, default=150.0, help="seconds of feeding")
    parser.add_argument("--granularity", type=int, default=16, help="G: 16 dense, 2048 hybrid")
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument("--connections", type=int, default=4, help="concurrent posters")
    parser.add_argument("--batch-min", type=int, default=50)
    parser.add_argument("--batch-max", type=int, default=200)
    parser.add_argument(
        "--warm-tail-granules",
        type=float,
        default=2.0,
        help="K of the true states (pass the exporter's own with --signals.warm-tail-granules)",
    )
    parser.add_argument(
        "--get-interval",
        type=float,
        default=20.0,
        help="seconds between the bench's GETs (0: none)",
    )
    parser.add_argument("--tail", type=float, default=20.0, help="seconds polled after feeding")
    parser.add_argument(
        "--settle",
        type=float,
        default=150.0,
        help="most seconds to wait for the new-series hold before comparing states",
    )
    parser.add_argument(
        "--exporter-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more exporter flag, e.g. --exporter-flag=--callers.max=10000 (repeatable)",
    )
    parser.add_argument("--prometheus", default=shutil.which("prometheus") or "")
    parser.add_argument("--rss-guard-mb", type=int, default=12_288)
    parser.add_argument("--quick", action="store_true", help=f"smoke check: {QUICK}")
    parser.add_argument("--json", metavar="PATH", help="write every figure there")
    args = parser.parse_args(argv)
    if args.quick:  # its figures, except where the command line gives its own
        for name, value in QUICK.items():
            option = "--" + name.replace("_", "-")
            if not any(arg == option or arg.startswith(option + "=") for arg in argv):
                setattr(args, name, value)
    args.exporter_flags = [*args.exporter_flag, *passthrough]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.prometheus:
        print("prometheus not found: apt-get install -y prometheus", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up on kill, too
    traffic = build_traffic(args)
    print(
        f"built {sum(b.events for bodies in traffic.bodies for b in bodies):,} events in "
        f"{traffic.seconds_to_build:.1f} s of CPU",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="bench-callers-") as workdir_name:
        workdir = Path(workdir_name)
        token_file = workdir / "usage-token"
        token_file.write_text(TOKEN)
        exporter = ExporterProcess(
            workdir, [f"--usage.ingest.token-file={token_file}", *args.exporter_flags]
        )
        prometheus = PrometheusProcess(args.prometheus, workdir, f"127.0.0.1:{exporter.port}")
        guard_deadline = time.monotonic() + args.duration * 2 + args.settle + 600
        sampler = MemorySampler(exporter, 1.0, args.rss_guard_mb * MiB, guard_deadline)
        prom_sampler: MemorySampler | None = None
        try:
            exporter.start()
            sampler.start()
            prometheus.start()
            prom_sampler = MemorySampler(
                prometheus,  # type: ignore[arg-type]  # pid and kill are all it uses
                1.0,
                args.rss_guard_mb * MiB,
                guard_deadline,
            )
            prom_sampler.start()
            run = Run(args, exporter, prometheus, traffic)
            try:
                import uvloop

                found = uvloop.run(drive(run))
            except ImportError:
                found = asyncio.run(drive(run))
            sampler.stop()
            prom_sampler.stop()
            result = report(run, found, sampler, prom_sampler)
            if proc_memory(prometheus.pid) is None:
                result["prometheus_died"] = True
        finally:
            sampler.stop()
            if prom_sampler is not None:
                prom_sampler.stop()
            prometheus.stop()
            exporter.stop()
    result.update(
        machine=machine(),
        commit=commit(),
        date=datetime.date.today().isoformat(),
    )
    print(f"{result['date']}, commit {result['commit']}, {result['machine']}")
    print_report(result)
    if args.json:
        result["metrics"]["timeline"] = result["metrics"].pop("bench_get_timeline")
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    healthy = (
        result["exporter_survived"]
        and result["feed"]["events_unsent"] == 0
        and result["feed"]["events_accepted"] == result["feed"]["events_sent"]
    )
    return 0 if healthy else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the finally block has stopped both processes by now
        print("interrupted; the exporter and Prometheus were stopped", file=sys.stderr)
        sys.exit(130)
