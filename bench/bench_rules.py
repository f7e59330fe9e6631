"""A real Prometheus evaluating the shipped recording and alert rules at a platform's scale.

    python bench/bench_rules.py [--callers 10000] [--models 3] [--detailed 100]
                                [--minutes 8] [--rules-dir DIR] [--json PATH]

The rules must cost Prometheus a small fraction of their interval however many callers an
exporter holds (issue 32). This starts a synthetic target with the exposition the exporter
serves at that scale and Debian's Prometheus (2.42, ``prometheus`` on PATH) scraping it as
deploy/prometheus.yml says (every 15 s, rules every 15 s unless a group sets its own
interval), with the rule files of ``--rules-dir`` (default: the checkout's ``alerts/``, as
``vllm-cache-exporter generate`` writes them). After ``--minutes`` it reports, per rule
group, the median and max evaluation time over the run and as a share of the group's
interval, and the slowest rules; and Prometheus' RSS.

The target's shape, per (caller, model) pair, for every caller: the nine counters
``vllm_cache_requests_total`` (six states), ``vllm_cache_prompt_tokens_total``,
``vllm_cache_cached_tokens_total`` and ``vllm_cache_unreported_prompt_tokens_total``. The
costly families (TTFT by state and source, queue wait, completion tokens, prompt order)
exist per caller only for ``--detailed`` callers, and for every other caller summed under
``caller="__other__"`` per model. Per model, two vLLM targets with every engine family a rule
reads, and the per-model foresight counters. Every counter grows every scrape, at a rate of
its own (callers' request rates are log-normal around ``--mean-rate`` requests/s).

A run reads at most ``--minutes`` of data: a rule over a longer window (the 1h rates, the 1d
baseline) reads what there is. The report says how many samples a long-window rule reads at
full window, per evaluation (``samples_at_full_window``: series x window / the interval they
are recorded or scraped at), beside what it cost over the data it had.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
JOB = "vllm-cache-exporter"
STATES = ("warm", "partial", "cold", "short", "unknown", "error")
STATE_SHARES = (0.6, 0.15, 0.1, 0.05, 0.05, 0.05)
TIMED = ("warm", "partial", "cold")
SOURCES = ("engine", "proxy")
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
COMPLETION_BUCKETS = (64, 128, 256, 512, 768, 1024, 1536, 2048, 4096, 8192, 16384, 32768, 65536)
RESIDENCY_BUCKETS = (0.01, 0.1, 1.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
REQUIRED_SIGNALS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "preemptions",
    "kv_cache_usage",
    "requests_running",
    "requests_waiting",
    "cache_config_info",
)
TARGETS_PER_MODEL = 2
OTHER = "__other__"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- the synthetic target -----------------------------------------------------------------


class Exposition:
    """Every series as a fixed ``name{labels} `` prefix and a rate per second: a counter's
    value at time t is floor(rate * (t - start)), a gauge's is its rate. Histogram buckets are
    the count's rate times the CDF at their bound, so they stay cumulative."""

    def __init__(self, callers: int, models: int, detailed: int, mean_rate: float) -> None:
        self.random = random.Random(32)
        self.prefixes: list[str] = []
        self.rates: list[float] = []
        self.gauges: set[int] = set()
        self.help: list[str] = []
        model_names = [f"model-{index}" for index in range(models)]
        caller_names = [f"caller-{index:05d}" for index in range(callers)]
        pairs = [(caller, model) for model in model_names for caller in caller_names]
        rate = {pair: self.random.lognormvariate(0, 1) * mean_rate / 1.65 for pair in pairs}
        self._per_pair_counters(pairs, rate)
        detail = [(caller, model) for model in model_names for caller in caller_names[:detailed]]
        for model in model_names:
            others = sum(rate[(caller, model)] for caller in caller_names[detailed:])
            rate[(OTHER, model)] = others
            detail.append((OTHER, model))
        self._detailed(detail, rate)
        self._engines(
            model_names, {m: sum(rate[(c, m)] for c in caller_names) for m in model_names}
        )
        self.start = time.time()

    def add(self, name: str, labels: dict[str, str], rate: float, gauge: bool = False) -> None:
        text = ",".join(f'{key}="{value}"' for key, value in labels.items())
        if gauge:
            self.gauges.add(len(self.prefixes))
        self.prefixes.append(f"{name}{{{text}}} ")
        self.rates.append(rate)

    def histogram(
        self,
        name: str,
        labels: dict[str, str],
        count_rate: float,
        bounds: tuple[float, ...],
        median: float,
    ) -> None:
        for bound in bounds:
            cdf = bound / (bound + median)  # a log-logistic shape: half below the median
            self.add(f"{name}_bucket", {**labels, "le": repr(float(bound))}, count_rate * cdf)
        self.add(f"{name}_bucket", {**labels, "le": "+Inf"}, count_rate)
        self.add(f"{name}_count", labels, count_rate)
        self.add(f"{name}_sum", labels, count_rate * median * 1.5)

    def _per_pair_counters(self, pairs: list[tuple[str, str]], rate: dict[Any, float]) -> None:
        for caller, model in pairs:
            labels = {"caller": caller, "model": model}
            requests = rate[(caller, model)]
            for state, share in zip(STATES, STATE_SHARES, strict=True):
                self.add("vllm_cache_requests_total", {**labels, "state": state}, requests * share)
            prompt = requests * 20_000 * self.random.uniform(0.5, 1.5)
            self.add("vllm_cache_prompt_tokens_total", labels, prompt * 0.85)
            self.add("vllm_cache_cached_tokens_total", labels, prompt * 0.85 * self.random.random())
            self.add("vllm_cache_unreported_prompt_tokens_total", labels, prompt * 0.05)

    def _detailed(self, pairs: list[tuple[str, str]], rate: dict[Any, float]) -> None:
        for caller, model in pairs:
            labels = {"caller": caller, "model": model}
            requests = rate[(caller, model)]
            for state, share in zip(TIMED, STATE_SHARES, strict=False):
                for source in SOURCES:
                    median = {"warm": 0.8, "partial": 3.0, "cold": 20.0}[state]
                    self.histogram(
                        "vllm_cache_ttft_seconds",
                        {**labels, "state": state, "source": source},
                        requests * share,
                        TTFT_BUCKETS,
                        median,
                    )
            for source in SOURCES:
                self.histogram(
                    "vllm_cache_queue_wait_seconds",
                    {**labels, "source": source},
                    requests,
                    QUEUE_BUCKETS,
                    0.2,
                )
            self.histogram(
                "vllm_cache_completion_used_tokens", labels, requests * 0.7, COMPLETION_BUCKETS, 400
            )
            self.add("vllm_cache_completion_declared_tokens_total", labels, requests * 0.7 * 4096)
            self.add("vllm_cache_prompt_order_compared_total", labels, requests * 0.9)
            self.add("vllm_cache_prompt_order_variable_top_total", labels, requests * 0.1)
            self.add("vllm_cache_prompt_order_shared_bytes_total", labels, requests * 0.1 * 9e4)
            self.add("vllm_cache_prompt_order_first_difference_bytes_total", labels, requests * 9)

    def _engines(self, models: list[str], traffic: dict[str, float]) -> None:
        for model in models:
            requests = traffic[model]
            self.add("vllm_cache_conversations_active", {"model": model}, 40, gauge=True)
            self.add("vllm_cache_conversations_demand_tokens", {"model": model}, 9e5, gauge=True)
            self.add("vllm_cache_conversation_turns_total", {"model": model}, requests * 0.9)
            self.add("vllm_cache_unseen_history_requests_total", {"model": model}, requests * 0.01)
            for index in range(TARGETS_PER_MODEL):
                target = f"http://vllm-{model}-{index}:8000"
                row = {"target": target, "model_name": model, "engine": "0"}
                share = requests / TARGETS_PER_MODEL
                self.add("vllm_cache_engine_up", {"target": target}, 1, gauge=True)
                for signal in REQUIRED_SIGNALS:
                    self.add(
                        "vllm_cache_engine_metric_present",
                        {"target": target, "signal": signal},
                        1,
                        gauge=True,
                    )
                gauges = {
                    "vllm_cache_engine_prefix_caching_enabled": 1,
                    "vllm_cache_engine_block_size_tokens": 16,
                    "vllm_cache_engine_kv_pool_tokens": 1e6,
                    "vllm_cache_engine_kv_usage_ratio": 0.7,
                    "vllm_cache_engine_kv_used_tokens": 7e5,
                    "vllm_cache_engine_requests_running": 30,
                    "vllm_cache_engine_requests_waiting": 2,
                    "vllm_cache_engine_kv_pool_min_tokens": 1e6,
                    "vllm_cache_engine_admission_budget_tokens": 9.5e5,
                    "vllm_cache_engine_conversations_active": 20,
                    "vllm_cache_engine_conversations_demand_tokens": 4.5e5,
                }
                for name, value in gauges.items():
                    self.add(name, row, value, gauge=True)
                self.add("vllm_cache_engine_prefix_cache_queries_tokens_total", row, share * 2e4)
                self.add("vllm_cache_engine_prefix_cache_hits_tokens_total", row, share * 1.4e4)
                self.add("vllm_cache_engine_preemptions_total", row, share * 0.001)
                self.add("vllm_cache_engine_prompt_tokens_total", row, share * 2e4)
                for source, part in (
                    ("local_compute", 0.3),
                    ("local_cache_hit", 0.65),
                    ("external_kv_transfer", 0.05),
                ):
                    self.add(
                        "vllm_cache_engine_prompt_tokens_by_source_total",
                        {**row, "source": source},
                        share * 2e4 * part,
                    )
                    if source != "local_compute":
                        self.add(
                            "vllm_cache_engine_prompt_tokens_cached_by_source_total",
                            {**row, "source": source},
                            share * 2e4 * part,
                        )
                for histogram, median in (
                    ("lifetime", 120.0),
                    ("idle_before_evict", 60.0),
                    ("reuse_gap", 20.0),
                ):
                    self.histogram(
                        f"vllm_cache_engine_kv_block_{histogram}_seconds",
                        row,
                        share * 0.5,
                        RESIDENCY_BUCKETS,
                        median,
                    )
                for histogram in ("request_queue_time", "request_prefill_time"):
                    self.histogram(
                        f"vllm_cache_engine_{histogram}_seconds", row, share, TTFT_BUCKETS, 0.5
                    )

    def body(self) -> bytes:
        elapsed = time.time() - self.start + 3600.0  # counters as if an hour old
        gauges = self.gauges
        lines = [
            f"{prefix}{rate:g}" if index in gauges else f"{prefix}{int(rate * elapsed)}"
            for index, (prefix, rate) in enumerate(zip(self.prefixes, self.rates, strict=True))
        ]
        lines.append("")
        return "\n".join(lines).encode()


def serve(port: int, callers: int, models: int, detailed: int, mean_rate: float) -> None:
    exposition = Exposition(callers, models, detailed, mean_rate)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = exposition.body()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return

    print(f"serving {len(exposition.prefixes)} series", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


# --- Prometheus ---------------------------------------------------------------------------


def prometheus_yaml(target: str, rule_files: list[str], interval: str) -> dict[str, Any]:
    """deploy/prometheus.yml with only the exporter's job, pointed at the synthetic target,
    and without Alertmanager (alerts are still evaluated)."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text("utf-8"))
    config["global"]["scrape_interval"] = interval
    config["global"]["evaluation_interval"] = interval
    config["global"]["scrape_timeout"] = "10s"
    config["rule_files"] = rule_files
    config.pop("alerting", None)
    config["scrape_configs"] = [
        {"job_name": JOB, "static_configs": [{"targets": [target]}]},
    ]
    return config


def get_json(url: str, timeout: float = 60.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def instant(prometheus: str, expr: str) -> float | None:
    query = urllib.parse.urlencode({"query": expr})
    body = get_json(f"http://{prometheus}/api/v1/query?{query}")
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h|d|w)", duration))


def full_window_samples(
    prometheus: str, groups: list[dict[str, Any]], scrape: float
) -> dict[str, float]:
    """Per rule with a range over a stored series: series it reads x (window / the interval
    that series is written at), summed over its ranges, at the end of the run."""
    cadence: dict[str, float] = {}
    for group in groups:
        for rule in group["rules"]:
            if "name" in rule and rule.get("type") == "recording":
                cadence[rule["name"]] = group["interval"]
    found: dict[str, float] = {}
    selector = re.compile(
        r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\[(\d+[smhdw])(?::(\d+[a-z]+))?\]"
    )
    for group in groups:
        for rule in group["rules"]:
            total = 0.0
            for name, matchers, window, step in selector.findall(rule["query"]):
                count = instant(prometheus, f"count({name}{matchers})") or 0.0
                every = seconds(step) if step else cadence.get(name, scrape)
                total += count * seconds(window) / every
            if total:
                found[rule["name"]] = total
    return found


def wait_ready(prometheus: str, process: subprocess.Popen[bytes], workdir: Path) -> None:
    deadline = time.time() + 600  # a restart replays the WAL first
    while True:
        try:
            with urllib.request.urlopen(f"http://{prometheus}/-/ready", timeout=5):
                return
        except (OSError, ValueError):
            if time.time() > deadline or process.poll() is not None:
                sys.exit(f"Prometheus did not start: {workdir / 'prometheus.log'}")
            time.sleep(0.5)


def profile_cpu(report: dict[str, Any], prometheus: str, pid: int, passes: int = 3) -> None:
    """Each group's CPU cost, whatever else the machine runs: Prometheus restarted on the
    run's data with no target and no rules, each group's rules queried one after the other
    (as ``count(expr)``, at the run's last instant, every recorded series they read there),
    ``passes`` times, and the CPU its process spent read from /proc: the mean of a pass is
    one evaluation's CPU, the garbage collection the queries cause included (on a heap of
    millions of series, much of it). Not counted: writing the recorded samples."""
    at = str(report["end_time"])
    for group in report["groups"]:
        spent = {rule["name"]: 0.0 for rule in group["rules"]}
        for _ in range(passes):
            for rule in group["rules"]:
                before = cpu_seconds(pid)
                query = urllib.parse.urlencode({"query": f"count({rule['expr']})", "time": at})
                get_json(f"http://{prometheus}/api/v1/query?{query}", timeout=600)
                spent[rule["name"]] += cpu_seconds(pid) - before
        for rule in group["rules"]:
            rule["cpu_seconds"] = spent[rule["name"]] / passes
        group["cpu_seconds"] = sum(spent.values()) / passes
        group["cpu_share"] = group["cpu_seconds"] / group["interval_seconds"]
        costly = sorted(group["rules"], key=lambda rule: rule["cpu_seconds"], reverse=True)
        group["costliest_rules"] = [
            {"rule": rule["name"], "cpu_seconds": rule["cpu_seconds"]} for rule in costly[:5]
        ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    prometheus_bin = shutil.which("prometheus")
    if prometheus_bin is None:
        sys.exit("prometheus not on PATH (apt-get install prometheus)")
    rules_dir = Path(args.rules_dir).resolve()
    rule_files = sorted(str(path) for path in rules_dir.glob("*.yaml"))
    workdir = Path(tempfile.mkdtemp(prefix="bench-rules-"))
    target_port, prometheus_port = free_port(), free_port()
    prometheus = f"127.0.0.1:{prometheus_port}"
    config = prometheus_yaml(f"127.0.0.1:{target_port}", rule_files, args.interval)
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config), "utf-8")
    children: list[subprocess.Popen[bytes]] = []
    try:
        server = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve",
                str(target_port),
                "--callers",
                str(args.callers),
                "--models",
                str(args.models),
                "--detailed",
                str(args.detailed),
                "--mean-rate",
                str(args.mean_rate),
            ],
            stdout=subprocess.PIPE,
        )
        children.append(server)
        assert server.stdout is not None
        print(server.stdout.readline().decode().strip(), file=sys.stderr)
        log = (workdir / "prometheus.log").open("wb")
        command = [
            prometheus_bin,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address={prometheus}",
        ]
        prom = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        children.append(prom)
        wait_ready(prometheus, prom, workdir)
        report = measure(args, prometheus, prom.pid, workdir)
        if args.cpu_profile:
            server.terminate()
            prom.terminate()
            prom.wait(timeout=120)
            config.pop("scrape_configs")
            config["rule_files"] = []
            (workdir / "prometheus.yml").write_text(yaml.safe_dump(config), "utf-8")
            prom = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            children.append(prom)
            wait_ready(prometheus, prom, workdir)
            profile_cpu(report, prometheus, prom.pid)
        return report
    finally:
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept {workdir}", file=sys.stderr)


def measure(args: argparse.Namespace, prometheus: str, pid: int, workdir: Path) -> dict[str, Any]:
    start = time.time()
    end = start + args.minutes * 60
    evaluations: dict[str, dict[str, Any]] = {}  # group -> lastEvaluation -> record
    rule_times: dict[tuple[str, str], list[float]] = {}
    rss: list[int] = []
    loads: list[float] = []
    groups: list[dict[str, Any]] = []
    health: dict[str, str] = {}
    settle = start + args.warmup * 60
    while time.time() < end:
        groups = get_json(f"http://{prometheus}/api/v1/rules")["data"]["groups"]
        rss.append(rss_bytes(pid))
        loads.append(os.getloadavg()[0])
        for group in groups:
            stamp = group["lastEvaluation"]
            if stamp.startswith("0001") or time.time() < settle:
                continue
            seen = evaluations.setdefault(group["name"], {})
            if stamp in seen:
                continue
            seen[stamp] = group["evaluationTime"]
            for rule in group["rules"]:
                rule_times.setdefault((group["name"], rule["name"]), []).append(
                    rule["evaluationTime"]
                )
                if rule.get("health") == "err":
                    health[rule["name"]] = rule.get("lastError", "")
        print(
            f"  {time.time() - start:6.0f}s  RSS {rss[-1] / 2**20:7.0f} MiB  "
            + "  ".join(f"{g['name']}: {g['evaluationTime']:.3f}s" for g in groups),
            file=sys.stderr,
        )
        time.sleep(args.poll)
    scrape = instant(prometheus, f'scrape_samples_scraped{{job="{JOB}"}}')
    scrape_duration = instant(prometheus, f'scrape_duration_seconds{{job="{JOB}"}}')
    series = get_json(f"http://{prometheus}/api/v1/status/tsdb")["data"]["headStats"]["numSeries"]
    full = full_window_samples(prometheus, groups, seconds(args.interval))
    end_time = time.time()
    report: dict[str, Any] = {
        "end_time": end_time,
        "callers": args.callers,
        "models": args.models,
        "detailed": args.detailed,
        "minutes": args.minutes,
        "rules_dir": str(Path(args.rules_dir).resolve()),
        "scrape_samples": scrape,
        "scrape_duration_seconds": scrape_duration,
        "head_series": series,
        "rss_bytes_max": max(rss) if rss else 0,
        "rss_bytes_end": rss[-1] if rss else 0,
        "load_average_median": statistics.median(loads) if loads else None,
        "prometheus_cpu_seconds": cpu_seconds(pid),
        "rule_errors": health,
        "groups": [],
    }
    for group in groups:
        times = list(evaluations.get(group["name"], {}).values())
        interval = float(group["interval"])
        slowest = sorted(
            (
                (max(rule_times.get((group["name"], rule["name"]), [0.0])), rule["name"])
                for rule in group["rules"]
            ),
            reverse=True,
        )[: args.top]
        report["groups"].append(
            {
                "name": group["name"],
                "interval_seconds": interval,
                "rules": [{"name": rule["name"], "expr": rule["query"]} for rule in group["rules"]],
                "evaluations": len(times),
                "median_seconds": statistics.median(times) if times else None,
                "max_seconds": max(times) if times else None,
                "median_share": statistics.median(times) / interval if times else None,
                "max_share": max(times) / interval if times else None,
                "slowest_rules": [
                    {
                        "rule": name,
                        "max_seconds": worst,
                        "median_seconds": statistics.median(
                            rule_times.get((group["name"], name), [0.0])
                        ),
                        "samples_at_full_window": full.get(name),
                    }
                    for worst, name in slowest
                ],
            }
        )
    return report


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['callers']:,} callers x {report['models']} model(s), "
        f"{report['detailed']} detailed; {report['scrape_samples']:,.0f} samples a scrape "
        f"(scrape {report['scrape_duration_seconds']:.2f} s), "
        f"{report['head_series']:,.0f} head series; Prometheus RSS max "
        f"{report['rss_bytes_max'] / 2**20:,.0f} MiB, "
        f"CPU {report['prometheus_cpu_seconds']:,.0f} s; "
        f"{report['minutes']} min of data; load average {report['load_average_median']:.1f} "
        f"on {os.cpu_count()} CPUs",
        "",
        f"{'group':<34} {'interval':>8} {'evals':>5} {'median':>8} {'max':>8} "
        f"{'median %':>8} {'max %':>7}",
    ]
    for group in report["groups"]:
        if group["median_seconds"] is None:
            lines.append(f"{group['name']:<34} {group['interval_seconds']:>7.0f}s  (no evaluation)")
            continue
        lines.append(
            f"{group['name']:<34} {group['interval_seconds']:>7.0f}s {group['evaluations']:>5} "
            f"{group['median_seconds']:>7.3f}s {group['max_seconds']:>7.3f}s "
            f"{100 * group['median_share']:>7.1f}% {100 * group['max_share']:>6.1f}%"
        )
    if any("cpu_seconds" in group for group in report["groups"]):
        lines.append("")
        lines.append("CPU per evaluation (its rules queried in turn, Prometheus otherwise idle):")
        for group in report["groups"]:
            lines.append(
                f"{group['name']:<34} {group['interval_seconds']:>7.0f}s "
                f"{group['cpu_seconds']:>7.2f}s {100 * group['cpu_share']:>6.1f}%   "
                + ", ".join(
                    f"{rule['rule'].split(':', 1)[-1]} {rule['cpu_seconds']:.2f}s"
                    for rule in group["costliest_rules"][:3]
                )
            )
    for group in report["groups"]:
        lines.append("")
        lines.append(f"slowest in {group['name']} (max / median seconds, samples at full window):")
        for rule in group["slowest_rules"]:
            full = rule["samples_at_full_window"]
            lines.append(
                f"  {rule['max_seconds']:7.3f} {rule['median_seconds']:7.3f}  {rule['rule']}"
                + (f"  ({full:,.0f})" if full else "")
            )
    if report["rule_errors"]:
        lines.append("")
        lines.append("rules that failed:")
        for name, error in report["rule_errors"].items():
            lines.append(f"  {name}: {error}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--callers", type=int, default=10_000)
    parser.add_argument("--models", type=int, default=3)
    parser.add_argument("--detailed", type=int, default=100)
    parser.add_argument("--mean-rate", type=float, default=0.02, help="requests/s per pair")
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument(
        "--warmup", type=float, default=2.0, help="minutes before evaluations count"
    )
    parser.add_argument("--interval", default="15s", help="scrape and evaluation interval")
    parser.add_argument("--poll", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=5, help="slowest rules shown per group")
    parser.add_argument("--rules-dir", default=str(ROOT / "alerts"))
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--keep", action="store_true", help="keep Prometheus' directory")
    parser.add_argument(
        "--no-cpu-profile",
        dest="cpu_profile",
        action="store_false",
        help="skip querying each rule alone for its CPU at the end",
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.callers, args.models, args.detailed, args.mean_rate)
        return
    report = run(args)
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", "utf-8")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
