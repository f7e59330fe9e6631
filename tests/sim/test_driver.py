"""The traffic driver reports what a proxy would: usage from the response (from the final
chunk of a stream), cached_tokens null when vLLM did not report it, TTFT measured at the
client, the caller's identity on every request, and delivery that survives an exporter that
is down for a while."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from exporter.sim.client import Completion, HttpClient, StreamReader
from exporter.sim.clock import SimClock, run_virtual
from exporter.sim.driver import Driver, without_userinfo
from exporter.sim.report import HttpReporter, ListReporter, usage_event
from exporter.sim.scenario import parse_scenario
from exporter.sim.server import SPEED_HEADER
from exporter.usage.event import validate
from exporter.values import status_is_error
from tests.helpers import fixture_text

CAPTURE = "vllm-0.32.0-cpu"


def test_event_from_a_response_with_details():
    usage = json.loads(fixture_text(f"{CAPTURE}/02_chat_warm.json"))["usage"]
    event = usage_event("agent-a", "s1", Completion(200, "tiny-llama", usage, 1.25), 1000.0)
    assert event == {
        "caller": "agent-a",
        "session": "s1",
        "model": "tiny-llama",
        "prompt_tokens": 1396,
        "cached_tokens": 1376,
        "completion_tokens": 8,
        "ttft_seconds": 1.25,
        "status": 200,
        "time": 1000.0,
    }
    assert validate(event).cached_tokens == 1376


def test_cached_tokens_is_null_never_zero_when_vllm_did_not_report_it():
    usage = {
        "prompt_tokens": 500,
        "completion_tokens": 3,
        "total_tokens": 503,
        "prompt_tokens_details": None,
    }
    event = usage_event("a", None, Completion(200, "m", usage, None), 1.0)
    assert "cached_tokens" in event and event["cached_tokens"] is None
    assert "ttft_seconds" not in event  # a non-streamed response has no measurable TTFT
    assert validate(event).cached_tokens is None


def test_the_driver_names_the_vllm_it_sends_to():
    """The event's backend is the driver's base URL without credentials, so the exporter
    counts the caller under that vLLM's target."""
    usage = {"prompt_tokens": 500, "prompt_tokens_details": {"cached_tokens": 480}}
    backend = without_userinfo("http://user:pw@vllm-3:8000/v1")
    assert backend == "http://vllm-3:8000/v1"
    event = usage_event("a", None, Completion(200, "m", usage, None), 1.0, None, backend)
    assert validate(event).backend == "http://vllm-3:8000/v1"
    assert "backend" not in usage_event("a", None, Completion(200, "m", usage, None), 1.0)


def test_errors_are_reported_with_their_status_and_a_missing_usage_is_not_invented():
    error = usage_event("a", "s", Completion(503, error="busy"), 1.0)
    assert error["status"] == 503 and "prompt_tokens" not in error
    assert status_is_error(validate(error).status)
    assert status_is_error(validate(usage_event("a", "s", Completion("connect_error"), 1.0)).status)
    # a stream without include_usage: nothing to report, so nothing is made up
    assert usage_event("a", "s", Completion(200, "m", None, 0.5, "text"), 1.0) is None


@pytest.mark.parametrize(
    "name, text",
    [
        ("03_chat_stream_warm.sse.txt", " informationvent"),
        ("06_completion_stream.sse.txt", " algorith"),
    ],
)
def test_stream_reader_takes_usage_from_the_final_chunk(name, text):
    reader = StreamReader()
    firsts = []
    for line in fixture_text(f"{CAPTURE}/{name}").splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            firsts.append(reader.feed(json.loads(line[5:])))
    assert firsts[0] is True and not any(firsts[1:])  # TTFT: the first chunk with a choice
    assert reader.usage["prompt_tokens_details"]["cached_tokens"] in (1376, 1344)
    assert reader.text == text and reader.model == "tiny-llama"


@pytest.mark.parametrize(
    "name", ["12_chat_metrics_cold.json", "13_chat_stream_metrics_warm.sse.txt"]
)
async def test_vllms_per_request_metrics_are_reported_as_the_engines_timings(aiohttp_server, name):
    """A proxy that reads vLLM's metrics object (--enable-per-request-metrics), whole or on
    the stream's usage chunk, hands on vLLM's own TTFT and queue wait."""
    raw = fixture_text(f"{CAPTURE}/{name}")
    stream = name.endswith(".sse.txt")

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream" if stream else "application/json"}
        )
        await response.prepare(request)
        await response.write(raw.encode())
        return response

    client = HttpClient(await stub_vllm(aiohttp_server, handler))
    try:
        completion = await client.send("chat", {"messages": [], "stream": stream}, "agent-a")
    finally:
        await client.close()
    sent = (
        next(json.loads(line[5:]) for line in raw.splitlines() if '"metrics"' in line)
        if stream
        else json.loads(raw)
    )
    event = usage_event("agent-a", None, completion, 1.0)
    assert event["engine_ttft_seconds"] == sent["metrics"]["time_to_first_token_ms"] / 1000
    assert event["engine_queue_seconds"] == sent["metrics"]["queue_time_ms"] / 1000
    accepted = validate(event)
    assert accepted.engine_ttft_seconds == event["engine_ttft_seconds"]
    without = usage_event("a", None, Completion(200, "m", completion.usage, None), 1.0)
    assert "engine_ttft_seconds" not in without and "engine_queue_seconds" not in without


async def stub_vllm(aiohttp_server, handler) -> str:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v1/completions", handler)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def test_http_client_sends_the_caller_and_reads_a_real_stream(aiohttp_server):
    seen: list[tuple[str | None, Any]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append((request.headers.get("X-Caller"), (await request.json()).get("user")))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", SPEED_HEADER: "1000"}
        )
        await response.prepare(request)
        await response.write(fixture_text(f"{CAPTURE}/03_chat_stream_warm.sse.txt").encode())
        return response

    client = HttpClient(await stub_vllm(aiohttp_server, handler) + "/v1")
    try:
        completion = await client.send("chat", {"messages": [], "stream": True}, "agent-a")
    finally:
        await client.close()
    assert seen == [("agent-a", "agent-a")]
    assert completion.ok and completion.usage["prompt_tokens"] == 1396
    assert completion.ttft_seconds is not None and completion.ttft_seconds > 0


async def test_http_client_errors_become_statuses(aiohttp_server, unused_tcp_port):
    async def handler(_request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "engine dead", "code": 500}}, status=500)

    client = HttpClient(await stub_vllm(aiohttp_server, handler))
    down = HttpClient(f"http://127.0.0.1:{unused_tcp_port}")
    try:
        failed = await client.send("completion", {"prompt": "x"}, "a")
        refused = await down.send("completion", {"prompt": "x"}, "a")
    finally:
        await client.close()
        await down.close()
    assert failed.status == 500 and failed.error == "engine dead"
    assert refused.status == "connect_error" and not refused.ok


async def test_reporter_retries_until_the_exporter_is_back(aiohttp_server):
    received: list[dict[str, Any]] = []
    outages = {"left": 2}

    async def usage(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == "Bearer s3cret"
        if outages["left"]:
            outages["left"] -= 1
            return web.Response(status=503)
        received.extend(await request.json())
        return web.json_response({"accepted": 1})

    app = web.Application()
    app.router.add_post("/v1/usage", usage)
    server = await aiohttp_server(app)
    reporter = HttpReporter(str(server.make_url("/")), token="s3cret", retry_seconds=(0.01,))
    for index in range(5):
        reporter.report({"caller": "a", "prompt_tokens": index})
    await reporter.close()
    assert [event["prompt_tokens"] for event in received] == [0, 1, 2, 3, 4]
    assert reporter.failures == 2 and reporter.sent == 5 and not reporter.pending


async def test_reporter_drops_what_the_exporter_refuses_and_bounds_its_queue(aiohttp_server):
    async def usage(_request: web.Request) -> web.Response:
        return web.json_response({"error": "unauthorized"}, status=401)

    app = web.Application()
    app.router.add_post("/v1/usage", usage)
    server = await aiohttp_server(app)
    reporter = HttpReporter(str(server.make_url("/v1/usage")), retry_seconds=(0.01,), max_pending=3)
    for index in range(5):
        reporter.report({"caller": "a", "prompt_tokens": index})
    assert len(reporter.pending) == 3 and reporter.dropped == 2
    await reporter.close()
    assert reporter.sent == 0 and reporter.dropped == 5 and not reporter.pending


class EchoClient:
    """Answers every request at once with a fixed reply; records what was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any], str]] = []

    async def send(
        self, kind: str, body: dict[str, Any], caller: str, session: str | None = None
    ) -> Completion:
        self.sent.append((kind, json.loads(json.dumps(body)), caller))
        usage = {
            "prompt_tokens": 10,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        return Completion(200, "m", usage, 0.1, f" reply{len(self.sent)}")

    async def close(self) -> None:
        return None


def test_conversations_resend_their_history_with_each_reply():
    scenario = parse_scenario(
        {
            "name": "t",
            "agents": [
                {
                    "caller": "solo",
                    "context_tokens": 30,
                    "input_tokens": 5,
                    "output_tokens": 2,
                    "turns": 3,
                    "think_seconds": 60,
                }
            ],
        },
        "test",
    )
    client = EchoClient()

    async def main() -> tuple[ListReporter, float]:
        clock = SimClock()
        reporter = ListReporter(clock.now)
        await Driver(scenario, client, reporter, clock, "m").run()
        return reporter, clock.now()

    reporter, elapsed = run_virtual(main())
    assert elapsed == 120  # two think times, in virtual time
    messages = [body["messages"] for _, body, _ in client.sent]
    assert [len(m) for m in messages] == [2, 4, 6]
    assert messages[1][2] == {"role": "assistant", "content": " reply1"}
    assert messages[2][:4] == messages[1]  # the history is resent unchanged
    assert messages[0][1]["content"] != messages[1][3]["content"]
    assert {caller for _, _, caller in client.sent} == {"solo"}
    assert all(
        body["stream"] and body["stream_options"] == {"include_usage": True}
        for _, body, _ in client.sent
    )
    sessions = {event["session"] for _, event in reporter.events}
    assert sessions == {"solo/0"} and len(reporter.events) == 3


async def test_http_client_reads_stream_lines_of_any_length(aiohttp_server):
    big = {"choices": [{"index": 0, "delta": {"content": "x" * 200_000}}], "model": "m"}
    last = {
        "choices": [],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in (big, last):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]")  # no final newline
        return response

    client = HttpClient(await stub_vllm(aiohttp_server, handler))
    try:
        completion = await client.send("chat", {"messages": [], "stream": True}, "a")
    finally:
        await client.close()
    assert len(completion.text) == 200_000 and completion.usage["prompt_tokens"] == 5


def test_loop_starts_again_with_new_conversations():
    from exporter.sim.virtual import play

    scenario = parse_scenario(
        {
            "name": "t",
            "engine": {
                "enable_prompt_tokens_details": True,
                "block_size": 16,
                "prefill_rate": 5000.0,
            },
            "agents": [
                {
                    "caller": "x",
                    "context_tokens": 500,
                    "input_tokens": 50,
                    "turns": 2,
                    "output_tokens": 10,
                }
            ],
        },
        "test",
    )
    run = play(scenario, iterations=2)
    events = [event for _, event in run.events]
    assert [event["session"] for event in events] == ["x/0", "x/0", "x/1", "x/1"]
    # each iteration is a fresh conversation: its first turn finds nothing cached
    assert [event["cached_tokens"] > 0 for event in events] == [False, True, False, True]


class FailingEvery:
    """EchoClient's answers, but every ``nth`` request is refused (HTTP 503)."""

    def __init__(self, nth: int) -> None:
        self.echo = EchoClient()
        self.nth = nth

    async def send(
        self, kind: str, body: dict[str, Any], caller: str, session: str | None = None
    ) -> Completion:
        completion = await self.echo.send(kind, body, caller)
        if len(self.echo.sent) % self.nth == 0:
            return Completion(503, None, None, None, error="busy")
        return completion

    async def close(self) -> None:
        return None


def test_drive_says_how_it_is_going_every_interval(caplog):
    """`drive` is not silent while it runs: every interval an info line with the requests
    sent, reported and failed so far and the scenario time, each a field of its own (so a
    logfmt or JSON reader can pick them out); in virtual time, so the instants are exact."""
    import logging

    from exporter import logs
    from exporter.sim.driver import Progress

    scenario = parse_scenario(
        {
            "name": "t",
            "agents": [
                {
                    "caller": "solo",
                    "context_tokens": 30,
                    "input_tokens": 5,
                    "output_tokens": 2,
                    "turns": 4,
                    "think_seconds": 60,
                }
            ],
        },
        "test",
    )

    async def main() -> None:
        clock = SimClock(speed=2.0)  # scenario time runs at twice the loop's
        driver = Driver(scenario, FailingEvery(3), ListReporter(clock.now), clock, "m")
        progress = asyncio.ensure_future(Progress(driver, interval=25.0).run())
        await driver.run()  # turns at scenario 0, 60, 120, 180: loop seconds 0, 30, 60, 90
        progress.cancel()

    with caplog.at_level(logging.INFO, logger="exporter.sim.driver"):
        run_virtual(main())
    lines = [record for record in caplog.records if hasattr(record, "requests")]
    seen = [
        (record.scenario_seconds, record.requests, record.reported, record.failed)
        for record in lines
    ]
    # at loop seconds 25, 50, 75 (scenario 50, 100, 150); the driver ends at 90. The refused
    # third request is reported too (as a failure: the exporter counts it as state="error").
    assert seen == [(50.0, 1, 1, 0), (100.0, 2, 2, 0), (150.0, 3, 3, 1)]
    assert all(record.levelno == logging.INFO for record in lines)
    assert lines[1].getMessage() == (
        "2 request(s) sent, 2 reported, 0 failed, scenario time 1:40, 0 full iteration(s)"
    )
    logfmt = logs.formatter("logfmt").format(lines[-1])
    assert " requests=3 reported=3 failed=1 " in logfmt and "scenario_seconds=150.0" in logfmt
    as_json = json.loads(logs.formatter("json").format(lines[-1]))
    assert (as_json["requests"], as_json["failed"], as_json["level"]) == (3, 1, "info")


def test_progress_counts_what_reached_the_exporter():
    """With an exporter to report to, the line also says how many events it took, how many
    wait and how many it refused (the reporter's own counts)."""
    from exporter.sim.driver import Progress

    scenario = parse_scenario({"name": "t", "agents": [{"caller": "solo", "turns": 1}]}, "test")
    reporter = HttpReporter("http://127.0.0.1:9")
    reporter.sent, reporter.dropped = 7, 2
    reporter.pending.extend([{}, {}, {}])

    async def main() -> dict[str, Any]:
        return Progress(Driver(scenario, EchoClient(), reporter, SimClock(), "m"), 10).fields()

    fields = run_virtual(main())
    assert (fields["delivered"], fields["pending"], fields["dropped"]) == (7, 3, 2)


def test_progress_interval_zero_is_silent():
    from exporter.sim.driver import Progress

    scenario = parse_scenario({"name": "t", "agents": [{"caller": "solo", "turns": 1}]}, "test")

    async def main() -> None:
        clock = SimClock()
        driver = Driver(scenario, EchoClient(), ListReporter(clock.now), clock, "m")
        await asyncio.wait_for(Progress(driver, 0).run(), 1)  # returns at once

    run_virtual(main())


def test_the_progress_line_docs_demo_md_shows_is_the_one_drive_writes():
    """docs/demo.md's example line, from a driver at the figures it shows: the same message
    and fields, in the same order (the time aside)."""
    import logging
    import re
    from pathlib import Path

    from exporter import logs
    from exporter.sim.driver import Progress

    doc = (Path(__file__).resolve().parents[2] / "docs" / "demo.md").read_text("utf-8")
    shown = re.search(
        r"^time=\S+ (level=info source=exporter\.sim\.driver msg=.*)$", doc, flags=re.M
    )
    assert shown, "docs/demo.md has no progress line"
    scenario = parse_scenario({"name": "t", "agents": [{"caller": "solo", "turns": 1}]}, "test")
    reporter = HttpReporter("http://127.0.0.1:9")
    reporter.sent = 39
    reporter.pending.extend([{}, {}])
    records: list[logging.LogRecord] = []

    async def main() -> None:
        clock = SimClock(speed=10.0)
        driver = Driver(scenario, EchoClient(), reporter, clock, "m")
        driver.stats.requests = driver.stats.reported = 41
        clock.now()
        await asyncio.sleep(75.0)  # virtual: 750 scenario seconds
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logger = logging.getLogger("exporter.sim.driver")
        logger.addHandler(handler)
        old_level = logger.level
        logger.setLevel(logging.INFO)
        try:
            Progress(driver, 10).log()
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)

    run_virtual(main())
    written = logs.formatter("logfmt").format(records[0])
    assert written.split(" ", 1)[1] == shown.group(1)
