"""A real Prometheus scraping an exporter that holds 1,000 callers: scrape_duration_seconds.

    python bench/bench_scrape.py [--callers 1000] [--scrapes 12] [--interval 5]
                                 [--before CHECKOUT] [--changing]

The exporter runs as deployed (``python -m exporter run``, ``--callers.max`` raised to hold
every caller); each caller gets a request in all six states, timed, with a queue wait (as
``tests/test_prometheus_scale.py``). Then Prometheus (the ``prometheus`` binary on PATH,
2.42 on the project's machines) scrapes it every ``--interval`` seconds with its own
headers (OpenMetrics, gzip), ``--scrapes`` times; its ``scrape_duration_seconds`` and
``scrape_samples_scraped`` are read back from its API (a scrape's duration includes
Prometheus parsing the body and appending it to its TSDB).

Baselines in the same run:

- Prometheus' own floor for this body: the same Prometheus also scrapes a static server (its
  own process) that answers every scrape with the exporter's body as captured before
  Prometheus started, byte for byte, with its headers: what Prometheus spends on decompressing,
  parsing and storing these samples however fast the target. The exporter's own share is the
  difference.
- Between Prometheus' scrapes, the same request from this process (aiohttp, Prometheus'
  headers), the time to the last byte.

Reported: medians, p90 and max.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from harness import ExporterProcess, commit, machine, quantile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests/, as bench_order does

from exporter.signals.usage import SERIES_PER_PAIR  # noqa: E402

# The same load and Prometheus' own headers as the scale test, at the bench's size.
from tests.test_prometheus_scale import PROMETHEUS_HEADERS as HEADERS  # noqa: E402
from tests.test_prometheus_scale import events_for  # noqa: E402

GOAL_SECONDS = 0.25

# The static target: answers GET /metrics with a file's bytes and the given headers.
STATIC_SERVER = """
import sys
from aiohttp import web
body = open(sys.argv[2], "rb").read()
headers = dict(zip(sys.argv[3::2], sys.argv[4::2]))
async def metrics(request):
    return web.Response(body=body, headers=headers)
app = web.Application()
app.router.add_get("/metrics", metrics)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


async def raw_samples(
    session: aiohttp.ClientSession, prometheus: str, expr: str, seconds: float
) -> list[float]:
    """Every sample of ``expr`` stored over the last ``seconds``, oldest first."""
    async with session.post(
        f"http://{prometheus}/api/v1/query", data={"query": f"{expr}[{int(seconds) + 1}s]"}
    ) as response:
        body = await response.json()
    assert body["status"] == "success", body
    values: list[float] = []
    for series in body["data"]["result"]:
        values.extend(float(value) for _at, value in series["values"])
    return values


async def wait_ok(
    session: aiohttp.ClientSession,
    url: str,
    process: subprocess.Popen[bytes],
    deadline: float = 60.0,
) -> None:
    started = time.monotonic()
    while time.monotonic() - started < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        try:
            async with session.get(url) as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)  # another process: poll with a deadline
    raise RuntimeError(f"{url} did not answer within {deadline}s")


def exporter_args(callers: int) -> list[str]:
    return [
        "--callers.max",
        str(callers),
        "--callers.detailed",
        str(callers),
        "--callers.max-series",
        str((callers + 1) * SERIES_PER_PAIR),
        "--signals.granularity",
        "16",
        "--usage.new-series-hold",
        "0",
        "--log.level",
        "warning",
    ]


async def post_events(
    session: aiohttp.ClientSession, exporter: ExporterProcess, events: list[dict[str, Any]]
) -> None:
    body = "\n".join(json.dumps(event) for event in events)
    async with session.post(exporter.base_url + "/v1/usage", data=body) as response:
        accepted = (await response.json())["accepted"]
    assert accepted == len(events), accepted


def one_more(callers: int, round_: int) -> list[dict[str, Any]]:
    """One warm request more for every caller (a new conversation turn each round)."""
    return [
        {**events_for(f"agent-{index:05d}")[1], "session": f"more-{round_}"}
        for index in range(callers)
    ]


def summary(values: list[float]) -> str:
    return (
        f"median {statistics.median(values) * 1e3:.0f} ms, p90 "
        f"{quantile(values, 0.9) * 1e3:.0f} ms, max {max(values) * 1e3:.0f} ms "
        f"({len(values)} scrapes)"
    )


async def run(args: argparse.Namespace, workdir: Path) -> int:
    exporters = {"exporter": ExporterProcess(workdir / "exporter", exporter_args(args.callers))}
    if args.before is not None:
        exporters["before"] = ExporterProcess(
            workdir / "before", exporter_args(args.callers), root=args.before
        )
    for exporter in exporters.values():
        exporter.log_path.parent.mkdir()
        exporter.start()
    prometheus_port, static_port = ExporterProcess(workdir).port, ExporterProcess(workdir).port
    prometheus_address = f"127.0.0.1:{prometheus_port}"
    targets = {
        job: exporter.base_url.removeprefix("http://") for job, exporter in exporters.items()
    }
    targets["floor"] = f"127.0.0.1:{static_port}"
    config = workdir / "prometheus.yml"
    interval = f"{args.interval:g}s"
    config.write_text(
        json.dumps(
            {  # JSON is YAML
                "global": {"scrape_interval": interval, "scrape_timeout": interval},
                "scrape_configs": [
                    {"job_name": job, "static_configs": [{"targets": [target]}]}
                    for job, target in targets.items()
                ],
            }
        )
    )
    prometheus_bin = shutil.which("prometheus") or "prometheus"
    static: subprocess.Popen[bytes] | None = None
    prometheus: subprocess.Popen[bytes] | None = None
    exporter = exporters["exporter"]
    try:
        async with aiohttp.ClientSession() as session:
            load = [
                event for index in range(args.callers) for event in events_for(f"agent-{index:05d}")
            ]
            for each in exporters.values():
                await post_events(session, each, load)
            # The static target serves the body Prometheus would get now, as the exporter
            # sent it (gzipped, same content type).
            async with session.get(
                exporter.base_url + "/metrics", headers=HEADERS, auto_decompress=False
            ) as response:
                captured = workdir / "captured-body"
                captured.write_bytes(await response.read())
                served = [
                    item
                    for name in ("Content-Type", "Content-Encoding")
                    for item in (name, response.headers[name])
                ]
            static = subprocess.Popen(
                [sys.executable, "-c", STATIC_SERVER, str(static_port), str(captured), *served],
                start_new_session=True,
            )
            await wait_ok(session, f"http://127.0.0.1:{static_port}/metrics", static)
            with open(workdir / "prometheus.log", "wb") as log:
                prometheus = subprocess.Popen(
                    [
                        prometheus_bin,
                        f"--config.file={config}",
                        f"--storage.tsdb.path={workdir / 'prom-data'}",
                        f"--web.listen-address={prometheus_address}",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            await wait_ok(session, f"http://{prometheus_address}/-/ready", prometheus)
            # The first scrape creates every series in Prometheus' TSDB (its append is part
            # of scrape_duration_seconds): wait for it on every target, and report it apart.
            ready = time.time()
            for job in targets:
                while not await raw_samples(
                    session, prometheus_address, f'up{{job="{job}"}}', time.time() - ready
                ):
                    if time.time() - ready > 60:
                        raise RuntimeError(f"Prometheus did not scrape {job} within 60 s")
                    await asyncio.sleep(0.2)  # another process: poll with a deadline
            first = (
                await raw_samples(
                    session,
                    prometheus_address,
                    'scrape_duration_seconds{job="exporter"}',
                    time.time() - ready,
                )
            )[0]
            started = time.time()
            own: list[float] = []
            wire_bytes = body_bytes = samples = 0
            # Our own scrapes, half an interval after each of Prometheus' (roughly); with
            # --changing, every caller gets one more request just before each and just after
            # (so both ours and Prometheus' next one render every caller's changed lines).
            rounds = 0
            while time.time() - started < args.scrapes * args.interval:
                await asyncio.sleep(args.interval / 2)
                if args.changing:
                    rounds += 1
                    for each in exporters.values():
                        await post_events(session, each, one_more(args.callers, rounds))
                began = time.perf_counter()
                async with session.get(
                    exporter.base_url + "/metrics", headers=HEADERS, auto_decompress=False
                ) as response:
                    wire = await response.read()
                own.append(time.perf_counter() - began)
                text = (
                    gzip.decompress(wire)
                    if response.headers.get("Content-Encoding") == "gzip"
                    else wire
                )
                wire_bytes, body_bytes = len(wire), len(text)
                samples = sum(1 for line in text.split(b"\n") if line and not line.startswith(b"#"))
                if args.changing:  # and again for Prometheus' next scrape
                    rounds += 1
                    for each in exporters.values():
                        await post_events(session, each, one_more(args.callers, rounds))
                await asyncio.sleep(args.interval / 2)
            window = time.time() - started
            durations: dict[str, list[float]] = {}
            scraped: dict[str, list[float]] = {}
            up: dict[str, list[float]] = {}
            for job in targets:
                durations[job] = await raw_samples(
                    session, prometheus_address, f'scrape_duration_seconds{{job="{job}"}}', window
                )
                scraped[job] = await raw_samples(
                    session, prometheus_address, f'scrape_samples_scraped{{job="{job}"}}', window
                )
                up[job] = await raw_samples(
                    session, prometheus_address, f'up{{job="{job}"}}', window
                )
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        if static is not None:
            static.terminate()
            static.wait(timeout=30)
        for each in exporters.values():
            each.stop()
    median = statistics.median(durations["exporter"])
    floor_median = statistics.median(durations["floor"])
    print(
        f"machine: {machine()}; exporter at {commit()}"
        + (f", before: {args.before}" if args.before else "")
    )
    print(
        f"{args.callers:,} callers, {samples:,} samples, {body_bytes / 1e6:.1f} MB "
        f"(OpenMetrics), {wire_bytes / 1e6:.2f} MB gzipped; Prometheus scraped every "
        f"{interval} for {args.scrapes * args.interval:g} s; "
        + (
            "every caller sent a request between two scrapes"
            if args.changing
            else "no request after the first scrape"
        )
    )
    print(
        f"Prometheus scrape_duration_seconds (first scrape, creating every series: "
        f"{first * 1e3:.0f} ms):"
    )
    for job in targets:
        what = {
            "exporter": "this checkout",
            "before": "--before",
            "floor": "the floor: the same body from a static server",
        }[job]
        print(
            f"  {what}: {summary(durations[job])}; up min {min(up[job]):g}; samples "
            f"scraped {', '.join(sorted({f'{v:,.0f}' for v in scraped[job]}))}"
        )
    print(
        f"this checkout against the floor: {median / floor_median:.2f}x, "
        f"{(median - floor_median) * 1e3:+.0f} ms"
    )
    if "before" in durations:
        print(
            f"this checkout against --before: "
            f"{median / statistics.median(durations['before']):.2f}x"
        )
    print(f"this process, same request to this checkout: {summary(own)}")
    complete = set(scraped["exporter"]) == {float(samples)} or args.changing
    met = median < GOAL_SECONDS and min(up["exporter"]) == 1 and complete
    print(
        f"goal: median < {GOAL_SECONDS} s, every scrape up and complete: "
        f"{'met' if met else 'MISSED'}"
    )
    return 0 if met else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=1000)
    parser.add_argument("--scrapes", type=int, default=12)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="another checkout whose exporter Prometheus scrapes too",
    )
    parser.add_argument(
        "--changing",
        action="store_true",
        help="every caller sends a request between two scrapes (the worst "
        "case: no series' lines can be reused)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-scrape-") as tmp:
        return asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    raise SystemExit(main())
