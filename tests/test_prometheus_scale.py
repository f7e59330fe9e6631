"""A real Prometheus 2.42 scrapes an exporter holding 1,000 callers, and keeps every sample.

The exporter is started as a user would, with ``--callers.max 1000`` and a series budget
that admits every caller; each caller gets requests in all six states, TTFT and queue
waits (about 80 samples each). Prometheus asks as it always does (OpenMetrics first, gzip);
what it stored, ``scrape_samples_scraped``, must equal the number of samples in the body
the exporter serves to those same headers, counted here line by line.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from exporter.signals.usage import SERIES_PER_PAIR
from tests.monitoring.common import require_tool
from tests.monitoring.test_e2e_alerts import (
    Processes,
    exporter_command,
    free_port,
    instant_query,
    poll_until,
    wait_http_ok,
)

pytestmark = pytest.mark.e2e

CALLERS = 1000
GRANULARITY = 16
# Prometheus 2.42's scrape headers (scrape/scrape.go), sent to get the body it gets.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROMETHEUS_HEADERS = {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"}


def events_for(caller: str) -> list[dict[str, Any]]:
    """One request in each state (G = 16), each timed, each its own conversation."""
    shapes = [
        (1000, 0, 200),
        (1000, 992, 200),
        (1000, 480, 200),
        (10, 0, 200),
        (1000, None, 200),
        (1000, 0, 500),
    ]  # cold, warm, partial, short, unknown, error
    return [
        {
            "caller": caller,
            "model": "qwen3.8-27b",
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": 20,
            "ttft_seconds": 0.8,
            "queue_seconds": 0.1,
            "session": f"{caller}-{turn}",
            "status": status,
        }
        for turn, (prompt, cached, status) in enumerate(shapes)
    ]


def sample_count(body: bytes) -> int:
    """Samples in an exposition: every line that is not a comment, a blank or ``# EOF``."""
    return sum(1 for line in body.decode("utf-8").splitlines() if line and not line.startswith("#"))


async def served_samples(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url, headers=PROMETHEUS_HEADERS, auto_decompress=False) as response:
        assert response.status == 200
        wire = await response.read()
        encoding = response.headers.get("Content-Encoding", "")
        content_type = response.headers["Content-Type"]
    body = gzip.decompress(wire) if encoding == "gzip" else wire
    assert encoding == "gzip"
    return sample_count(body), content_type


@pytest.fixture
def processes(tmp_path: Path):  # type: ignore[no-untyped-def]
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


async def test_prometheus_keeps_every_sample_of_1000_callers(tmp_path, processes):
    prometheus_bin = require_tool("prometheus")
    exporter, prometheus = (f"127.0.0.1:{free_port()}" for _ in range(2))
    processes.start(
        "exporter",
        *exporter_command(
            "run",
            "--web.listen-address",
            exporter,
            "--callers.max",
            str(CALLERS),
            "--callers.detailed",  # every caller's histograms its own: the most samples
            str(CALLERS),
            "--callers.max-series",
            str((CALLERS + 1) * SERIES_PER_PAIR),
            "--signals.granularity",
            str(GRANULARITY),
            "--usage.new-series-hold",
            "0",
            "--log.level",
            "warning",
        ),
    )
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "exporter", "static_configs": [{"targets": [exporter]}]}],
    }
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    async with aiohttp.ClientSession() as session:
        await wait_http_ok(session, f"http://{exporter}/-/healthy", processes)
        body = "\n".join(
            json.dumps(event)
            for index in range(CALLERS)
            for event in events_for(f"agent-{index:04d}")
        )
        async with session.post(f"http://{exporter}/v1/usage", data=body) as response:
            reply = await response.json()
        assert reply["accepted"] == CALLERS * 6, reply
        served, content_type = await served_samples(session, f"http://{exporter}/metrics")
        assert content_type.startswith("application/openmetrics-text")
        assert served > CALLERS * 70  # all six states and every histogram, per caller

        processes.start(
            "prometheus",
            prometheus_bin,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={tmp_path / 'prom-data'}",
            f"--web.listen-address={prometheus}",
        )
        await wait_http_ok(session, f"http://{prometheus}/-/ready", processes)
        # Scrapes from now on see exactly what `served` counted (no event arrives meanwhile).
        await poll_until(
            session, prometheus, processes, 'scrape_samples_scraped{job="exporter"} > 0', timeout=25
        )
        result = await instant_query(session, prometheus, 'scrape_samples_scraped{job="exporter"}')
        up = await instant_query(session, prometheus, 'up{job="exporter"}')
        callers = await instant_query(
            session,
            prometheus,
            'count(count by (caller) (vllm_cache_requests_total{caller=~"agent-.*"}))',
        )
        again, _ = await served_samples(session, f"http://{exporter}/metrics")
    assert again == served  # the exposition did not change under Prometheus
    assert float(up[0]["value"][1]) == 1
    assert int(float(result[0]["value"][1])) == served
    assert int(float(callers[0]["value"][1])) == CALLERS
