"""Hostile input against the exporter as deployed: a real process, fed what a careless or
hostile sender would feed it. It stays up, serves /metrics, counts what it refused, and stops
on SIGTERM within its drain time."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import aiohttp

from tests.helpers import value
from tests.test_run_process import free_port

NESTED = "[" * 100_000 + "]" * 100_000
GOOD = {"caller": "alice", "model": "m", "prompt_tokens": 4096, "cached_tokens": 2048}


async def start_exporter(*flags: str) -> tuple[asyncio.subprocess.Process, str]:
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "exporter", "--web.listen-address", f"127.0.0.1:{port}",
        "--log.level", "warning", *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        deadline = asyncio.get_running_loop().time() + 30
        while True:  # no event to await across processes: poll readiness with a deadline
            try:
                async with session.get(f"{base}/-/healthy") as response:
                    if response.status == 200:
                        return process, base
            except aiohttp.ClientConnectionError:
                pass
            assert process.returncode is None, "the exporter exited while starting"
            assert asyncio.get_running_loop().time() < deadline, "exporter never healthy"
            await asyncio.sleep(0.1)


async def scrape(base: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/metrics") as response:
            assert response.status == 200
            return await response.text()


async def stop(process: asyncio.subprocess.Process) -> float:
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 0, err.decode()[-2000:]
    return time.monotonic() - sent


async def wait_for_metric(base: str, name: str, expected: float, **labels: str) -> str:
    deadline = asyncio.get_running_loop().time() + 30
    while True:  # the follower polls its files: poll the metric with a deadline
        text = await scrape(base)
        if value(text, name, **labels) == expected:
            return text
        assert asyncio.get_running_loop().time() < deadline, (name, value(text, name, **labels))
        await asyncio.sleep(0.1)


async def test_a_nested_line_in_a_followed_file_never_takes_the_process_down(tmp_path: Path):
    path = tmp_path / "usage.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + NESTED + "\n" + json.dumps(GOOD) + "\n")
    flags = ("--usage.file", str(path), "--usage.file.from-start",
             "--usage.file.poll-interval", "0.05")
    for _restart in range(2):  # replayed from the start on every restart: no crash loop
        process, base = await start_exporter(*flags)
        try:
            text = await wait_for_metric(base, "vllm_cache_usage_events_total", 2,
                                         reader="file")
            assert value(text, "vllm_cache_usage_events_rejected_total", reader="file",
                         reason="malformed_json") == 1
        finally:
            await stop(process)


async def test_sigterm_during_a_long_ingest_exits_within_the_drain_time():
    process, base = await start_exporter()
    body = ("\n".join(json.dumps({**GOOD, "caller": f"c{index % 50}"})
                      for index in range(200_000))).encode()  # ~15 MB, seconds to process
    async with aiohttp.ClientSession() as session:
        posting = asyncio.ensure_future(session.post(f"{base}/v1/usage", data=body))
        await asyncio.sleep(1.0)  # the body is being processed (no event visible from here)
        took = await stop(process)
        posting.cancel()
    assert took < 8.0, f"exited {took:.1f} s after SIGTERM (drain is 5 s)"
