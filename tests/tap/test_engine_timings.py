"""vLLM's own TTFT and queue wait (``--enable-per-request-metrics``), read by the tap from the
answers it already reads: captured from vLLM 0.32.0 with the flag, every byte still reaches
the client as vLLM sent it, and an answer without them is said once, in the log."""

from __future__ import annotations

import json
import logging

import pytest

from exporter.config import Config
from exporter.server import create_app
from exporter.wiring import signals_state, tap_app
from tests.helpers import value

from .conftest import Reply, fixture_bytes, sse_events, without_usage_chunk

SSE = "text/event-stream; charset=utf-8"
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
CHAT_STREAM = {**CHAT, "stream": True}
WHOLE = fixture_bytes("12_chat_metrics_cold.json")
STREAM = fixture_bytes("13_chat_stream_metrics_warm.sse.txt")
COMPLETION_STREAM = fixture_bytes("15_completion_stream_metrics.sse.txt")
ONE_TOKEN = fixture_bytes("14_completion_metrics_one_token.json")
N2 = fixture_bytes("16_chat_metrics_n2.json")
RESPONSES = fixture_bytes("17_responses_metrics.json")
RESPONSES_STREAM = fixture_bytes("18_responses_stream_metrics.sse.txt")
NOTICE = "without its per-request metrics"


def metrics_of(raw: bytes) -> dict:
    """The metrics object vLLM sent: on the body, else on the stream's usage event."""
    if raw.startswith(b"{"):
        return json.loads(raw)["metrics"]
    for event in sse_events(raw):
        if b'"metrics"' in event:
            data = json.loads(event.split(b"data: ", 1)[1])
            return data.get("metrics") or data["response"]["metrics"]
    raise AssertionError("no metrics in the capture")


def seconds(raw: bytes) -> tuple[float, float]:
    metrics = metrics_of(raw)
    return metrics["time_to_first_token_ms"] / 1000, metrics["queue_time_ms"] / 1000


async def test_a_whole_answer_passes_unchanged_and_gives_vllms_timings(upstream, start_tap):
    upstream.reply("/v1/chat/completions", Reply(body=WHOLE))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/chat/completions", CHAT, headers={"X-Caller": "a"})
    assert (status, body) == (200, WHOLE)  # the metrics object reaches the client too
    event = await tap.usage.next_event()
    assert (event.engine_ttft_seconds, event.engine_queue_seconds) == seconds(WHOLE)
    assert event.engine_ttft_seconds == 0.08914097599972592
    assert event.ttft_seconds is None  # the tap measures no TTFT on a whole answer
    assert (event.prompt_tokens, event.cached_tokens) == (342, 0)


async def test_a_stream_gives_vllms_timings_from_the_usage_chunk_the_tap_removes(
    upstream, start_tap
):
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=[STREAM]))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/chat/completions", CHAT_STREAM)
    # The client did not ask for usage: the chunk the tap asked for (and vLLM's metrics on
    # it) is removed, and nothing else.
    assert (status, body) == (200, without_usage_chunk(STREAM))
    event = await tap.usage.next_event()
    assert (event.engine_ttft_seconds, event.engine_queue_seconds) == seconds(STREAM)
    assert event.ttft_seconds is not None  # the tap's own, kept apart

    asked = {**CHAT_STREAM, "stream_options": {"include_usage": True}}
    status, _, body = await tap.post("/v1/chat/completions", asked)
    assert (status, body) == (200, STREAM)  # a client that asked gets the metrics as sent
    assert (await tap.usage.next_event()).engine_ttft_seconds == seconds(STREAM)[0]


@pytest.mark.parametrize("size", [1, 5, 97, 100_000])
async def test_any_chunking_reads_the_same_timings(upstream, start_tap, size):
    chunks = [COMPLETION_STREAM[i : i + size] for i in range(0, len(COMPLETION_STREAM), size)]
    upstream.reply("/v1/completions", Reply(content_type=SSE, chunks=chunks))
    tap = await start_tap()
    status, _, body = await tap.post(
        "/v1/completions", {"model": "tiny-llama", "prompt": "x", "stream": True}
    )
    assert (status, body) == (200, without_usage_chunk(COMPLETION_STREAM))
    event = await tap.usage.next_event()
    assert (event.engine_ttft_seconds, event.engine_queue_seconds) == seconds(COMPLETION_STREAM)
    assert tap.usage.rejected == []


async def test_the_responses_api_carries_them_on_the_response(upstream, start_tap):
    upstream.reply("/v1/responses", Reply(body=RESPONSES))
    tap = await start_tap()
    assert (await tap.post("/v1/responses", {"input": "x"}))[2] == RESPONSES
    event = await tap.usage.next_event()
    assert (event.engine_ttft_seconds, event.engine_queue_seconds) == seconds(RESPONSES)
    upstream.reply("/v1/responses", Reply(content_type=SSE, chunks=[RESPONSES_STREAM]))
    assert (await tap.post("/v1/responses", {"input": "x", "stream": True}))[2] == (
        RESPONSES_STREAM
    )
    event = await tap.usage.next_event()
    assert (event.engine_ttft_seconds, event.engine_queue_seconds) == seconds(RESPONSES_STREAM)


async def test_a_one_token_answer_has_a_ttft_and_no_inter_token_latency(upstream, start_tap):
    upstream.reply("/v1/completions", Reply(body=ONE_TOKEN))
    tap = await start_tap()
    await tap.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert metrics_of(ONE_TOKEN)["mean_itl_ms"] is None
    event = await tap.usage.next_event()
    assert (event.engine_ttft_seconds, event.engine_queue_seconds) == seconds(ONE_TOKEN)


async def test_an_answer_without_them_is_said_once_in_the_log(upstream, start_tap, caplog):
    """/metrics cannot say whether vLLM runs with --enable-per-request-metrics; the first
    answer without the object can (vLLM also leaves it out for n > 1)."""
    caplog.set_level(logging.WARNING, logger="exporter.usage.tap.proxy")
    tap = await start_tap()
    upstream.reply("/v1/chat/completions", Reply(body=WHOLE))
    await tap.post("/v1/chat/completions", CHAT)
    await tap.usage.next_event()
    assert NOTICE not in caplog.text  # vLLM sent them
    upstream.reply("/v1/chat/completions", Reply(body=N2))
    await tap.post("/v1/chat/completions", {**CHAT, "n": 2})
    event = await tap.usage.next_event()
    assert json.loads(N2)["metrics"] is None
    assert (event.engine_ttft_seconds, event.engine_queue_seconds) == (None, None)
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("01_chat_cold.json")))
    await tap.post("/v1/chat/completions", CHAT)
    await tap.usage.next_event()
    notices = [record for record in caplog.records if NOTICE in record.getMessage()]
    assert len(notices) == 1
    assert "--enable-per-request-metrics" in notices[0].getMessage()


async def test_a_failed_call_is_no_sign_of_the_flag_missing(upstream, start_tap, caplog):
    caplog.set_level(logging.WARNING, logger="exporter.usage.tap.proxy")
    upstream.reply(
        "/v1/chat/completions", Reply(status=400, body=fixture_bytes("11_chat_error_400.json"))
    )
    tap = await start_tap()
    assert (await tap.post("/v1/chat/completions", CHAT))[0] == 400
    assert (await tap.usage.next_event()).status == 400
    assert NOTICE not in caplog.text


@pytest.mark.parametrize(
    "figure,reason",
    [(-3.5, "negative"), ("12", "not_a_number"), (10**400, "too_large")],
    ids=["negative", "string", "huge"],
)
async def test_unusable_timings_are_counted_and_the_answer_still_delivered(
    upstream, start_tap, figure, reason
):
    answer = json.loads(WHOLE)
    answer["metrics"]["queue_time_ms"] = figure
    raw = json.dumps(answer).encode()
    upstream.reply("/v1/chat/completions", Reply(body=raw))
    events = sse_events(STREAM)
    usage_event = json.loads(events[-2][len(b"data: ") :])
    usage_event["metrics"]["time_to_first_token_ms"] = figure
    broken = [*events[:-2], b"data: " + json.dumps(usage_event).encode() + b"\n\n", events[-1]]
    upstream.reply("/v1/completions", Reply(content_type=SSE, chunks=broken))
    tap = await start_tap()
    assert (await tap.post("/v1/chat/completions", CHAT))[2] == raw
    status, _, body = await tap.post("/v1/completions", {"prompt": "x", "stream": True})
    # The usage chunk the tap asked for never reaches the client, readable or not.
    assert (status, body) == (200, b"".join([*events[:-2], events[-1]]))
    assert tap.usage.rejected.count(("tap", reason)) == 2
    assert tap.usage.events == []


async def test_the_per_caller_series_say_who_measured(upstream, aiohttp_client):
    """Through the real signals to /metrics: vLLM's figures under source="engine", equal to
    what vLLM sent; the tap's own TTFT of a stream without them under source="proxy"."""
    upstream.reply("/v1/chat/completions", Reply(body=WHOLE))
    upstream.reply(
        "/v1/completions",
        Reply(content_type=SSE, chunks=[fixture_bytes("06_completion_stream.sse.txt")]),
    )  # vLLM without the flag
    config = Config(tap_listen_address="127.0.0.1:0", tap_upstream=upstream.url)
    state = signals_state(config)
    assert state.usage is not None
    tap = await aiohttp_client(tap_app(config, state.usage))
    exporter = await aiohttp_client(create_app(config, state, initial_refresh=False))
    headers = {"X-Caller": "alice"}
    assert (await tap.post("/v1/chat/completions", json=CHAT, headers=headers)).status == 200
    response = await tap.post(
        "/v1/completions", json={"prompt": "x", "stream": True}, headers=headers
    )
    await response.read()
    text = await (await exporter.get("/metrics")).text()
    alice = {"caller": "alice", "model": "tiny-llama"}
    ttft, queue = seconds(WHOLE)
    engine = {**alice, "source": "engine"}
    assert value(text, "vllm_cache_ttft_seconds_sum", state="cold", **engine) == ttft
    assert value(text, "vllm_cache_ttft_seconds_count", state="cold", **engine) == 1
    assert value(text, "vllm_cache_queue_wait_seconds_sum", **engine) == queue
    assert value(text, "vllm_cache_ttft_seconds_count", state="warm", source="proxy", **alice) == 1
    assert (
        value(text, "vllm_cache_ttft_seconds_count", state="cold", source="proxy", **alice) is None
    )
    assert value(text, "vllm_cache_queue_wait_seconds_count", source="proxy", **alice) is None


async def test_a_request_for_several_sequences_has_no_cached_count_of_its_own(upstream, start_tap):
    """For n > 1 vLLM reports the cached count of one of the n sequences, which may have
    found the blocks its siblings had just written (a first turn then reads as warm): the
    tap says how many sequences ran, and the signals do not judge the request by it."""
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("02_chat_warm.json")))
    tap = await start_tap()
    await tap.post("/v1/chat/completions", {**CHAT, "n": 2})
    event = await tap.usage.next_event()
    assert (event.prompt_tokens, event.cached_tokens, event.sequences) == (1396, 1376, 2)
    for n in (1, "2", None):  # n=1, and an n that is not a count: one sequence
        await tap.post("/v1/chat/completions", {**CHAT, "n": n})
        assert (await tap.usage.next_event()).sequences == 1
