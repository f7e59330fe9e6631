"""End to end with the real thing: Prometheus and Alertmanager (Debian's packages) on the
committed deploy/prometheus.yml and deploy/alertmanager.yml, the generated rules, and two
exporters fed by the simulator playing the field reports' scenarios.

- two-agents-collapse (agent A warm alone, then B arrives and both fall to ~0 cached) must
  page: VllmCachePrefixCollapse is delivered by Alertmanager to the test's webhook, on the
  route for critical alerts.
- two-agents-fit (two 90k conversations, 92-95% cached) must deliver no page.
- Every dashboard target's PromQL, variables filled in, returns data from that Prometheus
  (KV residency included: both simulators run with vLLM's --kv-cache-metrics); and the
  caller dashboard's queue-wait and TTFT panels have vLLM's own figures (source="engine")
  for each way of deploying: the tap (the fit's exporter runs one and its driver goes
  through it), LiteLLM (its recorded batch, posted as LiteLLM posts it) and a proxy of one's
  own (the collapse's driver, reporting the metrics vLLM sent). The prompt-order panels
  have a caller with a timestamp at the top of its fan-out's prompts: chat requests through
  a tap the collapse's exporter runs too (the fit's pool is left to its two conversations).

The simulators play vLLM with ``--enable-per-request-metrics`` (the scenarios turn it on).

The scenarios run 10-20x faster than real time, so the rules are generated with the same
generator and short windows (``generate --config``), Prometheus scrapes and evaluates every
second, and Alertmanager's waits are shortened in the test's copy of its config. Nothing else
in the two config files changes: only addresses and intervals. Both scenarios share one
Prometheus (their callers have the same names), so the test's rule config also keeps
``instance`` in every aggregation.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import pytest
import yaml
from aiohttp import web

from exporter.monitoring.config import MonitoringConfig, config_from_mapping
from exporter.monitoring.render import prometheus_files
from tests.monitoring.common import DASHBOARD_DIR, ROOT, require_tool

pytestmark = pytest.mark.e2e

# Windows in real seconds for scenarios played 10-20x faster (the defaults are 5m / 1h / 1d,
# keep_firing_for 10m, the slower per-caller groups every minute or two: every second here).
E2E_RULES = {
    "short_window": "15s",
    "long_window": "2m",
    "baseline_window": "10m",
    "caller_interval": "1s",
    "caller_detail_interval": "1s",
    "caller_long_interval": "1s",
    "collapse_for": "10s",
    "collapse_keep_firing_for": "30s",
    "warm_ttft_for": "10s",
    "warm_ttft_keep_firing_for": "30s",
    "extra_group_labels": ["instance"],
}
COLLAPSE, FIT = "two-agents-collapse", "two-agents-fit"
SPEED = {COLLAPSE: 20, FIT: 10}  # each scenario's own demo speed
RATE_INTERVAL = "1m"
# Series that only have samples in bursts. In two-agents-collapse the only reuse gaps vLLM
# reports come when agent-a's own prefix, hit every turn until agent-b arrived, is evicted in
# one burst (tests/sim/test_residency.py); after that no evicted block was ever reused. A
# dashboard over the run's time range shows the burst, so for these the test asks the same:
# data somewhere since the drivers started, not necessarily now.
BURSTS = ("vllm_cache_engine_kv_block_reuse_gap_seconds",)
PAGE_DEADLINE = 120.0  # seconds from the drivers' start
JOB = "vllm-cache-exporter"
# LiteLLM 1.108.7's generic_api batch, recorded in front of an upstream answering as vLLM does
# with --enable-per-request-metrics (tests/fixtures/litellm/README.md): caller "stub-caller".
LITELLM_BATCH = ROOT / "tests" / "fixtures" / "litellm" / "1.108.7" / "vllm-metrics.ndjson"
LITELLM_CALLER = "stub-caller"
TIMING_PANELS = ("Admission queue wait", "Time to first token by state")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- processes ------------------------------------------------------------------------------


@dataclass
class Processes:
    workdir: Path
    started: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                list(args),
                stdout=handle,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,
            )
        self.started.append((name, process, log))
        return process

    def stop_all(self) -> None:
        for _name, process, _log in reversed(self.started):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for _name, process, _log in reversed(self.started):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)

    def logs(self) -> str:
        parts = []
        for name, _process, log in self.started:
            lines = log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {name} (last lines) ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def assert_alive(self) -> None:
        for name, process, _log in self.started:
            if process.poll() is not None and not name.startswith("driver"):
                raise AssertionError(f"{name} exited with {process.returncode}\n{self.logs()}")


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


def exporter_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "exporter", *args]


# --- the webhook receiver -------------------------------------------------------------------


@dataclass
class Receiver:
    notifications: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        self.notifications.append((request.path, await request.json()))
        self.arrived.set()
        return web.Response(text="ok")

    def alerts(self, path: str | None = None) -> list[dict[str, Any]]:
        return [
            alert
            for where, body in self.notifications
            if path in (None, where)
            for alert in body["alerts"]
        ]

    async def wait_for(self, predicate, deadline: float) -> dict[str, Any]:  # type: ignore[no-untyped-def]
        loop = asyncio.get_running_loop()
        while True:
            for alert in self.alerts():
                if predicate(alert):
                    return alert
            self.arrived.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                pass


@pytest.fixture
async def receiver(aiohttp_server) -> AsyncIterator[tuple[Receiver, str]]:  # type: ignore[no-untyped-def]
    hook = Receiver()
    app = web.Application()
    app.router.add_post("/{tail:.*}", hook.handle)
    server = await aiohttp_server(app, host="127.0.0.1")
    yield hook, f"127.0.0.1:{server.port}"


# --- configs: the committed files, addresses and intervals rewritten -------------------------


def prometheus_config(exporters: list[str], alertmanager: str) -> dict[str, Any]:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text("utf-8"))
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    jobs = [job for job in config["scrape_configs"] if job["job_name"] == JOB]
    assert len(jobs) == 1, "deploy/prometheus.yml must scrape the exporter as job " + JOB
    jobs[0]["static_configs"] = [{"targets": exporters}]
    config["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [alertmanager]}]
    return config


def alertmanager_config(receiver: str) -> dict[str, Any]:
    config = yaml.safe_load((ROOT / "deploy" / "alertmanager.yml").read_text("utf-8"))
    config["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1h")
    rewritten = 0
    for item in config["receivers"]:
        for hook in item.get("webhook_configs", []):
            parts = urlsplit(hook["url"])
            hook["url"] = urlunsplit(("http", receiver, parts.path, "", ""))
            rewritten += 1
    assert rewritten >= 2
    return config


def write_rules_and_dashboards(workdir: Path) -> dict[str, str]:
    files = prometheus_files(config_from_mapping(E2E_RULES, source="e2e"))
    for relative, content in files.items():
        path = workdir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    return files


# --- HTTP helpers ---------------------------------------------------------------------------


async def wait_http_ok(
    session: aiohttp.ClientSession, url: str, processes: Processes, timeout: float = 60.0
) -> None:
    """No event crosses a process boundary: poll readiness with a deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            async with session.get(url) as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        processes.assert_alive()
        if loop.time() > deadline:
            raise AssertionError(f"{url} not ready after {timeout}s\n{processes.logs()}")
        await asyncio.sleep(0.2)


async def instant_query(
    session: aiohttp.ClientSession, prometheus: str, expr: str
) -> list[dict[str, Any]]:
    async with session.post(f"http://{prometheus}/api/v1/query", data={"query": expr}) as resp:
        body = await resp.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


async def poll_until(
    session: aiohttp.ClientSession,
    prometheus: str,
    processes: Processes,
    expr: str,
    present: bool = True,
    timeout: float = 60.0,
) -> None:
    """Wait until ``expr`` has (or no longer has) a result: Prometheus offers no event."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while bool(await instant_query(session, prometheus, expr)) != present:
        processes.assert_alive()
        assert loop.time() < deadline, f"timed out waiting for {expr}\n{processes.logs()}"
        await asyncio.sleep(0.5)


def substitute(expr: str) -> str:
    """What Grafana sends for the dashboards' variables with "All" selected."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    assert "${datasource}" not in expr
    variables = "|".join(("job", "target", "model", "caller", *MonitoringConfig().topology_labels))
    expr = re.sub(rf"\$\{{?({variables})\}}?", ".*", expr)
    assert "$" not in expr, expr
    return expr


def finite(results: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(item["value"][1])) for item in results)


# --- the test -------------------------------------------------------------------------------


async def test_collapse_pages_fit_does_not_and_every_dashboard_query_has_data(
    tmp_path: Path, processes: Processes, receiver: tuple[Receiver, str]
) -> None:
    prometheus_bin = require_tool("prometheus")
    alertmanager_bin = require_tool("prometheus-alertmanager", "alertmanager")
    hook, hook_address = receiver
    ports = {
        name: free_port()
        for name in (
            "prometheus",
            "alertmanager",
            "sim-collapse",
            "sim-fit",
            "exp-collapse",
            "exp-fit",
            "tap-fit",
            "tap-collapse",
        )
    }
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}

    files = write_rules_and_dashboards(tmp_path)
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            prometheus_config([addr["exp-collapse"], addr["exp-fit"]], addr["alertmanager"])
        ),
        "utf-8",
    )
    (tmp_path / "alertmanager.yml").write_text(
        yaml.safe_dump(alertmanager_config(hook_address)), "utf-8"
    )

    processes.start(
        "alertmanager",
        alertmanager_bin,
        f"--config.file={tmp_path / 'alertmanager.yml'}",
        f"--storage.path={tmp_path / 'am-data'}",
        f"--web.listen-address={addr['alertmanager']}",
        "--cluster.listen-address=",
    )  # no gossip port: a single instance
    processes.start(
        "prometheus",
        prometheus_bin,
        f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'prom-data'}",
        f"--web.listen-address={addr['prometheus']}",
    )
    for scenario, key in ((COLLAPSE, "collapse"), (FIT, "fit")):
        processes.start(
            f"simulator-{key}",
            *exporter_command(
                "simulate",
                "--scenario",
                scenario,
                "--sim.listen-address",
                addr[f"sim-{key}"],
                "--speed",
                str(SPEED[scenario]),
                "--log.level",
                "warning",
            ),
        )
        # The fit's exporter is a tap deployment: its clients go through the tap. The
        # collapse's runs one too, for the stamped fan-out only.
        tap = [
            "--tap.listen-address",
            addr[f"tap-{key}"],
            "--tap.upstream",
            f"http://{addr[f'sim-{key}']}",
        ]
        processes.start(
            f"exporter-{key}",
            *exporter_command(
                "run",
                "--vllm.url",
                f"http://{addr[f'sim-{key}']}",
                "--web.listen-address",
                addr[f"exp-{key}"],
                "--log.level",
                "warning",
                *tap,
            ),
        )

    target = {key: f"http://{addr[f'sim-{key}']}/metrics" for key in ("collapse", "fit")}
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        await wait_http_ok(session, f"http://{addr['alertmanager']}/-/ready", processes)
        await wait_http_ok(session, f"http://{addr['prometheus']}/-/ready", processes)
        for key in ("collapse", "fit"):
            await wait_http_ok(session, f"http://{addr[f'exp-{key}']}/-/ready", processes)
        # Both exporters are scraped, and the rules evaluated, before any traffic starts.
        await poll_until(
            session, addr["prometheus"], processes, f'count(up{{job="{JOB}"}} == 1) == 2'
        )
        await poll_until(
            session,
            addr["prometheus"],
            processes,
            "count(target_model:vllm_cache_engine_kv_used:ratio) == 2",
        )

        drivers = {}
        # The collapse's driver reports each request itself (with the metrics vLLM sent), as
        # a proxy of one's own would; the fit's goes through the tap, which records them.
        drivers["collapse"] = processes.start(
            "driver-collapse",
            *exporter_command(
                "drive",
                "--scenario",
                COLLAPSE,
                "--drive.base-url",
                f"http://{addr['sim-collapse']}",
                "--drive.exporter-url",
                f"http://{addr['exp-collapse']}",
                "--speed",
                str(SPEED[COLLAPSE]),
                "--seed",
                "5",
                "--log.level",
                "warning",
            ),
        )
        drivers["fit"] = processes.start(
            "driver-fit",
            *exporter_command(
                "drive",
                "--scenario",
                FIT,
                "--drive.base-url",
                f"http://{addr['tap-fit']}",
                "--speed",
                str(SPEED[FIT]),
                "--seed",
                "5",
                "--log.level",
                "warning",
            ),
        )
        started = loop.time()
        await post_gated_turn(session, addr["exp-collapse"])
        await post_litellm_batch(session, addr["exp-collapse"])
        await post_stamped_fanout(session, addr["tap-collapse"], 0)

        # 0. A tap deployment's timing panels, while the fit's turns go through the tap (they
        # are over before the collapse pages).
        await check_timing_panels(
            session,
            addr["prometheus"],
            processes,
            files,
            "agent-a|agent-b",
            f'instance="{addr["exp-fit"]}"',
        )

        # 1. The collapse pages: delivered by Alertmanager on the critical route.
        def collapse_page(alert: dict[str, Any]) -> bool:
            labels = alert["labels"]
            return (
                alert["status"] == "firing"
                and labels["alertname"] == "VllmCachePrefixCollapse"
                and labels.get("scope") == "engine"
                and labels["target"] == target["collapse"]
            )

        try:
            page = await hook.wait_for(collapse_page, started + PAGE_DEADLINE)
        except TimeoutError:
            raise AssertionError(
                f"no VllmCachePrefixCollapse page within {PAGE_DEADLINE}s; received "
                f"{json.dumps(hook.notifications)[:2000]}\n{processes.logs()}"
            ) from None
        paged_after = loop.time() - started

        # ...and per caller: agent-a, whose warm baseline was lost. agent-b arrived into the
        # collapse and never had a cache to lose, so it never pages.
        def caller_page(alert: dict[str, Any]) -> bool:
            labels = alert["labels"]
            return (
                alert["status"] == "firing"
                and labels.get("scope") == "caller"
                and labels["alertname"] == "VllmCachePrefixCollapse"
                and labels["instance"] == addr["exp-collapse"]
            )

        try:
            caller = await hook.wait_for(caller_page, started + PAGE_DEADLINE)
        except TimeoutError:
            raise AssertionError(f"no per-caller page: {hook.notifications}") from None
        assert caller["labels"]["caller"] == "agent-a", caller
        assert caller in hook.alerts("/page")
        assert page["labels"]["severity"] == "critical"
        assert page["labels"]["model_name"] == "qwen3.8-27b"
        assert page in hook.alerts("/page"), "critical alert not routed to the page receiver"
        description = page["annotations"]["description"]
        assert description.startswith(f"vLLM {target['collapse']} (qwen3.8-27b) served ")
        assert " over the last 15s (" in description, description
        assert " over the last 2m), against its baseline of " in description, description
        assert " (over the last 10m), while still looking up " in description, description
        assert page["annotations"]["runbook_url"].endswith("#vllmcacheprefixcollapse")

        # 2. Every dashboard query returns data from this Prometheus, while traffic flows.
        # A gated caller's records carry the admission proxy's own queue wait
        # (source="proxy"), LiteLLM's the one vLLM measured: one record of each before the
        # page, one now, so that rate() sees the counters move.
        await post_gated_turn(session, addr["exp-collapse"])
        await post_litellm_batch(session, addr["exp-collapse"])
        await post_stamped_fanout(session, addr["tap-collapse"], 1)
        for caller, source in (("gated-agent", "proxy"), (LITELLM_CALLER, "engine")):
            await poll_until(
                session,
                addr["prometheus"],
                processes,
                (
                    f'sum(rate(vllm_cache_queue_wait_seconds_count{{caller="{caller}", '
                    f'source="{source}"}}[1m])) > 0'
                ),
            )
        await poll_until(
            session,
            addr["prometheus"],
            processes,
            (
                f'sum(rate(vllm_cache_prompt_order_variable_top_total{{caller="{STAMPED_CALLER}"}}'
                f"[1m])) > 0"
            ),
        )
        run_seconds = math.ceil(loop.time() - started) + 5
        await check_dashboards(session, addr["prometheus"], files, run_seconds)
        for callers in (LITELLM_CALLER, "agent-a|agent-b"):
            await check_timing_panels(
                session,
                addr["prometheus"],
                processes,
                files,
                callers,
                f'instance="{addr["exp-collapse"]}"',
            )

        # 3. Every recorded series is what its expression gives on the raw samples.
        await check_recording_rules(
            session, addr["prometheus"], files, math.ceil(loop.time() - started) + 5
        )

        # 4. The healthy scenario ran its course without a page.
        while drivers["fit"].poll() is None:
            processes.assert_alive()
            assert loop.time() - started < PAGE_DEADLINE + 60, processes.logs()
            await asyncio.sleep(0.5)
        assert drivers["fit"].returncode == 0, processes.logs()
        # Once the fit's traffic has left the short window nothing more can fire for it:
        # Prometheus' ALERTS history (pending included) then covers its whole run.
        await poll_until(
            session,
            addr["prometheus"],
            processes,
            (
                f"target_model:vllm_cache_engine_prefix_cache_queries_tokens:rate15s{{"
                f'target="{target["fit"]}"}} > 0'
            ),
            present=False,
        )
        fit_pages = [
            a
            for a in hook.alerts()
            if a["labels"].get("severity") == "critical"
            and (
                a["labels"].get("target") == target["fit"]
                or a["labels"].get("instance") == addr["exp-fit"]
            )
        ]
        assert fit_pages == [], fit_pages
        assert [
            a
            for a in hook.alerts()
            if a["labels"].get("caller") == "agent-b" and a["labels"].get("severity") == "critical"
        ] == []
        # Not even pending in Prometheus at any point.
        fit_alerts = await instant_query(
            session,
            addr["prometheus"],
            f'max_over_time(ALERTS{{severity="critical", '
            f'instance="{addr["exp-fit"]}"}}[5m]) or max_over_time('
            f'ALERTS{{severity="critical", target="{target["fit"]}"}}'
            f"[5m])",
        )
        assert fit_alerts == [], fit_alerts
        # The fit scenario really was healthy and really was seen: warm, high hit ratio.
        fit_ratio = await instant_query(
            session,
            addr["prometheus"],
            (
                f"max_over_time(target_model:vllm_cache_engine_hit_ratio:rate2m{{"
                f'target="{target["fit"]}"}}[5m])'
            ),
        )
        assert fit_ratio and float(fit_ratio[0]["value"][1]) > 0.6, fit_ratio
    print(f"collapse paged {paged_after:.1f}s after the drivers started")


async def query_at(
    session: aiohttp.ClientSession, prometheus: str, expr: str, time: float
) -> list[dict[str, Any]]:
    async with session.post(
        f"http://{prometheus}/api/v1/query", data={"query": expr, "time": repr(time)}
    ) as response:
        body = await response.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def by_labels(results: list[dict[str, Any]]) -> dict[frozenset[tuple[str, str]], float]:
    return {
        frozenset((k, v) for k, v in item["metric"].items() if k != "__name__"): float(
            item["value"][1]
        )
        for item in results
    }


# After a scrape's request ends, Prometheus still parses and appends its samples.
APPEND_SECONDS = 0.05


async def check_recording_rules(
    session: aiohttp.ClientSession, prometheus: str, files: dict[str, str], run_seconds: int
) -> None:
    """Recompute every recording rule from the raw scraped samples, at instants Prometheus
    evaluated it (seconds ago, so that every scrape of those instants has landed), and
    compare: the recorded series and the expression agree to 1e-9, label set by label set.


    A scrape is stamped with the time it started, so an evaluation that began while a scrape
    was in flight could not see that scrape's samples, which are older than it: its recorded
    value may differ from the recomputation, which sees them. Prometheus scrapes and
    evaluates at fixed phases, so when a rule group's phase falls inside one target's scrape
    duration, every instant of that group differs so. Such instants are told apart by the
    scrapes' own `scrape_duration_seconds` (plus 50 ms for the append) and excused when they
    differ. Each rule is checked at its last twenty instants: it must agree exactly at three
    or more of them (or all the instants no scrape was in flight for, if fewer), and at most
    of the instants no scrape was in flight for (a scrape's append can outlast the margin on
    a loaded machine): a wrong expression agrees at none. A rule over a series that only
    comes in bursts is checked at its last recorded instants since the drivers started."""
    groups = yaml.safe_load(files["alerts/vllm-cache-rules.yaml"])["groups"]
    scrapes = await instant_query(
        session, prometheus, f'scrape_duration_seconds{{job="{JOB}"}}[{run_seconds + 60}s]'
    )
    in_flight = [
        (float(start), float(start) + float(seconds) + APPEND_SECONDS)
        for series in scrapes
        for start, seconds in series["values"]
    ]
    checked = 0
    for group in groups:
        for rule in group["rules"]:
            lookback = run_seconds if any(burst in rule["expr"] for burst in BURSTS) else 60
            raw = await instant_query(
                session, prometheus, f"{rule['record']}[{lookback}s] offset 5s"
            )
            stamps = sorted({float(time) for series in raw for time, _ in series["values"]})
            if not stamps:
                continue  # nothing recorded yet (e.g. a baseline over a longer window)
            agreed, clear, agreed_clear, differences = 0, 0, 0, []
            for stamp in stamps[-20:]:
                recorded = by_labels(await query_at(session, prometheus, rule["record"], stamp))
                computed = by_labels(await query_at(session, prometheus, rule["expr"], stamp))
                difference = recording_difference(recorded, computed)
                excused = any(start <= stamp < end for start, end in in_flight)
                clear += not excused
                if difference is None:
                    agreed += 1
                    agreed_clear += not excused
                elif not excused:
                    differences.append((stamp, difference))
            assert agreed >= min(3, clear) and agreed_clear * 2 > clear - (clear == 0), (
                rule["record"],
                f"agreed at {agreed} of {min(len(stamps), 20)} instants, "
                f"{agreed_clear} of the {clear} with no scrape in flight",
                differences,
            )
            checked += agreed
    rule_count = sum(len(group["rules"]) for group in groups)
    assert checked >= 3 * (rule_count - 3), f"only {checked} checks for {rule_count} rules"


def recording_difference(recorded: dict, computed: dict) -> object:
    """None when a recorded instant equals its recomputation, else what differs."""
    if recorded.keys() != computed.keys():
        return {
            "only recorded": [dict(k) for k in recorded.keys() - computed.keys()],
            "only computed": [dict(k) for k in computed.keys() - recorded.keys()],
        }
    for labels, value in recorded.items():
        expected = computed[labels]
        if value != pytest.approx(expected, rel=1e-9, abs=1e-12):
            return (dict(labels), value, expected)
    return None


async def post_gated_turn(session: aiohttp.ClientSession, exporter: str) -> None:
    """One usage record as an admission-gating proxy would POST it."""
    async with session.post(
        f"http://{exporter}/v1/usage",
        json={
            "caller": "gated-agent",
            "model": "qwen3.8-27b",
            "prompt_tokens": 4096,
            "cached_tokens": 2048,
            "ttft_seconds": 3.5,
            "queue_seconds": 1.2,
        },
    ) as response:
        assert response.status < 300, await response.text()


STAMPED_CALLER = "stamped-fanout"
STAMPED_SHARED = " ".join(
    f"Evidence {line}: the ledger of account {line * 37} balances." for line in range(48)
)


async def post_stamped_fanout(session: aiohttp.ClientSession, tap: str, round_: int) -> None:
    """A four-agent fan-out as an OpenAI client sends it, the same shared text behind a
    timestamp at the top (a new one for every request): each request after the first shares
    its text with an earlier one but not its beginning. One after the other, so that each is
    compared."""
    for agent in range(4):
        body = {
            "model": "qwen3.8-27b",
            "max_tokens": 4,
            "messages": [
                {
                    "role": "system",
                    "content": (
                        f"Current time: 2026-11-30T15:{round_:02d}:0{agent}Z\n{STAMPED_SHARED}"
                    ),
                },
                {"role": "user", "content": f"Agent {agent}: summarise the evidence."},
            ],
        }
        async with session.post(
            f"http://{tap}/v1/chat/completions", json=body, headers={"X-Caller": STAMPED_CALLER}
        ) as response:
            assert response.status == 200, await response.text()
            await response.read()


def litellm_batch() -> bytes:
    """LiteLLM's recorded batch, NDJSON as its generic_api callback posts it: a whole answer
    that kept vLLM's metrics (engine TTFT and queue wait) and a streamed one timed by LiteLLM.
    Recorded on a 100-token prompt, which is `short` against the scenario model's 2,048-token
    granules: the counts are scaled to a warm 4,096-token turn, nothing else changes."""
    payloads = [json.loads(line) for line in LITELLM_BATCH.read_text("utf-8").splitlines()]
    for payload in payloads:
        assert payload["prompt_tokens"] == 100
        payload["prompt_tokens"] = 4096
        for usage in (payload["metadata"]["usage_object"], payload["response"]["usage"]):
            usage["prompt_tokens"] = 4096
            usage["prompt_tokens_details"]["cached_tokens"] = 2048
    return "\n".join(json.dumps(payload) for payload in payloads).encode()


async def post_litellm_batch(session: aiohttp.ClientSession, exporter: str) -> None:
    async with session.post(
        f"http://{exporter}/v1/usage?format=litellm",
        data=litellm_batch(),
        headers={"Content-Type": "application/json"},
    ) as response:
        reply = await response.json()
        assert response.status == 200 and reply["accepted"] == 2, reply


async def check_timing_panels(
    session: aiohttp.ClientSession,
    prometheus: str,
    processes: Processes,
    files: dict[str, str],
    callers: str,
    matcher: str,
    timeout: float = 60.0,
) -> None:
    """The caller dashboard's queue-wait and TTFT panels, for one deployment's callers (the
    caller variable set to them, plus a matcher that picks the deployment), show vLLM's own
    figures: every target has a finite series with source="engine". Polled: each needs two
    turns of its kind in the window before rate() moves."""
    dashboard = json.loads(files["dashboards/vllm-cache-caller.json"])
    panels = [panel for panel in dashboard["panels"] if panel["title"] in TIMING_PANELS]
    assert len(panels) == len(TIMING_PANELS)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for panel in panels:
        for target in panel["targets"]:
            assert 'caller=~"$caller"' in target["expr"]
            expr = substitute(
                target["expr"].replace('caller=~"$caller"', f'caller=~"{callers}", {matcher}')
            )
            while True:
                results = await instant_query(session, prometheus, expr)
                engine = [item for item in results if item["metric"].get("source") == "engine"]
                if finite(engine):
                    break
                processes.assert_alive()
                assert loop.time() < deadline, (panel["title"], callers, matcher, results)
                await asyncio.sleep(0.5)


async def range_has_data(
    session: aiohttp.ClientSession, prometheus: str, expr: str, seconds: int
) -> bool:
    """Whether a panel of non-negative values over the last ``seconds`` would draw anything,
    as Grafana asks (NaN, a quantile without observations, is nothing)."""
    async with session.post(
        f"http://{prometheus}/api/v1/query",
        data={"query": f"count_over_time((({expr}) >= 0)[{seconds}s:1s])"},
    ) as response:
        body = await response.json()
    assert body["status"] == "success", (expr, body)
    return bool(body["data"]["result"])


async def check_dashboards(
    session: aiohttp.ClientSession, prometheus: str, files: dict[str, str], run_seconds: int
) -> None:
    default_files = prometheus_files(config_from_mapping({}))
    checked = 0
    for relative, content in files.items():
        if not relative.startswith("dashboards/"):
            continue
        dashboard = json.loads(content)
        # The same dashboards as committed, but for the recorded rules' window names.
        committed = json.loads((DASHBOARD_DIR / Path(relative).name).read_text("utf-8"))
        assert committed == json.loads(default_files[relative])
        assert [len(p.get("targets", [])) for p in dashboard["panels"]] == [
            len(p.get("targets", [])) for p in committed["panels"]
        ]
        empty = []
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = substitute(target["expr"])
                checked += 1
                if any(burst in expr for burst in BURSTS):
                    assert panel["type"] == "timeseries", panel["title"]
                    if await range_has_data(session, prometheus, expr, run_seconds):
                        continue
                elif finite(await instant_query(session, prometheus, expr)):
                    continue
                empty.append(f"{dashboard['title']} / {panel['title']}: {expr}")
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((.*), *(\w+)\)", variable["query"])
            expr = (
                f"group by ({match.group(2)}) ({match.group(1)})"
                if match
                else re.fullmatch(r"query_result\((.*)\)", variable["query"]).group(1)
            )
            if not await instant_query(session, prometheus, substitute(expr)):
                empty.append(f"{dashboard['title']} / variable {variable['name']}: {expr}")
        assert empty == [], "dashboard queries without data:\n" + "\n".join(empty)
    assert checked > 40
