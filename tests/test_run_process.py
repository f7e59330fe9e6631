"""The `run` command as a user starts it: a real process, a real port, SIGTERM to stop."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys

import aiohttp

from tests.helpers import value


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_run_serves_engine_signals_and_stops_on_sigterm(fake_vllm):
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "exporter",
        "--vllm.url",
        fake_vllm.url,
        "--web.listen-address",
        f"127.0.0.1:{port}",
        "--log.level",
        "warning",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with aiohttp.ClientSession() as session:
            deadline = asyncio.get_running_loop().time() + 30
            while True:  # no event to await across processes: poll readiness with a deadline
                try:
                    async with session.get(f"http://127.0.0.1:{port}/-/ready") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                assert asyncio.get_running_loop().time() < deadline, "exporter never ready"
                await asyncio.sleep(0.1)
            async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                text = await response.text()
        assert (
            value(
                text,
                "vllm_cache_engine_prefix_cache_hits_tokens_total",
                target=fake_vllm.url,
                model_name="tiny-llama",
                engine="0",
            )
            == 6784
        )
    finally:
        process.send_signal(signal.SIGTERM)
        _out, err = await asyncio.wait_for(process.communicate(), timeout=20)
    assert process.returncode == 0, err.decode()


async def test_busy_ports_fail_fast_with_a_clear_error(fake_vllm):
    """A tap that cannot bind must not leave a half-working exporter running."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        for flags in (
            ["--web.listen-address", f"127.0.0.1:{busy_port}"],
            [
                "--web.listen-address",
                f"127.0.0.1:{free_port()}",
                "--tap.listen-address",
                f"127.0.0.1:{busy_port}",
                "--tap.upstream",
                "http://127.0.0.1:9",
            ],
        ):
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "exporter",
                "--vllm.url",
                fake_vllm.url,
                *flags,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            _out, err = await asyncio.wait_for(process.communicate(), timeout=30)
            assert process.returncode == 1, err.decode()
            assert str(busy_port) in err.decode().strip().splitlines()[-1]


async def test_a_busy_port_names_the_flag_that_chose_it(fake_vllm):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "exporter",
            "--vllm.url",
            fake_vllm.url,
            "--web.listen-address",
            f"127.0.0.1:{port}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    last = err.decode().strip().splitlines()[-1]
    assert process.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} (--web.listen-address)" in last, last


async def test_run_without_a_vllm_url_says_so(unused_tcp_port):
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "exporter",
        "--web.listen-address",
        f"127.0.0.1:{unused_tcp_port}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(process.stderr.readline(), timeout=30)
        while b"--vllm.url" not in line:
            line = await asyncio.wait_for(process.stderr.readline(), timeout=30)
        assert b"no --vllm.url" in line
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.communicate(), timeout=20)
