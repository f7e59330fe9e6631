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
from aiohttp import web

from tests.helpers import value
from tests.tap.conftest import fixture_bytes, sse_events
from tests.test_run_process import free_port

NESTED = "[" * 100_000 + "]" * 100_000
GOOD = {"caller": "alice", "model": "m", "prompt_tokens": 4096, "cached_tokens": 2048}


# Runs the exporter under a hard and soft descriptor limit of argv[1] (set before exec, so
# the exporter starts under it: no preexec_fn in a threaded test process).
UNDER_NOFILE = (
    "import os, resource, sys; limit = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)); "
    "os.execv(sys.executable, [sys.executable, '-m', 'exporter', *sys.argv[2:]])"
)


async def start_exporter(
    *flags: str,
    nofile: int | None = None,
) -> tuple[asyncio.subprocess.Process, str]:
    port = free_port()
    prefix = (
        (sys.executable, "-c", UNDER_NOFILE, str(nofile))
        if nofile is not None
        else (sys.executable, "-m", "exporter")
    )
    process = await asyncio.create_subprocess_exec(
        *prefix,
        "--web.listen-address",
        f"127.0.0.1:{port}",
        "--log.level",
        "warning",
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
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
    flags = (
        "--usage.file",
        str(path),
        "--usage.file.from-start",
        "--usage.file.poll-interval",
        "0.05",
    )
    for _restart in range(2):  # replayed from the start on every restart: no crash loop
        process, base = await start_exporter(*flags)
        try:
            text = await wait_for_metric(base, "vllm_cache_usage_events_total", 2, reader="file")
            assert (
                value(
                    text,
                    "vllm_cache_usage_events_rejected_total",
                    reader="file",
                    reason="malformed_json",
                )
                == 1
            )
        finally:
            await stop(process)


async def test_sigterm_during_a_long_ingest_exits_within_the_drain_time():
    process, base = await start_exporter()
    body = (
        "\n".join(json.dumps({**GOOD, "caller": f"c{index % 50}"}) for index in range(200_000))
    ).encode()  # ~15 MB, seconds to process
    async with aiohttp.ClientSession() as session:
        posting = asyncio.ensure_future(session.post(f"{base}/v1/usage", data=body))
        await asyncio.sleep(1.0)  # the body is being processed (no event visible from here)
        took = await stop(process)
        posting.cancel()
    assert took < 8.0, f"exited {took:.1f} s after SIGTERM (drain is 5 s)"


# --- descriptors (issue 29) ---------------------------------------------------------------


async def test_streaming_tap_calls_never_run_the_descriptors_out(tmp_path: Path, aiohttp_server):
    """The issue's case, under a hard limit of 256 rather than 1,024: more streaming tap calls
    at once than the descriptors could hold (each also holds a socket to vLLM), with a usage
    file followed too. Of the 192 descriptors left after the process's own 64, the files get
    24 and the two listeners the same fraction of what they ask for (512 connections each,
    and their slack): the tap serves 49 connections and 7 of slack, 112 descriptors. The
    calls it serves stream and are all counted; the rest are closed to make room (at the
    cap the oldest connection goes, and one still sending its request goes at once) or
    answered 503, and counted; /metrics and /-/healthy answer throughout; nothing in the
    log says the descriptors ran out."""
    events = sse_events(fixture_bytes("03_chat_stream_warm.sse.txt"))
    release = asyncio.Event()
    streaming = 0

    async def stream(request: web.Request) -> web.StreamResponse:
        nonlocal streaming
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(events[0])
        streaming += 1
        await release.wait()
        try:
            for event in events[1:]:
                await response.write(event)
            await response.write_eof()
        except ConnectionError:  # the tap went away at the end of the test
            pass
        return response

    upstream_app = web.Application()
    upstream_app.router.add_post("/v1/chat/completions", stream)
    upstream = await aiohttp_server(upstream_app)
    tap_port = free_port()
    usage_file = tmp_path / "usage.jsonl"
    usage_file.write_text("")
    process, base = await start_exporter(
        "--tap.listen-address",
        f"127.0.0.1:{tap_port}",
        "--tap.upstream",
        str(upstream.make_url("")).rstrip("/"),
        "--usage.file",
        str(usage_file),
        nofile=256,
    )
    calls = 120
    try:
        text = await scrape(base)
        assert value(text, "vllm_cache_exporter_connections_max", listener="tap") == 49
        assert value(text, "vllm_cache_exporter_fds_reserved", use="tap") == 112
        assert value(text, "vllm_cache_exporter_fds_reserved", use="files") == 24
        reserved = sum(
            value(text, "vllm_cache_exporter_fds_reserved", use=use) or 0
            for use in ("web", "tap", "files", "process")
        )
        assert reserved == value(text, "process_max_fds") == 256
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def call(index: int) -> int | str:
                try:
                    async with session.post(
                        f"http://127.0.0.1:{tap_port}/v1/chat/completions",
                        json={
                            "model": "tiny-llama",
                            "stream": True,
                            "messages": [],
                            "stream_options": {"include_usage": True},
                        },
                        headers={"X-Caller": f"agent-{index % 3}"},
                    ) as response:
                        await response.read()
                        return response.status
                except aiohttp.ClientError:
                    return "closed"

            pending = [asyncio.ensure_future(call(index)) for index in range(calls)]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while True:  # another process: poll its counts until every call is placed
                text = await scrape(base)
                placed = streaming + sum(
                    value(text, name, listener="tap") or 0
                    for name in (
                        "vllm_cache_exporter_connections_evicted_total",
                        "vllm_cache_exporter_connections_refused_total",
                    )
                )
                if streaming >= 49 and placed >= calls:
                    break
                assert loop.time() < deadline, (streaming, placed)
                await asyncio.sleep(0.05)
            for _ in range(5):  # every descriptor the tap may take is taken: still served
                started = time.monotonic()
                async with session.get(f"{base}/-/healthy") as response:
                    assert response.status == 200
                await scrape(base)
                assert time.monotonic() - started < 5
            release.set()
            statuses = await asyncio.wait_for(asyncio.gather(*pending), 60)
        served = statuses.count(200)
        assert served == streaming and 49 <= served <= 56
        assert sorted(set(statuses) - {200}, key=str) in ([], ["closed"], [503], [503, "closed"])
        text = await wait_for_metric(base, "vllm_cache_usage_events_total", served, reader="tap")
        cut = sum(
            value(text, name, listener="tap") or 0
            for name in (
                "vllm_cache_exporter_connections_evicted_total",
                "vllm_cache_exporter_connections_refused_total",
            )
        )
        assert cut >= calls - served  # every call not served was counted as cut
        async with aiohttp.ClientSession() as session:  # and the tap serves again
            async with session.post(
                f"http://127.0.0.1:{tap_port}/v1/chat/completions",
                json={"model": "tiny-llama", "stream": True, "messages": []},
            ) as response:
                assert response.status == 200
                await response.read()
    finally:
        release.set()
        await stop_and_read(process)


async def stop_and_read(process: asyncio.subprocess.Process) -> None:
    process.send_signal(signal.SIGTERM)
    _out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    log = err.decode(errors="replace")
    assert process.returncode == 0, log[-2000:]
    assert "Too many open files" not in log and "EMFILE" not in log, log[-2000:]
    assert "Traceback" not in log, log[-2000:]
