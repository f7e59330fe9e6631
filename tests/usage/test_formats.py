"""Each format, from real bodies (vLLM 0.32, LiteLLM 1.108.7) or type-faithful ones, through
the app."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporter.metrics import build_registry
from exporter.usage.event import InvalidEvent
from exporter.usage.formats import (
    LiteLLMFormat,
    MappingError,
    MappingFormat,
    OpenAIFormat,
    load_mapping,
)
from exporter.values import UsageEvent, status_is_error
from tests.helpers import FIXTURES, fixture_text
from tests.usage.conftest import value

VLLM = "vllm-0.32.0-cpu/"
LITELLM_RECORDED = "litellm/1.108.7/"
LITELLM_FIELDS = ("metadata.user_api_key_alias", "metadata.user_api_key_team_alias", "end_user")


def litellm_payloads() -> list[dict]:
    return json.loads((FIXTURES / "litellm" / "standard_logging_payloads.json").read_text())


def vllm_json(name: str) -> dict:
    return json.loads(fixture_text(VLLM + name))


def recorded_litellm(name: str) -> list[dict]:
    """A body LiteLLM 1.108.7's generic_api callback posted (NDJSON), one dict per payload."""
    text = fixture_text(f"{LITELLM_RECORDED}{name}.ndjson")
    return [json.loads(line) for line in text.splitlines()]


# ---- LiteLLM ---------------------------------------------------------------------------


def test_litellm_payloads_convert():
    convert = LiteLLMFormat(LITELLM_FIELDS)
    streamed, not_streamed, unreported, failed = (convert(p) for p in litellm_payloads())
    # max_tokens: what the request declared, kept by LiteLLM in model_parameters
    assert streamed == UsageEvent(
        "agent-research",
        "tiny-llama",
        1396,
        1376,
        8,
        0.5,
        None,
        None,
        1795992176.25,
        "success",
        max_tokens=8,
        backend="http://vllm:8000/v1",  # api_base: the vLLM LiteLLM sent the call to
    )
    # completionStartTime == endTime when not streamed: that is not a TTFT.
    assert not_streamed.caller == "platform"
    assert (not_streamed.prompt_tokens, not_streamed.cached_tokens) == (1395, 0)
    assert not_streamed.ttft_seconds is None
    assert unreported.caller == "customer-42" and unreported.cached_tokens is None
    assert status_is_error(failed.status)


def test_litellm_backend_is_its_api_base():
    """The replica the call went to: api_base, else hidden_params.api_base, without
    credentials; an unusable one is left out and the call still counts (without a target)."""
    convert = LiteLLMFormat(LITELLM_FIELDS)
    payload = litellm_payloads()[0]
    recorded = [convert(p) for p in recorded_litellm("readme-config") if p.get("api_base")]
    assert recorded and {event.backend for event in recorded} <= {
        "http://127.0.0.1:18100/v1",
        "http://127.0.0.1:18100/v1/chat/completions",
    }
    hidden = {**payload, "api_base": None, "hidden_params": {"api_base": "http://vllm-7:8000/v1"}}
    assert convert(hidden).backend == "http://vllm-7:8000/v1"
    secret = "sk-" + "Z9y8X7w6" * 4
    assert convert({**payload, "api_base": f"https://u:{secret}@vllm-3/v1"}).backend == (
        "https://vllm-3/v1"
    )
    for unusable in ("", "x" * 300, "http://vl\nlm", 8000, {"url": "http://v"}, None):
        event = convert({**payload, "api_base": unusable, "hidden_params": {}})
        assert event.backend is None and event.prompt_tokens == 1396


def test_backend_key_of_the_openai_and_mapping_formats():
    response = {"model": "m", "usage": {"prompt_tokens": 100, "prompt_tokens_details": {}}}
    event = OpenAIFormat()({"caller": "a", "response": response, "backend": "replica-7"})
    assert event.backend == "replica-7"
    mapping = MappingFormat(
        {"caller": "who", "prompt_tokens": "usage.prompt", "backend": "upstream.addr"}
    )
    record = {"who": "a", "usage": {"prompt": 10}, "upstream": {"addr": "http://10.0.0.7:8000"}}
    assert mapping(record).backend == "http://10.0.0.7:8000"
    with pytest.raises(InvalidEvent) as caught:  # the record's own key is held to the rule
        mapping({**record, "upstream": {"addr": "x" * 300}})
    assert caught.value.reason == "bad_backend"


def test_litellm_max_tokens_from_the_request_parameters():
    """The declared completion budget comes from model_parameters (max_tokens, else
    max_completion_tokens); none declared is unknown, and a bad one is refused like any
    other bad number."""
    convert = LiteLLMFormat(LITELLM_FIELDS)
    payload = litellm_payloads()[0]
    assert (
        convert({**payload, "model_parameters": {"max_completion_tokens": 65536}}).max_tokens
        == 65536
    )
    assert convert({**payload, "model_parameters": {"stream": True}}).max_tokens is None
    assert (
        convert(
            {key: value for key, value in payload.items() if key != "model_parameters"}
        ).max_tokens
        is None
    )
    with pytest.raises(InvalidEvent) as err:
        convert({**payload, "model_parameters": {"max_tokens": -5}})
    assert err.value.reason == "negative"


def test_litellm_caller_order_is_configurable():
    payload = litellm_payloads()[0]
    assert LiteLLMFormat(["end_user", "metadata.user_api_key_team_alias"])(payload).caller == (
        "platform"
    )
    with pytest.raises(InvalidEvent) as caught:
        LiteLLMFormat(["end_user"])(payload)
    assert caught.value.reason == "missing_caller"


def test_litellm_usage_falls_back_to_the_response_usage():
    payload = litellm_payloads()[0]
    payload["metadata"]["usage_object"] = None
    assert LiteLLMFormat(LITELLM_FIELDS)(payload).cached_tokens == 1376


@pytest.mark.parametrize("log_format", ["json_array", "ndjson", "single"])
async def test_litellm_generic_api_log_formats(usage_client, log_format):
    client, state = await usage_client(
        signals_granularity=32, usage_ingest_format="litellm", usage_ingest_token="tok"
    )
    payloads = litellm_payloads()
    if log_format == "json_array":
        bodies = [json.dumps(payloads)]
    elif log_format == "ndjson":
        bodies = ["\n".join(json.dumps(p) for p in payloads)]
    else:
        bodies = [json.dumps(p) for p in payloads]
    total = 0
    for body in bodies:
        response = await client.post(
            "/v1/usage",
            data=body,
            headers={"Authorization": "Bearer tok", "Content-Type": "application/json"},
        )
        assert response.status == 200, await response.text()
        total += (await response.json())["accepted"]
    assert total == 4
    registry = build_registry(state)
    assert (
        value(
            registry,
            "vllm_cache_requests_total",
            caller="agent-research",
            model="tiny-llama",
            state="warm",
        )
        == 1
    )
    assert (
        value(
            registry,
            "vllm_cache_requests_total",
            caller="platform",
            model="tiny-llama",
            state="cold",
        )
        == 1
    )
    assert (
        value(
            registry,
            "vllm_cache_requests_total",
            caller="customer-42",
            model="tiny-llama",
            state="unknown",
        )
        == 1
    )
    assert (
        value(
            registry,
            "vllm_cache_ttft_seconds_sum",
            caller="agent-research",
            model="tiny-llama",
            state="warm",
            source="proxy",
        )
        == 0.5
    )


# ---- LiteLLM 1.108.7, recorded from a real proxy (tests/fixtures/litellm/README.md) ---------


def test_recorded_litellm_payloads_convert():
    """The README's configuration: callers by `user`, by header and by key alias; the
    conversation from each of the three ways a client can name it."""
    convert = LiteLLMFormat(LITELLM_FIELDS)
    by_user, by_header, by_header_again, by_key, failed = (
        convert(p) for p in recorded_litellm("readme-config")
    )
    assert by_user == UsageEvent(
        "batch-summarizer",
        "Qwen/Qwen3-8B",
        173,
        0,
        4,
        None,
        None,
        "conv-a-0001",
        1796039881.622595,
        "success",
        max_tokens=4,
        # LiteLLM 1.108.7 logs the endpoint it called as api_base: its origin names the vLLM
        backend="http://127.0.0.1:18100/v1/chat/completions",
    )
    assert (by_header.caller, by_header.session, by_header.cached_tokens) == (
        "ide-assistant",
        "conv-b-0001",
        160,
    )
    assert by_header.ttft_seconds == pytest.approx(1796039882.612504 - 1796039882.551432)
    assert (by_header_again.session, by_header_again.prompt_tokens) == ("conv-b-0001", 184)
    # The key alias wins over the team alias; the session came as litellm_session_id.
    assert (by_key.caller, by_key.session, by_key.ttft_seconds) == (
        "research-agent",
        "conv-c-0001",
        None,
    )
    assert status_is_error(failed.status) and (failed.caller, failed.session) == (
        "batch-summarizer",
        "conv-a-0001",
    )


def test_litellm_session_without_request_correlation_in_logs():
    """Without the setting LiteLLM leaves session_id empty: metadata.session_id still reaches
    requester_metadata, but a litellm_session_id only lands in trace_id, which is not read."""
    with_metadata, with_body_field = recorded_litellm("no-request-correlation")
    assert with_metadata["session_id"] == "" and with_body_field["trace_id"] == "conv-a-0003"
    convert = LiteLLMFormat(LITELLM_FIELDS)
    assert convert(with_metadata).session == "conv-a-0002"
    assert convert(with_body_field).session is None


def test_litellm_trace_id_is_not_a_session():
    payload = recorded_litellm("readme-config")[3]
    payload["session_id"] = ""
    assert payload["trace_id"]  # a fresh id LiteLLM made for this call alone
    assert LiteLLMFormat(LITELLM_FIELDS)(payload).session is None


def test_litellm_keeps_vllms_per_request_timings_for_whole_answers_only():
    """An upstream answering with vLLM's `metrics` object (--enable-per-request-metrics):
    LiteLLM keeps it in `response` when not streamed and drops it from streams. vLLM's TTFT
    and queue wait are the engine's; LiteLLM's first-chunk time is the proxy's."""
    whole, streamed = recorded_litellm("vllm-metrics")
    assert whole["response"]["metrics"]["time_to_first_token_ms"] == 123.5
    assert whole["response"]["metrics"]["queue_time_ms"] == 7.25
    assert "metrics" not in streamed["response"]
    convert = LiteLLMFormat(LITELLM_FIELDS)
    from_whole = convert(whole)
    assert (from_whole.engine_ttft_seconds, from_whole.engine_queue_seconds) == (
        123.5 / 1000,
        7.25 / 1000,
    )
    assert from_whole.ttft_seconds is None  # completionStartTime is the end: no TTFT there
    from_stream = convert(streamed)
    assert from_stream.ttft_seconds == pytest.approx(
        streamed["completionStartTime"] - streamed["startTime"]
    )
    assert (from_stream.engine_ttft_seconds, from_stream.engine_queue_seconds) == (None, None)
    whole["response"]["metrics"]["time_to_first_token_ms"] = None  # vLLM had no timestamps
    assert (convert(whole).engine_ttft_seconds, convert(whole).engine_queue_seconds) == (
        None,
        7.25 / 1000,
    )


@pytest.mark.parametrize(
    "figure,reason",
    [
        (-1.0, "negative"),
        ("123", "not_a_number"),
        (True, "not_a_number"),
        (2**1024, "too_large"),
        (86_400_001, "too_large"),
        (float("nan"), "not_finite"),
    ],
)
def test_unusable_vllm_timings_reject_the_record(figure, reason):
    """Checked as every number is: ranges before any arithmetic (2**1024 ms would overflow a
    float), and a rejection names the reason, never the value."""
    whole, _ = recorded_litellm("vllm-metrics")
    for key in ("time_to_first_token_ms", "queue_time_ms"):
        payload = json.loads(json.dumps(whole))
        payload["response"]["metrics"][key] = figure
        with pytest.raises(InvalidEvent) as caught:
            LiteLLMFormat(LITELLM_FIELDS)(payload)
        assert caught.value.reason == reason
        assert str(figure) not in str(caught.value)


async def test_recorded_litellm_batch_through_the_app(usage_client):
    """The body exactly as LiteLLM posted it: NDJSON under Content-Type application/json."""
    client, state = await usage_client(signals_granularity=16, usage_ingest_token="tok")
    body = fixture_text(LITELLM_RECORDED + "readme-config.ndjson")
    response = await client.post(
        "/v1/usage?format=litellm",
        data=body,
        headers={"Authorization": "Bearer tok", "Content-Type": "application/json"},
    )
    assert response.status == 200, await response.text()
    assert (await response.json())["accepted"] == 5
    registry = build_registry(state)
    model = "Qwen/Qwen3-8B"
    for caller, state_name, count in (
        ("batch-summarizer", "cold", 1),
        ("batch-summarizer", "error", 1),
        ("ide-assistant", "warm", 2),
        ("research-agent", "warm", 1),
    ):
        assert (
            value(
                registry, "vllm_cache_requests_total", caller=caller, model=model, state=state_name
            )
            == count
        ), (caller, state_name)
    assert (
        value(registry, "vllm_cache_cached_tokens_total", caller="ide-assistant", model=model)
        == 320
    )


# ---- OpenAI response records -----------------------------------------------------------


def record(response: object, **extra: object) -> dict:
    return {"caller": "agent-1", "response": response, **extra}


def test_openai_chat_response_object():
    event = OpenAIFormat()(
        record(vllm_json("02_chat_warm.json"), ttft_seconds=0.3, queue_seconds=0.1, session="s")
    )
    assert event == UsageEvent("agent-1", "tiny-llama", 1396, 1376, 8, 0.3, 0.1, "s")


def test_openai_streamed_chat_as_sse_text_and_as_final_chunk():
    sse = fixture_text(VLLM + "03_chat_stream_warm.sse.txt")
    from_text = OpenAIFormat()(record(sse))
    assert (from_text.model, from_text.prompt_tokens, from_text.cached_tokens) == (
        "tiny-llama",
        1396,
        1376,
    )
    final = [line[6:] for line in sse.splitlines() if line.startswith("data: {")][-1]
    chunk = json.loads(final)
    assert chunk["choices"] == []
    assert OpenAIFormat()(record(chunk)) == from_text
    assert OpenAIFormat()(record(json.dumps(vllm_json("02_chat_warm.json")))).cached_tokens == (
        1376
    )


def test_openai_completions_and_cold_responses():
    assert OpenAIFormat()(record(vllm_json("05_completion_repeat.json"))).cached_tokens == 1344
    streamed = OpenAIFormat()(record(fixture_text(VLLM + "06_completion_stream.sse.txt")))
    assert (streamed.prompt_tokens, streamed.cached_tokens) == (1373, 1344)
    cold = OpenAIFormat()(record(vllm_json("01_chat_cold.json")))
    assert (cold.prompt_tokens, cold.cached_tokens) == (1395, 0)


def test_openai_responses_api_object_and_stream():
    obj = OpenAIFormat()(record(vllm_json("10_responses_warm.json")))
    streamed = OpenAIFormat()(record(fixture_text(VLLM + "09_responses_stream_warm.sse.txt")))
    for event in (obj, streamed):
        assert event.cached_tokens is not None and 0 < event.cached_tokens <= event.prompt_tokens
    assert (streamed.prompt_tokens, streamed.cached_tokens) == (268, 256)


def test_openai_flag_off_means_not_reported():
    body = vllm_json("02_chat_warm.json")
    body["usage"]["prompt_tokens_details"] = None  # vLLM without the flag
    assert OpenAIFormat()(record(body)).cached_tokens is None


def test_openai_error_response_counts_as_an_error():
    event = OpenAIFormat()(record(vllm_json("11_chat_error_400.json"), status=400))
    assert status_is_error(event.status) and event.prompt_tokens == 0
    with pytest.raises(InvalidEvent) as caught:
        OpenAIFormat()(record(vllm_json("11_chat_error_400.json")))
    assert caught.value.reason == "missing_usage"
    with pytest.raises(InvalidEvent) as caught:
        OpenAIFormat()(record('data: {"choices": []}\n\ndata: [DONE]\n'))
    assert caught.value.reason == "missing_usage"
    with pytest.raises(InvalidEvent) as caught:
        OpenAIFormat()(record("<html>bad gateway</html>"))
    assert caught.value.reason == "malformed_response"


def test_openai_per_request_metrics_are_the_engines_timings():
    body = vllm_json("02_chat_warm.json")
    assert body["metrics"] is None  # vLLM without --enable-per-request-metrics
    assert OpenAIFormat()(record(body)).engine_ttft_seconds is None
    body["metrics"] = {
        "time_to_first_token_ms": 250.0,
        "generation_time_ms": 40.0,
        "queue_time_ms": 5.0,
        "mean_itl_ms": 5.7,
        "tokens_per_second": 27.6,
        "speculative_decoding": None,
    }
    event = OpenAIFormat()(record(body, ttft_seconds=0.4, queue_seconds=0.1))
    assert (event.engine_ttft_seconds, event.engine_queue_seconds) == (0.25, 0.005)
    assert (event.ttft_seconds, event.queue_seconds) == (0.4, 0.1)  # the proxy's, kept apart


def test_openai_streamed_response_carries_the_metrics_on_its_usage_chunk():
    sse = fixture_text(VLLM + "03_chat_stream_warm.sse.txt")
    metrics = ',"metrics":{"time_to_first_token_ms":31.25,"queue_time_ms":0.5}}'
    usage_chunk = next(line for line in sse.splitlines() if '"choices":[]' in line)
    with_metrics = sse.replace(usage_chunk, usage_chunk[:-1] + metrics)
    event = OpenAIFormat()(record(with_metrics))
    assert (event.engine_ttft_seconds, event.engine_queue_seconds) == (0.03125, 0.0005)
    assert OpenAIFormat()(record(sse)).engine_ttft_seconds is None


async def test_openai_format_through_the_app(usage_client):
    client, state = await usage_client(signals_granularity=32)
    body = "\n".join(
        json.dumps(record(vllm_json(name), ttft_seconds=ttft))
        for name, ttft in (("01_chat_cold.json", 3.0), ("02_chat_warm.json", 0.2))
    )
    response = await client.post("/v1/usage?format=openai", data=body)
    assert (await response.json())["accepted"] == 2
    registry = build_registry(state)
    assert (
        value(registry, "vllm_cache_cached_tokens_total", caller="agent-1", model="tiny-llama")
        == 1376
    )
    assert (
        value(registry, "vllm_cache_prompt_tokens_total", caller="agent-1", model="tiny-llama")
        == 1395 + 1396
    )


# ---- user mapping ----------------------------------------------------------------------

MAPPING = """
caller: [request.headers.x-caller, request.user]
model: response.model
prompt_tokens: response.usage.prompt_tokens
cached_tokens: response.usage.prompt_tokens_details.cached_tokens
completion_tokens: response.usage.completion_tokens
ttft_seconds: {path: timing.first_byte_ms, scale: 0.001}
queue_seconds: {path: timing.admitted_at, minus: timing.received_at}
session: request.body.messages.0.content
status: response_status
"""


def write_mapping(tmp_path: Path, text: str = MAPPING) -> str:
    path = tmp_path / "mapping.yaml"
    path.write_text(text)
    return str(path)


def gateway_log() -> dict:
    return {
        "request": {
            "headers": {"x-caller": "gw-agent"},
            "user": "fallback",
            "body": {"messages": [{"content": "conv-7"}]},
        },
        "response": vllm_json("02_chat_warm.json"),
        "response_status": 200,
        "timing": {"first_byte_ms": 450, "received_at": 100.0, "admitted_at": 100.25},
    }


def test_mapping_reads_dotted_paths(tmp_path):
    convert = load_mapping(write_mapping(tmp_path))
    assert convert(gateway_log()) == UsageEvent(
        "gw-agent", "tiny-llama", 1396, 1376, 8, 0.45, 0.25, "conv-7", None, 200
    )
    log = gateway_log()
    del log["request"]["headers"]["x-caller"]
    assert convert(log).caller == "fallback"  # the second path of the list
    log["response"]["usage"]["prompt_tokens"] = "lots"
    with pytest.raises(InvalidEvent) as caught:
        convert(log)
    assert caught.value.reason == "not_a_number"


@pytest.mark.parametrize(
    "text,problem",
    [
        ("caller: a\n", "prompt_tokens"),
        ("caller: a\nprompt_tokens: b\nwho_knows: c\n", "unknown field"),
        ("caller: a\nprompt_tokens: {scale: 2}\n", "path"),
        ("caller: a\nprompt_tokens: {path: b, scale: lots}\n", "number"),
        ("caller: a\nprompt_tokens: [1, 2]\n", "dotted path"),
        ("caller: a\nprompt_tokens: {path: b, plus: {c: d}}\n", "paths to add"),
        ("caller: a\nprompt_tokens: {path: b, plus: [[1]]}\n", "dotted path"),
        ("- just\n- a list\n", "must map"),
        ("caller: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_mappings_are_configuration_errors(tmp_path, text, problem):
    with pytest.raises(MappingError) as caught:
        load_mapping(write_mapping(tmp_path, text))
    assert problem in str(caught.value)


def test_missing_mapping_file_is_a_configuration_error(tmp_path):
    with pytest.raises(MappingError) as caught:
        load_mapping(str(tmp_path / "nope.yaml"))
    assert "cannot read" in str(caught.value)


async def test_mapping_format_through_the_app(usage_client, tmp_path):
    client, state = await usage_client(
        usage_mapping_file=write_mapping(tmp_path), signals_granularity=32
    )
    response = await client.post("/v1/usage?format=mapping", json=[gateway_log()] * 3)
    assert (await response.json())["accepted"] == 3
    registry = build_registry(state)
    assert (
        value(
            registry,
            "vllm_cache_requests_total",
            caller="gw-agent",
            model="tiny-llama",
            state="warm",
        )
        == 3
    )
    assert (
        value(
            registry,
            "vllm_cache_queue_wait_seconds_count",
            caller="gw-agent",
            model="tiny-llama",
            source="proxy",
        )
        == 3
    )


def test_mapping_spec_in_code():
    convert = MappingFormat({"caller": "who", "prompt_tokens": "n"})
    assert convert({"who": "a", "n": 5}) == UsageEvent("a", "", 5)


def test_a_bad_mapping_file_fails_configuration_up_front(tmp_path):
    """Exit 2 with one line (and --check-config says so), not a traceback at startup."""
    import argparse

    from exporter.config import ConfigError, add_flags, build_config

    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(["--usage.mapping.file", write_mapping(tmp_path, "caller: a\n")])
    with pytest.raises(ConfigError) as caught:
        build_config(args, environ={})
    assert "prompt_tokens" in str(caught.value)
    args = parser.parse_args(["--usage.mapping.file", write_mapping(tmp_path)])
    assert build_config(args, environ={}).usage_mapping_file


def test_litellm_provider_prefix_is_not_part_of_the_model():
    payload = litellm_payloads()[0]
    payload["model"] = "hosted_vllm/tiny-llama"
    assert LiteLLMFormat(LITELLM_FIELDS)(payload).model == "tiny-llama"
    payload["model"] = "Qwen/Qwen3-8B"  # a Hugging Face name keeps its slash
    assert LiteLLMFormat(LITELLM_FIELDS)(payload).model == "Qwen/Qwen3-8B"


def test_anthropic_shaped_usage_counts_both_cache_fields_in_the_prompt():
    """vLLM's /v1/messages: input_tokens excludes cache reads and cache writes."""
    body = {
        "model": "tiny-llama",
        "usage": {
            "input_tokens": 20,
            "cache_read_input_tokens": 1376,
            "cache_creation_input_tokens": 0,
            "output_tokens": 8,
        },
    }
    event = OpenAIFormat()(record(body))
    assert (event.prompt_tokens, event.cached_tokens, event.completion_tokens) == (1396, 1376, 8)


def test_mapping_adds_an_anthropic_prompt_from_its_parts():
    """An Anthropic-shaped gateway log: the prompt is input + cache read + cache creation.
    Mapped as the input alone, a warm turn's cache read exceeds it (cached_exceeds_prompt);
    ``plus`` adds the parts, and an absent part adds nothing."""
    convert = MappingFormat(
        {
            "caller": "user",
            "prompt_tokens": {
                "path": "usage.input_tokens",
                "plus": ["usage.cache_read_input_tokens", "usage.cache_creation_input_tokens"],
            },
            "cached_tokens": "usage.cache_read_input_tokens",
        }
    )
    warm = {"user": "claude-agent", "usage": vllm_json("20_messages_warm.json")["usage"]}
    assert (convert(warm).prompt_tokens, convert(warm).cached_tokens) == (446, 416)
    cold = {
        "user": "claude-agent",
        "usage": {"input_tokens": 30, "cache_creation_input_tokens": 416},
    }
    assert (convert(cold).prompt_tokens, convert(cold).cached_tokens) == (446, None)
    only_input = MappingFormat(
        {
            "caller": "user",
            "prompt_tokens": "usage.input_tokens",
            "cached_tokens": "usage.cache_read_input_tokens",
        }
    )
    with pytest.raises(InvalidEvent) as caught:
        only_input(warm)
    assert caught.value.reason == "cached_exceeds_prompt"
    with pytest.raises(InvalidEvent) as caught:
        convert({"user": "a", "usage": {"input_tokens": 3, "cache_read_input_tokens": "x"}})
    assert caught.value.reason == "not_a_number"


def test_litellm_reads_how_many_sequences_the_request_asked_for():
    convert = LiteLLMFormat(LITELLM_FIELDS)
    payload = litellm_payloads()[0]
    assert convert({**payload, "model_parameters": {"n": 2}}).sequences == 2
    assert convert({**payload, "model_parameters": {"n": "2"}}).sequences is None
    assert convert(payload).sequences is None
