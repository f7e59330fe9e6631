"""Hostile input to the usage readers: each case is sent, and the test checks the clear
error, that it is counted, that the good events of the same body or file are counted
exactly, and that nothing else changed."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import pytest

from exporter.usage import ingest
from exporter.usage.event import validate
from exporter.usage.formats import LiteLLMFormat, MappingFormat, OpenAIFormat
from tests.usage.conftest import refused
from tests.usage.test_tail import append, follower, line

GOOD = {"caller": "alice", "model": "m", "prompt_tokens": 4096, "cached_tokens": 2048}
NESTED = "[" * 1000 + "]" * 1000
NESTED_OBJECT = '{"caller": ' + "[" * 5000 + "]" * 5000 + "}"
HUGE = 2**1024


def ndjson(*lines: object) -> bytes:
    return b"\n".join(
        line
        if isinstance(line, bytes)
        else json.dumps(line).encode()
        if not isinstance(line, str)
        else line.encode()
        for line in lines
    )


def rejected(state, reason: str, reader: str = "http") -> int:
    return state.usage.rejected.get((reader, reason), 0)


def accepted(state, reader: str = "http") -> int:
    return state.usage.events.get(reader, 0)


# --- deep nesting --------------------------------------------------------------------------


@pytest.mark.parametrize("nested", [NESTED, NESTED_OBJECT])
async def test_deeply_nested_line_costs_only_that_line(usage_client, nested):
    client, state = await usage_client()
    response = await client.post("/v1/usage", data=ndjson(GOOD, nested, GOOD))
    reply = await response.json()
    assert response.status == 200
    assert reply["accepted"] == 2 and reply["rejected"] == 1
    assert reply["errors"][0]["line"] == 2
    assert accepted(state) == 2
    assert rejected(state, "malformed_json") + rejected(state, "not_an_object") == 1


async def test_deeply_nested_single_body_is_a_clear_400(usage_client):
    client, state = await usage_client()
    response = await client.post("/v1/usage", data=NESTED_OBJECT.encode())
    assert response.status == 400
    assert (await response.json())["error"] == "bad_body"
    assert refused(state) == {"bad_body": 1}
    assert accepted(state) == 0


def test_deeply_nested_line_in_a_followed_file(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text("")
    tail, seen = follower(path)
    tail.poll()
    append(path, json.dumps(GOOD) + "\n" + NESTED + "\n" + json.dumps(GOOD) + "\n")
    tail.poll()
    # A thousand deep decodes or not depending on the stack left; either way it is refused.
    assert len(seen.events) == 2 and seen.rejected in (["not_an_object"], ["malformed_json"])
    append(path, NESTED_OBJECT + "\n")
    tail.poll()
    assert seen.rejected[1:] == ["malformed_json"] and len(seen.events) == 2
    tail.close()


def test_deep_nesting_inside_a_logged_response(tmp_path):
    with pytest.raises(ValueError) as caught:
        OpenAIFormat()({"caller": "a", "response": NESTED_OBJECT})
    assert getattr(caught.value, "reason", "") == "malformed_response"


# --- numbers out of any range --------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("ttft_seconds", HUGE, "too_large"),
        ("queue_seconds", HUGE, "too_large"),
        ("time", HUGE, "too_large"),
        ("ttft_seconds", -HUGE, "negative"),
        ("prompt_tokens", HUGE, "too_large"),
        ("cached_tokens", -HUGE, "negative"),
        ("completion_tokens", HUGE, "too_large"),
        ("ttft_seconds", float("nan"), "not_finite"),
        ("ttft_seconds", float("inf"), "not_finite"),
        ("status", 10**400, "bad_status"),
    ],
)
def test_numbers_are_range_checked_before_any_conversion(field, value, reason):
    with pytest.raises(ValueError) as caught:
        validate({**GOOD, field: value})
    assert getattr(caught.value, "reason", "") == reason


async def test_a_flood_of_huge_numbers_is_counted_not_logged(usage_client, caplog):
    client, state = await usage_client()
    body = "\n".join(json.dumps({**GOOD, "ttft_seconds": HUGE}) for _ in range(3000))
    with caplog.at_level(logging.WARNING):
        response = await client.post("/v1/usage", data=body.encode())
    assert response.status == 422
    assert rejected(state, "too_large") == 3000
    assert not [record for record in caplog.records if record.exc_info]


@pytest.mark.parametrize(
    "payload",
    [
        {
            "caller": "a",
            "startTime": HUGE,
            "completionStartTime": 1.0,
            "stream": True,
            "prompt_tokens": 10,
        },
        {
            "caller": "a",
            "startTime": 1.0,
            "completionStartTime": float("inf"),
            "stream": True,
            "prompt_tokens": 10,
        },
    ],
)
def test_litellm_timestamps_out_of_range_leave_the_ttft_unknown(payload):
    event = LiteLLMFormat(["caller"])(payload)
    assert event.ttft_seconds is None and event.prompt_tokens == 10


def test_a_status_of_unicode_digits_is_a_word_not_a_crash():
    from exporter.values import status_is_error

    event = validate({**GOOD, "status": "²"})  # str.isdigit() is true, int() would raise
    assert status_is_error(event.status)


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"who": "a", "n": HUGE}, "too_large"),
        ({"who": "a", "n": float("nan")}, "not_finite"),
        ({"who": "a", "n": "12"}, "not_a_number"),
    ],
)
def test_mapping_arithmetic_on_hostile_numbers(record, reason):
    convert = MappingFormat({"caller": "who", "prompt_tokens": {"path": "n", "scale": 2}})
    with pytest.raises(ValueError) as caught:
        convert(record)
    assert getattr(caught.value, "reason", "") == reason


# --- bytes that are not text -------------------------------------------------------------


async def test_an_invalid_utf8_line_costs_only_that_line(usage_client):
    client, state = await usage_client()
    response = await client.post("/v1/usage", data=ndjson(GOOD, b'{"caller": "\xff"}', GOOD))
    reply = await response.json()
    assert response.status == 200 and reply["accepted"] == 2
    assert reply["errors"] == [
        {"index": 1, "line": 2, "reason": "bad_encoding", "message": "this line is not UTF-8"}
    ]


async def test_byte_order_marks_are_ignored(usage_client):
    client, state = await usage_client()
    body = b"\xef\xbb\xbf" + ndjson(GOOD, b"\xef\xbb\xbf" + json.dumps(GOOD).encode())
    reply = await (await client.post("/v1/usage", data=body)).json()
    assert reply["accepted"] == 2 and reply["rejected"] == 0
    response = await client.post("/v1/usage", data=b"\xef\xbb\xbf" + json.dumps(GOOD).encode())
    assert (await response.json())["accepted"] == 1


@pytest.mark.parametrize(
    "caller, expected",
    [
        ("   ", None),
        ("", None),
        ("  alice ", "alice"),
        ("\u3000", None),
    ],
)
def test_callers_of_spaces_name_nobody(caller, expected):
    if expected is None:
        with pytest.raises(ValueError):
            validate({**GOOD, "caller": caller})
    else:
        assert validate({**GOOD, "caller": caller}).caller == expected


async def test_a_truncated_json_array_counts_nothing(usage_client):
    """A retried batch must not count twice: a body that breaks is refused whole."""
    client, state = await usage_client()
    body = json.dumps([GOOD, GOOD, GOOD])[:-20].encode()
    response = await client.post("/v1/usage", data=body)
    assert response.status == 400
    assert accepted(state) == 0


# --- memory: bodies at once ----------------------------------------------------------------


async def test_bodies_beyond_the_body_budget_wait_then_get_503(usage_client, monkeypatch):
    """The bytes of the bodies being read share one budget (max-concurrent-bodies times the
    body limit): a body that finds it full waits a little for room, then gets 503."""
    monkeypatch.setattr(ingest, "SLOT_WAIT_SECONDS", 0.2)
    line = json.dumps(GOOD).encode() + b"\n"
    client, state = await usage_client(
        usage_ingest_max_concurrent_bodies=1, usage_ingest_max_body_bytes=len(line) * 3
    )
    release = asyncio.Event()

    async def slow_body():
        yield line * 2
        await release.wait()  # holds two thirds of the budget until released
        yield line

    holder = asyncio.ensure_future(client.post("/v1/usage", data=slow_body()))
    budget = ingest_budget(client)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while budget.used < len(line) * 2 and loop.time() < deadline:
        await asyncio.sleep(0.01)  # the holder's bytes reaching the handler have no event
    turned_away = await client.post("/v1/usage", data=line * 2)
    assert turned_away.status == 503
    assert turned_away.headers["Retry-After"] == "1"
    assert (await turned_away.json())["error"] == "overloaded"
    fits = await client.post("/v1/usage", data=line)  # room for one more line: served
    assert fits.status == 200
    release.set()
    held = await holder
    assert held.status == 200 and (await held.json())["accepted"] == 3
    after = await client.post("/v1/usage", data=line * 2)
    assert after.status == 200
    assert refused(state) == {"overloaded": 1}
    assert accepted(state) == 6
    assert budget.used == 0  # every body gave its bytes back


def ingest_budget(client) -> ingest.BodyBytes:
    handler = next(route.handler for route in client.app.router.routes() if route.method == "POST")
    return handler.__self__.body_bytes


async def test_a_body_is_decoded_one_event_at_a_time(usage_client, monkeypatch):
    """No list of every event of a body is ever built: the converter sees each event while
    the body's later events are still undecoded bytes."""
    seen_while_reading = []
    original_scan, original_loads = ingest._scan_value, ingest._orjson_loads

    def counting_scan(text, position):
        seen_while_reading.append(position)
        return original_scan(text, position)

    def counting_loads(line):
        seen_while_reading.append(line)
        return original_loads(line)

    monkeypatch.setattr(ingest, "_scan_value", counting_scan)
    monkeypatch.setattr(ingest, "_orjson_loads", counting_loads)
    client, state = await usage_client()
    calls_at_conversion = []
    converters = ingest_converters(client)
    native = converters["native"]
    converters["native"] = lambda value: (
        calls_at_conversion.append(len(seen_while_reading)),
        native(value),
    )[1]
    await client.post("/v1/usage", data=ndjson(*[GOOD] * 50))
    # The first line is read once more to tell NDJSON from one pretty-printed object.
    assert calls_at_conversion == list(range(2, 52))


def ingest_converters(client) -> dict:
    handler = next(route.handler for route in client.app.router.routes() if route.method == "POST")
    return handler.__self__.converters


# --- followed files ------------------------------------------------------------------------


def test_a_file_renamed_away_is_drained_while_its_writer_goes_on(tmp_path):
    """logrotate without copytruncate: the writer keeps writing into the renamed file until
    it reopens; no line is lost however many polls that takes."""
    path = tmp_path / "usage.jsonl"
    path.write_text("")
    tail, seen = follower(path)
    tail.poll()
    writer = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held across renames
    writer.write(line(1))
    writer.flush()
    os.rename(path, tmp_path / "usage.jsonl.1")
    for seq in range(2, 12):  # ten polls of the writer going on in the renamed file
        writer.write(line(seq))
        writer.flush()
        tail.poll()
    writer.close()
    path.write_text(line(100))  # the file the writer reopens
    tail.poll()
    assert seen.seqs == [*range(1, 12), 100]
    for _ in range(12):  # idle: let go after its idle polls
        tail.poll()
    assert len(tail.files) == 1
    tail.close()


async def test_a_body_of_nothing_but_garbage_is_abandoned_early(usage_client):
    """One sender with bodies of junk must not hold a body slot for minutes."""
    client, state = await usage_client()
    body = b"1\n" * 2_000_000  # 4 MB, two million lines that are not events
    response = await client.post("/v1/usage", data=body)
    reply = await response.json()
    assert response.status == 422 and reply["abandoned"] is True
    assert reply["accepted"] == 0 and 10_000 <= reply["rejected"] < 20_000
    assert refused(state) == {"abandoned": 1}
    assert rejected(state, "not_an_object") == reply["rejected"]
    # A body with good events among the bad is read to its end.
    mixed = ndjson(GOOD, *([1] * 15_000), GOOD)
    reply = await (await client.post("/v1/usage", data=mixed)).json()
    assert (reply["accepted"], reply["rejected"]) == (2, 15_000)
    assert "abandoned" not in reply
