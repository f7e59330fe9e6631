"""docs/metrics.md is the contract users read: every series we serve must be in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from exporter.config import Config
from exporter.server import create_app
from tests.helpers import scrape, value

DOC = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text("utf-8")


async def test_every_served_family_is_documented(fake_vllm, aiohttp_client):
    client = await aiohttp_client(
        create_app(Config(vllm_url=(fake_vllm.url,)), initial_refresh=False)
    )
    text = await scrape(client)
    families = set(re.findall(r"^# TYPE (\S+) (\S+)", text, flags=re.M))
    assert families, "nothing served"
    missing = []
    for name, kind in sorted(families):
        documented = {name, f"{name}_total", re.sub(r"_(bucket|sum|count)$", "", name)}
        if kind == "counter":
            documented.add(f"{name}_total")
        if not any(f"`{candidate}`" in DOC for candidate in documented):
            missing.append(name)
    assert missing == [], f"series missing from docs/metrics.md: {missing}"


def test_series_the_runtime_adds_are_documented():
    """The collectors `run` registers beside the app's own (connection limits, log limits,
    web config reloads) are part of the contract too."""
    from exporter.limits import (
        FileDescriptors,
        FollowedFilesCollector,
        LimitsCollector,
        ListenerStats,
        RateLimitedLogs,
        plan_descriptors,
    )
    from exporter.web.metrics import WebConfigCollector
    from exporter.wiring import file_follower, signals_state

    plan = plan_descriptors(1024, {"web": (1, 1)})
    collectors = [
        LimitsCollector([ListenerStats("web", 1)], RateLimitedLogs(), plan, FileDescriptors(1)),
        WebConfigCollector(lambda: []),
        FollowedFilesCollector(
            file_follower(Config(usage_file=("x",)), signals_state(Config()).usage)
        ),
    ]
    names = [family.name for collector in collectors for family in collector.collect()]
    assert names
    missing = [name for name in names if f"`{name}`" not in DOC and f"`{name}_total`" not in DOC]
    assert missing == [], f"series missing from docs/metrics.md: {missing}"


@pytest.mark.real_process_metrics
async def test_the_process_start_time_is_the_real_one(aiohttp_client):
    import time

    client = await aiohttp_client(create_app(Config(), initial_refresh=False))
    text = await scrape(client)
    started = value(text, "process_start_time_seconds")
    assert started is not None and 0 < time.time() - started < 24 * 3600
