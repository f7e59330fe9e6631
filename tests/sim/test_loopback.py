"""End to end on loopback: the simulator's real HTTP front, the driver over HTTP and the
exporter, first in one process, then as the separate processes compose runs."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from exporter.config import Config
from exporter.server import create_app
from exporter.sim.client import HttpClient
from exporter.sim.clock import SimClock
from exporter.sim.driver import Driver
from exporter.sim.report import HttpReporter
from exporter.sim.scenario import parse_scenario
from exporter.sim.server import build_simulator, create_sim_app, start_site
from tests.helpers import value

HOST = "127.0.0.1"
FANOUT = {
    "name": "fanout-once",
    "report": "test",
    "reproduces": "one round of each order",
    "engine": {
        "served_model_name": "qwen3.8-27b",
        "hybrid": True,
        "enable_prefix_caching": True,
        "enable_prompt_tokens_details": True,
        "kv_pool_tokens": 567464,
        "block_size": 800,
        "prefill_rate": 1000.0,
        "decode_rate": 60.0,
    },
    "agents": [
        {
            "caller": "shared-first",
            "kind": "fanout",
            "rounds": 1,
            "shared_tokens": 2400,
            "task_tokens": 457,
            "order": "shared-first",
            "output_tokens": 16,
        },
        {
            "caller": "task-first",
            "kind": "fanout",
            "start": 20,
            "rounds": 1,
            "shared_tokens": 2400,
            "task_tokens": 457,
            "order": "task-first",
            "output_tokens": 16,
        },
    ],
}


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        return await response.text()


async def test_driver_over_http_into_the_exporter():
    speed = 20.0
    scenario = parse_scenario(FANOUT, "test")
    sim = build_simulator(scenario.engine_config(), SimClock(speed))
    sim_site, sim_port = await start_site(create_sim_app(sim), HOST, 0)
    exporter_site, exporter_port = await start_site(
        create_app(Config(vllm_url=(f"http://{HOST}:{sim_port}",))), HOST, 0
    )
    client = HttpClient(f"http://{HOST}:{sim_port}")
    reporter = HttpReporter(f"http://{HOST}:{exporter_port}")
    try:
        stats = await Driver(scenario, client, reporter, SimClock(speed), "qwen3.8-27b").run()
        await reporter.close()
        text = await get_text(f"http://{HOST}:{exporter_port}/metrics")
    finally:
        await client.close()
        await exporter_site.cleanup()
        await sim_site.cleanup()
    assert stats.requests == 8 and stats.errors == 0 and reporter.sent == 8
    assert value(text, "vllm_cache_prompt_tokens_total", caller="shared-first") == 4 * 2862
    assert value(text, "vllm_cache_cached_tokens_total", caller="shared-first") == 3 * 2400
    assert value(text, "vllm_cache_cached_tokens_total", caller="task-first") == 0
    assert value(text, "vllm_cache_engine_prefix_cache_hits_tokens_total") == 3 * 2400
    # TTFT measured at the client, converted to scenario seconds with the simulator's speed:
    # the four requests read 2,862 + 3 x 462 tokens one after the other at 1,000 tokens/s,
    # so their TTFTs add up to at least 2.862 + 3.324 + 3.786 + 4.248 s (plus HTTP time)
    ttft_sum = sum(
        value(text, "vllm_cache_ttft_seconds_sum", caller="shared-first", state=state) or 0
        for state in ("warm", "cold")
    )
    assert 14.2 <= ttft_sum < 30


SMALL = {
    "name": "small",
    "report": "test",
    "reproduces": "two short conversations",
    "engine": {
        "served_model_name": "sim-8b",
        "enable_prefix_caching": True,
        "enable_prompt_tokens_details": True,
        "block_size": 16,
        "kv_pool_tokens": 65536,
        "prefill_rate": 20000.0,
        "decode_rate": 100.0,
    },
    "agents": [
        {
            "caller": "alice",
            "context_tokens": 2000,
            "input_tokens": 100,
            "output_tokens": 20,
            "turns": 3,
            "think_seconds": 2,
        },
        {
            "caller": "bob",
            "start": 1,
            "context_tokens": 1000,
            "input_tokens": 100,
            "output_tokens": 20,
            "turns": 3,
            "think_seconds": 2,
        },
    ],
}


async def read_line(stream: asyncio.StreamReader, pattern: str) -> re.Match[str]:
    while True:
        line = (await asyncio.wait_for(stream.readline(), 30)).decode()
        assert line, f"process ended before printing {pattern!r}"
        match = re.search(pattern, line)
        if match:
            return match


async def test_simulate_and_drive_as_separate_processes(tmp_path: Path):
    scenario_file = tmp_path / "small.yaml"
    scenario_file.write_text(yaml.safe_dump(SMALL))
    python = [sys.executable, "-m", "exporter"]
    simulate = await asyncio.create_subprocess_exec(
        *python,
        "simulate",
        "--sim.listen-address",
        f"{HOST}:0",
        "--scenario",
        str(scenario_file),
        "--speed",
        "20",
        stderr=asyncio.subprocess.PIPE,
    )
    exporter_site = None
    try:
        port = int((await read_line(simulate.stderr, rf"http://{HOST}:(\d+)")).group(1))
        sim_url = f"http://{HOST}:{port}"
        config = Config(vllm_url=(sim_url,), usage_ingest_token="tok")
        exporter_site, exporter_port = await start_site(create_app(config), HOST, 0)
        drive = await asyncio.create_subprocess_exec(
            *python,
            "drive",
            "--scenario",
            str(scenario_file),
            "--drive.base-url",
            sim_url,
            "--drive.exporter-url",
            f"http://{HOST}:{exporter_port}",
            "--usage.ingest.token",
            "tok",
            "--speed",
            "20",
            "--drive.progress-interval",
            "0.05",
            "--log.format",
            "json",
            stderr=asyncio.subprocess.PIPE,
        )
        _, errors = await asyncio.wait_for(drive.communicate(), 60)
        assert drive.returncode == 0, errors.decode()
        # It said how it was going: the scenario's think times alone take 0.25 s at x20, so
        # several 0.05 s progress lines, each counting up to the 6 requests.
        progress = [
            line for line in map(json.loads, errors.decode().splitlines()) if "requests" in line
        ]
        assert len(progress) >= 2, errors.decode()
        counts = [line["requests"] for line in progress]
        assert counts == sorted(counts) and counts[-1] <= 6
        assert all(line["level"] == "info" and "delivered" in line for line in progress)
        text = await get_text(f"http://{HOST}:{exporter_port}/metrics")
    finally:
        if exporter_site is not None:
            await exporter_site.cleanup()
        if simulate.returncode is None:
            simulate.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(simulate.wait(), 30) == 0
    for caller in ("alice", "bob"):
        assert value(text, "vllm_cache_requests_total", caller=caller, state="cold") == 1
        assert value(text, "vllm_cache_requests_total", caller=caller, state="warm") == 2
    assert value(text, "vllm_cache_engine_up") == 1
    assert value(text, "vllm_cache_engine_prefix_caching_enabled", model_name="sim-8b") == 1


async def run_drive(scenario_file: Path, base_url: str) -> tuple[int, str]:
    drive = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "exporter",
        "drive",
        "--scenario",
        str(scenario_file),
        "--drive.base-url",
        base_url,
        "--drive.model",
        "sim-8b",
        "--speed",
        "20",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, errors = await asyncio.wait_for(drive.communicate(), 60)
    assert drive.returncode is not None
    return drive.returncode, errors.decode()


async def test_drive_fails_when_every_request_failed_and_names_the_flag(
    tmp_path: Path, unused_tcp_port: int, aiohttp_server
):
    """A driver that got no usable answer at all did not drive anything: exit 1, with the
    flag to look at, whether nothing answered or the server refused every request."""
    scenario_file = tmp_path / "small.yaml"
    scenario_file.write_text(yaml.safe_dump(SMALL))
    code, errors = await run_drive(scenario_file, f"http://{HOST}:{unused_tcp_port}")
    assert code == 1, errors
    assert (
        "drive: all 6 request(s) failed (connect_error x6): no answer from "
        f"http://{HOST}:{unused_tcp_port}: is the server up, and is --drive.base-url its "
        "address?" in errors
    )
    refusing = await aiohttp_server(aiohttp.web.Application())  # 404 for every path
    code, errors = await run_drive(scenario_file, str(refusing.make_url("")))
    assert code == 1, errors
    assert "all 6 request(s) failed (404 x6)" in errors
    assert "is --drive.base-url an OpenAI-compatible server" in errors


@pytest.mark.parametrize(
    "argv, message",
    [
        (["simulate", "--scenario", "nope"], "unknown scenario"),
        (["simulate", "--sim.block-size", "0"], "block_size"),
        (["simulate", "--sim.listen-address", "nowhere"], "HOST:PORT"),
        (["drive", "--scenario", "nope"], "unknown scenario"),
        (["drive", "--speed", "0"], "--speed"),
        (["demo", "--scenario", "nope"], "unknown scenario"),
        (["demo", "--speed", "-1"], "--speed"),
    ],
)
async def test_bad_flags_exit_2_with_a_clear_message(argv, message):
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "exporter", *argv, stderr=asyncio.subprocess.PIPE
    )
    _, errors = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2
    assert message in errors.decode()
