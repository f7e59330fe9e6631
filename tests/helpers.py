"""Shared test helpers: a scriptable stand-in for vLLM's /metrics, exposition readers."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestClient

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


class FakeVllm:
    """Serves whatever the test sets: a body, a status, or a hang."""

    def __init__(self) -> None:
        self.body = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")
        self.status = 200
        self.hang = False
        self.requests = 0
        self.release = asyncio.Event()
        self.url = ""

    async def handle(self, _request: web.Request) -> web.Response:
        self.requests += 1
        if self.hang:
            await self.release.wait()
        return web.Response(
            status=self.status, text=self.body, content_type="text/plain", charset="utf-8"
        )


async def scrape(client: TestClient, headers: dict[str, str] | None = None) -> str:
    response = await client.get("/metrics", headers=headers or {})
    assert response.status == 200
    return await response.text()


def samples(text: str) -> dict[str, float]:
    """Exposition -> {'name{labels}': value} with labels as printed (sorted by client_python)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    """Value of the one sample with this name whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None
