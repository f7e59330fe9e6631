"""Series per topology (docs/deployment.md, "Series per topology"): how many series a fleet's
exporters serve, all told, at ``--replicas`` vLLM replicas and ``--callers`` callers, for each
way of placing them (docs/deployment.md, "Topologies"):

- one exporter for everything: it reads every replica's vLLM and takes all the usage;
- a sidecar per replica: each reads its own vLLM and counts the requests that land on it;
- sidecars (engine only) plus one gateway exporter taking all the usage;
- sidecars plus ``--shards`` gateway exporters, each taking the sessions hashed to it.

    python bench/bench_topologies.py [--replicas 100] [--callers 10000]
        [--sessions-per-caller 3] [--shards 3] [--detailed N] [--concurrency 4] [--json PATH]
    python bench/bench_topologies.py --quick     # 4 replicas, 200 callers: a smoke check

Measured by running the exporters (``python -m exporter run``, this checkout, as
bench/harness.py starts them), POSTing each its share of the usage and counting the sample
lines of its /metrics (text format): whatever the exporter serves is counted, so a family it
adds (per caller and replica, say) shows up here without a change to the bench. Every vLLM is
one recorded scrape (tests/fixtures/vllm-0.33.0-sample.prom) served by the bench under a path
of its own per replica (``--vllm.url http://127.0.0.1:PORT/replica-N/metrics``), so each
replica is a target of its own. The engine-only sidecars of the gateway rows read alike and
take no usage: one is run, and counted ``--replicas`` times.

The usage, from ``--seed``: each caller has ``--sessions-per-caller`` conversations, each on
a replica picked at random (sticky by session), each of two turns (a cold first one and a warm
follow-up, with a TTFT, so the per-caller histograms exist), each event naming its replica in
``backend``. A sidecar sees the callers whose sessions landed on its replica; a sharded
gateway those whose sessions hash to it. ``--detailed N`` adds the same rows with every
exporter started with ``--callers.detailed=N`` (its N callers with their own costly
families). Nothing else is set: the exporter's defaults (``--callers.max`` 10,000).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import urllib.request
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from harness import ExporterProcess, commit, machine, sample_lines

ROOT = Path(__file__).resolve().parents[1]
VLLM_SCRAPE = ROOT / "tests" / "fixtures" / "vllm-0.33.0-sample.prom"
MODEL = "qwen3.8-27b"
BATCH = 1000  # usage events per POST
QUICK = {"replicas": 4, "callers": 200}
PROMPT, CACHED, FOLLOWUP = 10_000, 9_984, 10_500  # a cold first turn, then a warm follow-up


# ---- the vLLMs: one recorded scrape, one path per replica --------------------------------


class ScrapeServer:
    """Answers GET <anything>/metrics with the recorded vLLM scrape, on 127.0.0.1."""

    def __init__(self, body: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                found = self.path.endswith("/metrics")
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body) if found else 0))
                self.end_headers()
                if found:
                    self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, replica: int) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/replica-{replica}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- the usage ------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    caller: str
    session: str
    replica: int

    def shard(self, shards: int) -> int:
        return zlib.crc32(self.session.encode()) % shards


def sessions(args: argparse.Namespace) -> list[Session]:
    rng = random.Random(args.seed)
    return [
        Session(
            f"caller-{caller:05d}", f"caller-{caller:05d}/{index}", rng.randrange(args.replicas)
        )
        for caller in range(args.callers)
        for index in range(args.sessions_per_caller)
    ]


def events(chosen: Sequence[Session], backend: dict[int, str]) -> list[dict[str, Any]]:
    """Two turns per session: cold, then warm."""
    out = []
    for item in chosen:
        common = {"caller": item.caller, "model": MODEL, "session": item.session}
        common["backend"] = backend[item.replica]
        out.append(
            dict(
                common,
                prompt_tokens=PROMPT,
                cached_tokens=0,
                completion_tokens=400,
                ttft_seconds=2.5,
            )
        )
        out.append(
            dict(
                common,
                prompt_tokens=FOLLOWUP,
                cached_tokens=CACHED,
                completion_tokens=300,
                ttft_seconds=0.4,
            )
        )
    return out


# ---- one exporter, measured -------------------------------------------------------------


def measure(
    workdir: Path, name: str, flags: Sequence[str], usage: Sequence[dict[str, Any]]
) -> dict[str, int]:
    """Run an exporter with ``flags``, POST it ``usage``, count its /metrics; stop it."""
    folder = workdir / name
    folder.mkdir(parents=True)
    exporter = ExporterProcess(folder, [*flags, "--log.level", "warning"], root=ROOT)
    exporter.start()
    try:
        for start in range(0, len(usage), BATCH):
            body = json.dumps(list(usage[start : start + BATCH])).encode()
            request = urllib.request.Request(
                exporter.base_url + "/v1/usage",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as response:
                assert response.status < 300, response.read()
        request = urllib.request.Request(
            exporter.base_url + "/metrics", headers={"Accept": "text/plain;version=0.0.4"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            lines = sample_lines(response.read().decode())
    finally:
        exporter.stop()
    return {
        "series": len(lines),
        "per_caller": sum('caller="' in line for line in lines),
        "per_target": sum('target="' in line for line in lines),
        "caller_targets": sum('caller="' in line and 'target="' in line for line in lines),
    }


@dataclass
class Row:
    topology: str
    exporters: int
    series: int = 0
    per_caller: int = 0
    per_target: int = 0
    caller_targets: int = 0  # per caller and vLLM target (in --json only)
    largest: int = 0  # the series of the largest exporter

    def add(self, counts: dict[str, int], times: int = 1) -> None:
        self.series += counts["series"] * times
        self.per_caller += counts["per_caller"] * times
        self.per_target += counts["per_target"] * times
        self.caller_targets += counts["caller_targets"] * times
        self.largest = max(self.largest, counts["series"])


def topologies(
    args: argparse.Namespace, workdir: Path, vllms: ScrapeServer, extra: Sequence[str]
) -> list[Row]:
    replicas = range(args.replicas)
    backend = {replica: vllms.url(replica).removesuffix("/metrics") for replica in replicas}
    everyone = sessions(args)
    reads = {replica: ["--vllm.url", vllms.url(replica)] for replica in replicas}
    suffix = f" (--callers.detailed={args.detailed})" if extra else ""
    rows = []

    one = Row("one exporter for everything" + suffix, 1)
    every_url = [flag for replica in replicas for flag in reads[replica]]
    one.add(measure(workdir, "one" + suffix, [*every_url, *extra], events(everyone, backend)))
    rows.append(one)

    sidecars = Row("a sidecar per replica" + suffix, args.replicas)
    with ThreadPoolExecutor(args.concurrency) as pool:
        shares = pool.map(
            lambda replica: measure(
                workdir,
                f"sidecar-{replica}{suffix}",
                [*reads[replica], *extra],
                events([item for item in everyone if item.replica == replica], backend),
            ),
            replicas,
        )
        for counts in shares:
            sidecars.add(counts)
    rows.append(sidecars)

    engine_only = measure(workdir, "engine-only" + suffix, [*reads[0], *extra], [])
    gateway = Row("sidecars + one gateway exporter" + suffix, args.replicas + 1)
    gateway.add(engine_only, args.replicas)
    gateway.add(measure(workdir, "gateway" + suffix, list(extra), events(everyone, backend)))
    rows.append(gateway)

    sharded = Row(
        f"sidecars + {args.shards} gateways sticky by session" + suffix,
        args.replicas + args.shards,
    )
    sharded.add(engine_only, args.replicas)
    for shard in range(args.shards):
        share = [item for item in everyone if item.shard(args.shards) == shard]
        sharded.add(measure(workdir, f"shard-{shard}{suffix}", list(extra), events(share, backend)))
    rows.append(sharded)
    return rows


# ---- the report -----------------------------------------------------------------------


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| topology | exporters | series | per caller | per vLLM target | largest exporter |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.topology} | {row.exporters:,} | {row.series:,} | {row.per_caller:,} | "
            f"{row.per_target:,} | {row.largest:,} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=100)
    parser.add_argument("--callers", type=int, default=10_000)
    parser.add_argument("--sessions-per-caller", type=int, default=3)
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument(
        "--detailed", type=int, default=None, help="also the rows with --callers.detailed=N"
    )
    parser.add_argument("--concurrency", type=int, default=4, help="sidecars run at once")
    parser.add_argument("--seed", type=int, default=33)
    parser.add_argument("--quick", action="store_true", help="4 replicas, 200 callers")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    vllms = ScrapeServer(VLLM_SCRAPE.read_bytes())
    try:
        with tempfile.TemporaryDirectory(prefix="bench-topologies-") as tmp:
            rows = topologies(args, Path(tmp), vllms, [])
            if args.detailed is not None:
                extra = [f"--callers.detailed={args.detailed}"]
                rows += topologies(args, Path(tmp), vllms, extra)
    finally:
        vllms.close()
    print(
        f"{args.replicas:,} replicas, {args.callers:,} callers, {args.sessions_per_caller} "
        f"sessions each (sticky, two turns each), one model; {machine()}, commit {commit()}"
    )
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([row.__dict__ for row in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
