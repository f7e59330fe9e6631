"""A stopping simulator (docker compose stop, Ctrl-C) must not wait for open streams."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp

from tests.test_run_process import free_port


async def test_sigterm_with_an_open_stream_exits_promptly():
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "exporter",
        "simulate",
        "--sim.listen-address",
        f"127.0.0.1:{port}",
        "--sim.decode-rate",
        "1",
        "--log.level",
        "warning",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    loop = asyncio.get_running_loop()
    try:
        async with aiohttp.ClientSession() as session:
            deadline = loop.time() + 30
            while True:  # across processes there is no event to await: poll with a deadline
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                assert loop.time() < deadline, "simulator never became healthy"
                await asyncio.sleep(0.1)
            body = {"model": "sim", "prompt": "hello " * 50, "max_tokens": 10_000, "stream": True}
            async with session.post(
                f"http://127.0.0.1:{port}/v1/completions", json=body
            ) as response:
                await response.content.readline()  # the stream is open and producing
                process.send_signal(signal.SIGTERM)
                started = loop.time()
                _out, err = await asyncio.wait_for(process.communicate(), timeout=15)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err.decode()
    assert loop.time() - started < 5  # 10,000 tokens at 1 token/s would take hours
