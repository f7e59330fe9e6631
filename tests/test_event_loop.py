"""``run``'s event loop: uvloop's by default, asyncio's with --no-web.uvloop or without uvloop."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp
import pytest
import uvloop

from exporter.cli import build_parser
from exporter.config import Config, build_config
from exporter.runtime import event_loop_name, run_to_completion
from tests.test_run_process import free_port


async def loop_type() -> type:
    return type(asyncio.get_running_loop())


def result_of(main, use_uvloop: bool):  # type: ignore[no-untyped-def]
    box = []

    async def keep() -> None:
        box.append(await main)

    run_to_completion(keep(), use_uvloop)
    return box[0]


def test_uvloop_by_default_and_asyncio_when_turned_off():
    assert Config().web_uvloop is True
    assert result_of(loop_type(), Config().web_uvloop) is uvloop.Loop
    off = build_config(build_parser().parse_args(["run", "--no-web.uvloop"]), {})
    assert off.web_uvloop is False
    ran_on = result_of(loop_type(), off.web_uvloop)
    assert ran_on is not uvloop.Loop and issubclass(ran_on, asyncio.BaseEventLoop)
    assert event_loop_name(False) == "asyncio"
    from_env = build_config(
        build_parser().parse_args(["run"]), {"VLLM_CACHE_EXPORTER_WEB_UVLOOP": "false"}
    )
    assert from_env.web_uvloop is False


def test_without_uvloop_installed_run_falls_back_to_asyncio(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert event_loop_name(True) == "asyncio"
    ran_on = result_of(loop_type(), True)
    assert ran_on is not uvloop.Loop and issubclass(ran_on, asyncio.BaseEventLoop)


@pytest.mark.parametrize(
    ("flags", "expected"), [((), b"uvloop"), (("--no-web.uvloop",), b"asyncio")]
)
async def test_run_says_which_loop_it_runs_on_serves_and_stops_cleanly(flags, expected):
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "exporter",
        "--web.listen-address",
        f"127.0.0.1:{port}",
        "--log.level",
        "info",
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(process.stderr.readline(), timeout=30)
        while b"event loop:" not in line:
            assert line, "the exporter exited without naming its event loop"
            line = await asyncio.wait_for(process.stderr.readline(), timeout=30)
        assert b' msg="event loop: ' + expected + b'"' in line, line  # logfmt
        async with aiohttp.ClientSession() as session:
            deadline = asyncio.get_running_loop().time() + 30
            while True:  # no event to await across processes: poll with a deadline
                try:
                    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                        if response.status == 200:
                            assert b"vllm_cache_usage_events_total" in await response.read()
                            break
                except aiohttp.ClientConnectionError:
                    pass
                assert asyncio.get_running_loop().time() < deadline, "exporter never served"
                await asyncio.sleep(0.1)
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.communicate(), timeout=20)
    assert process.returncode == 0
