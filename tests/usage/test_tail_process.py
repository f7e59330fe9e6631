"""Many followed files against the exporter as deployed (issue 29, fails 5 and 6): a real
process under a descriptor limit of 256, a glob over 2,000 files, a burst of new files with
a backlog each. /metrics and /-/healthy answer throughout, every event is counted exactly
once, and the descriptors held stay within the followed files' share."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp

from tests.helpers import value
from tests.test_hostile_process import scrape, start_exporter, stop

IDLE_FILES = 2000
NEW_FILES = 40
NEW_LINES = 2000  # about 90 KB a file, 3.5 MB in all: many read steps
NOFILE = 256


def event(caller: str, seq: int) -> str:
    return (
        json.dumps(
            {"caller": caller, "model": "m", "prompt_tokens": 4096 + seq, "cached_tokens": 2048}
        )
        + "\n"
    )


async def test_many_files_under_a_low_descriptor_limit_are_read_exactly(tmp_path: Path):
    rng = random.Random(29)
    idle = [tmp_path / f"idle-{index:05d}.jsonl" for index in range(IDLE_FILES)]
    for path in idle:
        path.write_text(event("before", 0))  # there at start: never counted
    process, base = await start_exporter(
        "--usage.file",
        str(tmp_path / "*.jsonl"),
        "--usage.file.poll-interval",
        "0.2",
        nofile=NOFILE,
    )
    try:
        text = await scrape(base)
        share = value(text, "vllm_cache_exporter_fds_reserved", use="files")
        assert share is not None and value(text, "vllm_cache_usage_files_open_max") == share
        woken = rng.sample(idle, 200)  # idle files written again: opened where they ended
        for index, path in enumerate(woken):
            with path.open("a") as handle:
                handle.write(event("woke", index))
        for index in range(NEW_FILES):  # a burst of new files, each with a backlog
            (tmp_path / f"new-{index:02d}.jsonl").write_text(
                "".join(event(f"new-{index % 4}", seq) for seq in range(NEW_LINES))
            )
        expected = len(woken) + NEW_FILES * NEW_LINES
        slowest, fds, text = await count_until(base, expected)
        for index, path in enumerate(woken):  # again: closed since, each is reopened
            with path.open("a") as handle:
                handle.write(event("woke", len(woken) + index))
        slowest_again, fds_again, text = await count_until(base, expected + len(woken))
        slowest, fds = max(slowest, slowest_again), fds + fds_again
        assert slowest < 1.0  # liveness: never held behind the backlog (bench: < 100 ms)
        assert max(fds) < NOFILE - 32  # the files' share, far from the limit
        assert value(text, "vllm_cache_usage_files", state="open") <= share
        assert (
            value(text, "vllm_cache_usage_files", state="open")
            + value(text, "vllm_cache_usage_files", state="closed")
            == IDLE_FILES + NEW_FILES
        )
        assert value(text, "vllm_cache_usage_file_reopens_total") >= len(woken) - share
        assert value(text, "vllm_cache_usage_file_lost_bytes_total", reason="gone_unread") == 0
        # Each file's events once: the per-caller totals are exact too.
        assert value(text, "vllm_cache_prompt_tokens_total", caller="woke", model="m") == sum(
            4096 + index for index in range(2 * len(woken))
        )
        assert (
            value(
                text,
                "vllm_cache_usage_events_rejected_total",
                reader="file",
                reason="malformed_json",
            )
            is None
        )
    finally:
        await stop(process)


async def count_until(base: str, expected: int) -> tuple[float, list[float], str]:
    """Probe /-/healthy and /metrics until the file reader has counted ``expected`` events
    (never more): the slowest /-/healthy answer, the open descriptors seen, the last text."""
    slowest = 0.0
    fds: list[float] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    async with aiohttp.ClientSession() as session:
        while True:  # another process: probe it until it has counted everything
            started = time.monotonic()
            async with session.get(f"{base}/-/healthy") as response:
                assert response.status == 200
            slowest = max(slowest, time.monotonic() - started)
            text = await scrape(base)
            fds.append(value(text, "process_open_fds") or 0)
            counted = value(text, "vllm_cache_usage_events_total", reader="file")
            if counted == expected:
                return slowest, fds, text
            assert counted is not None and counted < expected, counted
            assert loop.time() < deadline, (counted, expected)
            await asyncio.sleep(0.05)
