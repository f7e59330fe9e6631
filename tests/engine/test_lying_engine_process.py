"""A lying vLLM against the exporter as deployed: a real process reading an aiohttp app on
127.0.0.1 that sends 2,000 model_name values, 10,000 engine values, 5,000 cache_config_info
rows and a label value of a megabyte. Before the caps, scrapes took 6 s and one label value
was copied into every engine series (a 7 MB body); now /-/healthy answers at once throughout
and /metrics stays small."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from exporter.engine.parse import MAX_MODEL_NAMES, MAX_ROWS
from tests.helpers import fixture_text, value
from tests.test_hostile_process import scrape, start_exporter, stop

BASE = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")
HUGE = "x" * 1_000_000


def lying_body() -> str:
    config = next(line for line in BASE.splitlines() if line.startswith("vllm:cache_config_info"))
    lines = [BASE.rstrip("\n")]
    for index in range(2_000):
        lines.append(f'vllm:prefix_cache_queries_total{{engine="0",model_name="m-{index}"}} 1.0')
    for index in range(1, 10_001):
        lines.append(
            f'vllm:prefix_cache_hits_total{{engine="{index}",model_name="tiny-llama"}} 1.0'
        )
    lines.extend(config.replace('engine="0"', f'engine="c{index}"') for index in range(5_000))
    lines.append(f'vllm:num_preemptions_total{{engine="0",model_name="{HUGE}"}} 1.0')
    lines.append(f'vllm:num_requests_running{{engine="0",model_name="{HUGE}"}} 1.0')
    return "\n".join(lines) + "\n"


async def test_a_lying_vllm_costs_neither_health_nor_a_big_body():
    body = lying_body().encode()
    reads = 0

    async def metrics(_request: web.Request) -> web.Response:
        nonlocal reads
        reads += 1
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    target = f"http://127.0.0.1:{port}/metrics"
    process, base = await start_exporter("--vllm.url", target)
    try:
        latencies: list[float] = []
        scraping = True

        async def probe() -> None:
            loop = asyncio.get_running_loop()
            async with aiohttp.ClientSession() as session:
                while scraping:
                    started = loop.time()
                    async with session.get(f"{base}/-/healthy") as response:
                        assert response.status == 200
                    latencies.append(loop.time() - started)
                    await asyncio.sleep(0.02)  # a liveness prober's pace, compressed

        prober = asyncio.ensure_future(probe())
        sizes = []
        for _ in range(4):
            text = await scrape(base)
            sizes.append(len(text.encode()))
        scraping = False
        await prober
        assert reads >= 4
        assert value(text, "vllm_cache_engine_up", target=target) == 1
        for reason in ("model_name_cap", "engine_cap", "too_long"):
            assert (
                value(text, "vllm_cache_engine_samples_folded_total", target=target, reason=reason)
                > 0
            ), reason
        assert HUGE[:1000] not in text
        models = {
            line.split('model_name="', 1)[1].split('"', 1)[0]
            for line in text.splitlines()
            if 'model_name="' in line and line.startswith("vllm_cache_engine_")
        }
        assert len(models) <= MAX_MODEL_NAMES + 1
        rows = {
            line.split("{", 1)[1]
            for line in text.splitlines()
            if line.startswith("vllm_cache_engine_prefix_cache_hits_tokens_total{")
        }
        assert len(rows) <= MAX_ROWS + 1
        # About what the real fixture alone gives, not megabytes (measured: 49 KB from an
        # 8.2 MB lie; /-/healthy at most 47 ms, the read 0.38 s).
        assert max(sizes) < 200_000, sizes
        assert max(latencies) < 1.0, max(latencies)
    finally:
        await stop(process)
        await runner.cleanup()
