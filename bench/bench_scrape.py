"""A real Prometheus scraping an exporter that holds 1,000 callers: scrape_duration_seconds.

    python bench/bench_scrape.py [--callers 1000] [--scrapes 12] [--interval 5]

The exporter runs as deployed (``python -m exporter run``, ``--callers.max`` raised to hold
every caller); each caller gets a request in all six states, timed, with a queue wait (as
``tests/test_prometheus_scale.py``). Then Prometheus (the ``prometheus`` binary on PATH,
2.42 on the project's machines) scrapes it every ``--interval`` seconds with its own
headers (OpenMetrics, gzip), ``--scrapes`` times; its ``scrape_duration_seconds`` and
``scrape_samples_scraped`` are read back from its API (a scrape's duration includes
Prometheus parsing the body and appending it to its TSDB). Baseline in the same run, between
Prometheus' scrapes: the same request from this process (aiohttp, Prometheus' headers), the
time to the last byte, and the body decompressed. Reported: medians, p90 and max.
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

import aiohttp
from harness import ExporterProcess, commit, machine, quantile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests/, as bench_order does

from exporter.signals.usage import SERIES_PER_PAIR  # noqa: E402

# The same load and Prometheus' own headers as the scale test, at the bench's size.
from tests.test_prometheus_scale import PROMETHEUS_HEADERS as HEADERS  # noqa: E402
from tests.test_prometheus_scale import events_for  # noqa: E402

GOAL_SECONDS = 0.25


async def raw_samples(session: aiohttp.ClientSession, prometheus: str, expr: str,
                      seconds: float) -> list[float]:
    """Every sample of ``expr`` stored over the last ``seconds``, oldest first."""
    async with session.post(f"http://{prometheus}/api/v1/query", data={
            "query": f"{expr}[{int(seconds) + 1}s]"}) as response:
        body = await response.json()
    assert body["status"] == "success", body
    values: list[float] = []
    for series in body["data"]["result"]:
        values.extend(float(value) for _at, value in series["values"])
    return values


async def wait_ok(session: aiohttp.ClientSession, url: str, process: subprocess.Popen[bytes],
                  deadline: float = 60.0) -> None:
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


async def run(args: argparse.Namespace, workdir: Path) -> int:
    exporter = ExporterProcess(workdir, [
        "--callers.max", str(args.callers),
        "--callers.max-series", str((args.callers + 1) * SERIES_PER_PAIR),
        "--signals.granularity", "16", "--usage.new-series-hold", "0",
        "--log.level", "warning"])
    exporter.start()
    prometheus_port = ExporterProcess(workdir).port  # just a free port
    prometheus_address = f"127.0.0.1:{prometheus_port}"
    config = workdir / "prometheus.yml"
    interval = f"{args.interval:g}s"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": interval, "scrape_timeout": interval},
        "scrape_configs": [{"job_name": "exporter", "static_configs": [
            {"targets": [exporter.base_url.removeprefix("http://")]}]}]}))
    prometheus_bin = shutil.which("prometheus") or "prometheus"
    prometheus: subprocess.Popen[bytes] | None = None
    try:
        async with aiohttp.ClientSession() as session:
            body = "\n".join(json.dumps(event) for index in range(args.callers)
                             for event in events_for(f"agent-{index:05d}"))
            async with session.post(exporter.base_url + "/v1/usage", data=body) as response:
                accepted = (await response.json())["accepted"]
            assert accepted == args.callers * 6, accepted
            with open(workdir / "prometheus.log", "wb") as log:
                prometheus = subprocess.Popen(
                    [prometheus_bin, f"--config.file={config}",
                     f"--storage.tsdb.path={workdir / 'prom-data'}",
                     f"--web.listen-address={prometheus_address}"],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            await wait_ok(session, f"http://{prometheus_address}/-/ready", prometheus)
            # The first scrape creates every series in Prometheus' TSDB (its append is part
            # of scrape_duration_seconds): wait for it, and report it apart.
            ready = time.time()
            while not await raw_samples(session, prometheus_address,
                                        'up{job="exporter"}', time.time() - ready):
                if time.time() - ready > 60:
                    raise RuntimeError("Prometheus did not scrape the exporter within 60 s")
                await asyncio.sleep(0.2)  # another process: poll with a deadline
            first = (await raw_samples(session, prometheus_address,
                                       'scrape_duration_seconds{job="exporter"}',
                                       time.time() - ready))[0]
            started = time.time()
            own: list[float] = []
            wire_bytes = body_bytes = samples = 0
            # Our own scrapes, half an interval after each of Prometheus' (roughly).
            while time.time() - started < args.scrapes * args.interval:
                await asyncio.sleep(args.interval / 2)
                began = time.perf_counter()
                async with session.get(exporter.base_url + "/metrics", headers=HEADERS,
                                       auto_decompress=False) as response:
                    wire = await response.read()
                own.append(time.perf_counter() - began)
                text = gzip.decompress(wire) if response.headers.get(
                    "Content-Encoding") == "gzip" else wire
                wire_bytes, body_bytes = len(wire), len(text)
                samples = sum(1 for line in text.split(b"\n")
                              if line and not line.startswith(b"#"))
                await asyncio.sleep(args.interval / 2)
            window = time.time() - started
            durations = await raw_samples(session, prometheus_address,
                                          'scrape_duration_seconds{job="exporter"}', window)
            scraped = await raw_samples(session, prometheus_address,
                                        'scrape_samples_scraped{job="exporter"}', window)
            up = await raw_samples(session, prometheus_address, 'up{job="exporter"}', window)
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        exporter.stop()
    median = statistics.median(durations)
    print(f"machine: {machine()}; exporter at {commit()}")
    print(f"{args.callers:,} callers, {samples:,} samples, {body_bytes / 1e6:.1f} MB "
          f"(OpenMetrics), {wire_bytes / 1e6:.2f} MB gzipped; Prometheus scraped every "
          f"{interval} for {args.scrapes * args.interval:g} s")
    print(f"Prometheus scrape_duration_seconds: median {median * 1e3:.0f} ms, "
          f"p90 {quantile(durations, 0.9) * 1e3:.0f} ms, max {max(durations) * 1e3:.0f} ms "
          f"({len(durations)} scrapes after the first, which took {first * 1e3:.0f} ms; up: "
          f"min {min(up):g}); samples scraped {', '.join(sorted({f'{v:,.0f}' for v in scraped}))}")
    print(f"this process, same request: median {statistics.median(own) * 1e3:.0f} ms, "
          f"p90 {quantile(own, 0.9) * 1e3:.0f} ms, max {max(own) * 1e3:.0f} ms "
          f"({len(own)} scrapes)")
    met = median < GOAL_SECONDS and min(up) == 1 and set(scraped) == {float(samples)}
    print(f"goal: median < {GOAL_SECONDS} s, every scrape up and complete: "
          f"{'met' if met else 'MISSED'}")
    return 0 if met else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=1000)
    parser.add_argument("--scrapes", type=int, default=12)
    parser.add_argument("--interval", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-scrape-") as tmp:
        return asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    raise SystemExit(main())
