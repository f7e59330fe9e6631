"""UsageEvent validation: what is accepted, and the reason for everything that is not."""

from __future__ import annotations

import msgspec
import pytest

from exporter.usage.event import REASONS, InvalidEvent, validate
from exporter.values import UsageEvent, status_is_error

GOOD = {
    "caller": "agent-1",
    "model": "qwen",
    "prompt_tokens": 1396,
    "cached_tokens": 1376,
    "completion_tokens": 8,
    "ttft_seconds": 0.5,
    "queue_seconds": 0.1,
    "session": "s1",
    "time": 1_795_992_177.0,
    "status": 200,
    "engine_ttft_seconds": 0.1235,
    "engine_queue_seconds": 0.00725,
    "max_tokens": 65_536,
    "sequences": 2,
    "id": "chatcmpl-7f3a",
    "backend": "http://vllm-7:8000/v1",
}


def test_native_form_round_trips_every_field():
    event = validate(GOOD)
    assert event == UsageEvent(**GOOD)
    # Every field; the prompt's fingerprint, which only the tap makes, travels beside the
    # event: a record's "prompt" (a proxy logging the prompt itself) is never read.
    assert [f.name for f in msgspec.structs.fields(UsageEvent)] == [*GOOD]
    assert validate({**GOOD, "prompt": "You are agent 3."}) == event
    with pytest.raises(AttributeError):
        event.caller = "someone else"  # type: ignore[misc]


def test_only_caller_and_prompt_tokens_are_required():
    event = validate({"caller": "a", "prompt_tokens": 10})
    assert event == UsageEvent("a", "", 10, None, None, None, None, None, None, None, None)
    assert event.cached_tokens is None  # not reported is not zero
    assert event.backend is None  # no replica known: no per-target counts


def test_accepted_variants():
    event = validate(
        {
            "caller": "a",
            "prompt_tokens": 10.0,
            "cached_tokens": 0,
            "ttft_seconds": 2,
            "time": 5,
            "session": 42,
            "status": "200",
            "unknown_future_field": [1, 2],
        }
    )
    assert (
        event.prompt_tokens,
        event.cached_tokens,
        event.ttft_seconds,
        event.time,
        event.session,
        event.status,
    ) == (10, 0, 2.0, 5.0, "42", 200)
    assert type(event.ttft_seconds) is float
    # A failed request has no usage: prompt_tokens may be left out.
    assert validate({"caller": "a", "status": 503}).prompt_tokens == 0
    assert status_is_error(validate({"caller": "a", "status": "failure"}).status)
    # the declared completion budget: absent is unknown (None), a whole float is accepted
    assert validate({"caller": "a", "prompt_tokens": 10}).max_tokens is None
    assert validate({"caller": "a", "prompt_tokens": 10, "max_tokens": 65536.0}).max_tokens == 65536


BAD = [
    ([], "not_an_object"),
    ("caller=a", "not_an_object"),
    ({"prompt_tokens": 10}, "missing_caller"),
    ({"caller": "", "prompt_tokens": 10}, "missing_caller"),
    ({"caller": 7, "prompt_tokens": 10}, "bad_caller"),
    ({"caller": "a\nb", "prompt_tokens": 10}, "bad_caller"),
    ({"caller": "a\x1b[31m", "prompt_tokens": 10}, "bad_caller"),
    ({"caller": "a\u200bb", "prompt_tokens": 10}, "bad_caller"),  # zero-width space
    ({"caller": "x" * 10_000, "prompt_tokens": 10}, "caller_too_long"),
    ({"caller": "a"}, "missing_prompt_tokens"),
    ({"caller": "a", "prompt_tokens": None}, "missing_prompt_tokens"),
    ({"caller": "a", "prompt_tokens": "1396"}, "not_a_number"),
    ({"caller": "a", "prompt_tokens": True}, "not_a_number"),
    ({"caller": "a", "prompt_tokens": 10.5}, "not_a_number"),
    ({"caller": "a", "prompt_tokens": -1}, "negative"),
    ({"caller": "a", "prompt_tokens": 10, "cached_tokens": -2}, "negative"),
    ({"caller": "a", "prompt_tokens": 10, "ttft_seconds": -0.1}, "negative"),
    ({"caller": "a", "prompt_tokens": 10_000_001}, "too_large"),
    ({"caller": "a", "prompt_tokens": 10**30}, "too_large"),
    ({"caller": "a", "prompt_tokens": 10, "completion_tokens": 10**9}, "too_large"),
    ({"caller": "a", "prompt_tokens": 10, "ttft_seconds": 1e9}, "too_large"),
    ({"caller": "a", "prompt_tokens": float("nan")}, "not_finite"),
    ({"caller": "a", "prompt_tokens": float("inf")}, "not_finite"),
    ({"caller": "a", "prompt_tokens": 10, "ttft_seconds": float("nan")}, "not_finite"),
    ({"caller": "a", "prompt_tokens": 10, "engine_ttft_seconds": "0.2"}, "not_a_number"),
    ({"caller": "a", "prompt_tokens": 10, "engine_ttft_seconds": -0.001}, "negative"),
    ({"caller": "a", "prompt_tokens": 10, "engine_queue_seconds": 2**1024}, "too_large"),
    ({"caller": "a", "prompt_tokens": 10, "engine_queue_seconds": float("inf")}, "not_finite"),
    ({"caller": "a", "prompt_tokens": 10, "time": float("inf")}, "not_finite"),
    # no timestamp past the year 5138, whether the number is written as an integer or not
    ({"caller": "a", "prompt_tokens": 10, "time": 10**20}, "too_large"),
    ({"caller": "a", "prompt_tokens": 10, "time": 1e20}, "too_large"),
    ({"caller": "a", "prompt_tokens": 10, "time": 1.5e11}, "too_large"),
    ({"caller": "a", "prompt_tokens": 10, "cached_tokens": 11}, "cached_exceeds_prompt"),
    ({"caller": "a", "prompt_tokens": 10, "status": 999}, "bad_status"),
    ({"caller": "a", "prompt_tokens": 10, "status": "x" * 100}, "bad_status"),
    ({"caller": "a", "prompt_tokens": 10, "status": 2.5}, "bad_status"),
    ({"caller": "a", "prompt_tokens": 10, "model": {"name": "m"}}, "bad_model"),
    ({"caller": "a", "prompt_tokens": 10, "model": "m\x00"}, "bad_model"),
    ({"caller": "a", "prompt_tokens": 10, "session": ["s"]}, "bad_session"),
    ({"caller": "a", "prompt_tokens": 10, "session": "s" * 1000}, "bad_session"),
    # the declared completion budget is a token count like the others, checked before any
    # conversion (a JSON integer past a float's range is refused, never converted)
    ({"caller": "a", "prompt_tokens": 10, "max_tokens": "65536"}, "not_a_number"),
    ({"caller": "a", "prompt_tokens": 10, "max_tokens": True}, "not_a_number"),
    ({"caller": "a", "prompt_tokens": 10, "max_tokens": 100.5}, "not_a_number"),
    ({"caller": "a", "prompt_tokens": 10, "max_tokens": -1}, "negative"),
    ({"caller": "a", "prompt_tokens": 10, "max_tokens": 10**400}, "too_large"),
    ({"caller": "a", "prompt_tokens": 10, "max_tokens": float("inf")}, "not_finite"),
    # the replica that served it: a short printable name (a label may be made of it)
    ({"caller": "a", "prompt_tokens": 10, "backend": ""}, "bad_backend"),
    ({"caller": "a", "prompt_tokens": 10, "backend": "x" * 257}, "bad_backend"),
    ({"caller": "a", "prompt_tokens": 10, "backend": "http://vllm\n:8000"}, "bad_backend"),
    ({"caller": "a", "prompt_tokens": 10, "backend": "\u202ehttp://evil"}, "bad_backend"),
    ({"caller": "a", "prompt_tokens": 10, "backend": {"url": "http://v"}}, "bad_backend"),
    ({"caller": "a", "prompt_tokens": 10, "backend": 1.5}, "bad_backend"),
]


@pytest.mark.parametrize(
    "obj,reason", BAD, ids=[reason + str(i) for i, (_, reason) in enumerate(BAD)]
)
def test_rejections_carry_a_bounded_reason(obj, reason):
    with pytest.raises(InvalidEvent) as caught:
        validate(obj)
    assert caught.value.reason == reason
    assert reason in REASONS
    assert str(caught.value)  # a human message too


def test_rejection_messages_never_echo_the_value():
    secret = "sk-live-" + "A1b2C3d4" * 4
    for obj in (
        {"caller": secret + "\n", "prompt_tokens": 1},
        {"caller": secret * 100, "prompt_tokens": 1},
        {"caller": "a", "prompt_tokens": secret},
        {"caller": "a", "prompt_tokens": 1, "backend": f"https://u:{secret}@vllm/\n"},
    ):
        with pytest.raises(InvalidEvent) as caught:
            validate(obj)
        assert secret not in str(caught.value)


def test_backend_is_the_replica_as_the_reader_names_it():
    """A URL or a name, kept as given (the signals make its label); a number as its text,
    as an id is."""
    assert validate({"caller": "a", "prompt_tokens": 1, "backend": "replica-7"}).backend == (
        "replica-7"
    )
    assert validate({"caller": "a", "prompt_tokens": 1, "backend": 7}).backend == "7"
    url = "http://vllm-3.vllm.svc:8000/v1"
    assert validate({"caller": "a", "prompt_tokens": 1, "backend": url}).backend == url


def test_status_words():
    assert not status_is_error(None)
    assert not status_is_error(204)
    assert not status_is_error("success")
    assert not status_is_error("OK")
    assert status_is_error(429)
    assert status_is_error("500")
    assert status_is_error("failure")
    assert status_is_error("timeout")
