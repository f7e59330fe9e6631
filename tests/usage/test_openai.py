"""The one reader of OpenAI-shaped bodies, on the real vLLM 0.32.0 captures: what the tap
reads from a live answer and what the `openai` format reads from a logged one are the same
function, so each shape is checked once here."""

from __future__ import annotations

import json

import pytest

from exporter.usage.event import InvalidEvent
from exporter.usage.openai import StreamReader, Usage, parse_usage, read_response, usage_of
from tests.helpers import FIXTURES

CAPTURES = FIXTURES / "vllm-0.32.0-cpu"

# capture -> (prompt, cached, completion, model), as the capture's own usage says
EXPECTED = {
    "01_chat_cold.json": (1395, 0, 8),
    "02_chat_warm.json": (1396, 1376, 8),
    "03_chat_stream_warm.sse.txt": (1396, 1376, 8),
    "05_completion_repeat.json": (1373, 1344, 8),
    "06_completion_stream.sse.txt": (1373, 1344, 8),
    "08_completion_no_shared_prefix.json": (221, 0, 8),
    "09_responses_stream_warm.sse.txt": (268, 256, 4),
    "10_responses_warm.json": (268, 256, 4),
}


@pytest.mark.parametrize("capture", sorted(EXPECTED))
def test_every_capture_read_as_logged(capture):
    prompt, cached, completion = EXPECTED[capture]
    text = (CAPTURES / capture).read_text(encoding="utf-8")
    read = read_response(text)
    assert read.usage == Usage(prompt, completion, cached)
    assert read.model == "tiny-llama"
    if capture.endswith(".json"):  # the same body, already decoded by the proxy
        assert read_response(json.loads(text)).usage == read.usage


@pytest.mark.parametrize("capture", [name for name in sorted(EXPECTED) if "sse" in name])
def test_a_stream_read_live_gives_what_the_logged_stream_gives(capture):
    raw = (CAPTURES / capture).read_bytes()
    reader = StreamReader(strip_usage_chunk=False, started=0.0)
    for start in range(0, len(raw), 97):  # chunk boundaries that cut events anywhere
        reader.feed(raw[start : start + 97], float(start))
    assert reader.usage == read_response(raw).usage
    assert reader.model == "tiny-llama" and reader.problems == []


@pytest.mark.parametrize(
    "usage, expected",
    [
        (
            {
                "prompt_tokens": 100,
                "completion_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 64},
            },
            Usage(100, 5, 64),
        ),
        ({"prompt_tokens": 100, "prompt_tokens_details": None}, Usage(100, None, None)),
        (
            {
                "input_tokens": 268,
                "output_tokens": 4,
                "input_tokens_details": {"cached_tokens": 256},
            },
            Usage(268, 4, 256),
        ),
        # Anthropic-style (LiteLLM and some gateways translate to it): input_tokens excludes both
        # cache fields, so the prompt is their sum and the cache read is what was cached.
        (
            {
                "input_tokens": 10,
                "cache_read_input_tokens": 2048,
                "cache_creation_input_tokens": 100,
                "output_tokens": 7,
            },
            Usage(2158, 7, 2048),
        ),
        ({"input_tokens": 10, "cache_creation_input_tokens": 100}, Usage(110, None, None)),
    ],
)
def test_every_usage_shape(usage, expected):
    assert parse_usage(usage) == expected


@pytest.mark.parametrize(
    "usage, reason",
    [
        ({"completion_tokens": 5}, "missing_prompt_tokens"),
        ({"prompt_tokens": "100"}, "not_a_number"),
        ({"prompt_tokens": -1}, "negative"),
        ({"prompt_tokens": 2**1024}, "too_large"),
        (
            {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}},
            "cached_exceeds_prompt",
        ),
        ({"input_tokens": 1, "cache_read_input_tokens": -5}, "negative"),
    ],
)
def test_unusable_numbers_have_the_reasons_every_reader_uses(usage, reason):
    with pytest.raises(InvalidEvent) as caught:
        parse_usage(usage)
    assert caught.value.reason == reason


def test_a_responses_api_stream_event_carries_its_usage_in_the_response():
    event = {
        "type": "response.completed",
        "response": {"model": "tiny-llama", "usage": {"input_tokens": 9, "output_tokens": 1}},
    }
    assert usage_of(event) == (Usage(9, 1, None), "tiny-llama")


def test_no_usage_is_none_never_zero():
    assert usage_of({"choices": []}) == (None, None)
    assert read_response({"model": "m"}).usage is None
