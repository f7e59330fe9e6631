"""Property: an NDJSON body read line by line gives what reading it an item at a time gives.

``POST /v1/usage`` decodes (orjson) and converts each line of an NDJSON body in one step, and
looks at a line again only when that step refuses it: a blank line, one orjson refuses or may
read differently from ``json`` (an integer beyond 64 bits), one the converter rejects or
fails on. The reference is the body's items one at a time, as ``iter_body`` gives them
(``json``'s reading wherever orjson's could differ). Both must hand the same events to the
signals in the same slices, reject the same events with the same reasons, indexes and lines,
and abandon the same bodies.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.usage import ingest
from exporter.usage.event import InvalidEvent, validate
from exporter.usage.formats import native
from exporter.usage.ingest import BodyError, NdjsonLines, UsageIngest, read_body
from exporter.values import UsageEvent
from tests.usage.test_batched import BAD_LINES, GRANULE, INVALID_EVENTS, events

# Integers orjson reads as floats (beyond 64 bits) and ones it reads as json does.
BIG_VALUES = [
    10**19,
    2**64 - 1,
    2**64,
    10**25,
    10**400,
    -(2**63),
    -(2**63) - 1,
    -(10**30),
    1234567890123456789,
]
BIG = st.sampled_from(BIG_VALUES)
FIELDS = [
    "caller",
    "model",
    "session",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "ttft_seconds",
    "time",
    "status",
    "max_tokens",
    "unknown_field",
]


@st.composite
def big_number_lines(draw: st.DrawFn) -> str:
    """An event with an integer of 19 digits or more in one of its fields (or a string of
    digits, which both decoders read alike)."""
    event = draw(events(GRANULE))
    value: Any = draw(BIG)
    if draw(st.integers(min_value=0, max_value=4)) == 0:
        value = str(value)
    event[draw(st.sampled_from(FIELDS))] = value
    return json.dumps(event)


ODD_LINES = st.sampled_from(
    [
        "   ",
        "\r",
        "\ufeff",
        '\ufeff{"caller": "alpha", "prompt_tokens": 5}',
        '{"caller": "alpha", "prompt_tokens": 7, "ttft_seconds": NaN}',
        '{"caller": "alpha", "prompt_tokens": 7, "ttft_seconds": 1e400}',
        ' {"caller": "beta", "prompt_tokens": 9} \r',
        '{"caller": "beta", "prompt_tokens": 9, "session": "\\udcff"}',
        "1",
        "[]",
        "null",
    ]
)


def lines() -> st.SearchStrategy[str]:
    good = events(GRANULE).map(json.dumps)
    return st.one_of(
        good, good, good, good, INVALID_EVENTS, BAD_LINES, big_number_lines(), ODD_LINES
    )


def revalidated(value: Any) -> UsageEvent:
    """Another format than the native one: the same checks behind a converter of its own,
    which fails (as a converter bug) on one shape."""
    if (
        isinstance(value, dict)
        and value.get("caller") == "gamma"
        and value.get("prompt_tokens") == 0
    ):
        raise KeyError("a converter bug")
    if not isinstance(value, dict):
        raise InvalidEvent("not_an_object", "each event must be a JSON object")
    return validate(value)


class Recorder:
    """What a reader hands the signals: slices of rows, rejection reasons, refusals."""

    def __init__(self, convert: Any) -> None:
        self.slices: list[list[Any]] = []
        self.rejected: list[str] = []
        self.refused: list[str] = []
        self.reader = UsageIngest(
            {"x": convert},
            "x",
            "",
            1 << 24,
            lambda rows: self.slices.append(list(rows)),
            self.rejected.append,
            self.refused.append,
        )
        self.convert = convert

    def run(self, items: Any) -> tuple[Any, ...]:
        result = asyncio.run(self.reader.process(items, self.convert))
        return (result.reply(), self.slices, self.rejected, self.refused)


def both_ways(body: bytes, convert: Any) -> tuple[Any, Any] | None:
    try:
        items = read_body(body)
    except BodyError:
        return None
    one_at_a_time = Recorder(convert).run(iter(list(items)))  # not an NdjsonLines
    by_lines = Recorder(convert).run(read_body(body))
    return one_at_a_time, by_lines


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body_lines=st.lists(lines(), min_size=1, max_size=40),
    per_slice=st.integers(min_value=1, max_value=7),
    abandon_after=st.integers(min_value=1, max_value=12),
    quick_misses=st.integers(min_value=1, max_value=8),
    convert=st.sampled_from([native, revalidated]),
)
def test_lines_count_what_one_item_at_a_time_counts(
    body_lines, per_slice, abandon_after, quick_misses, convert
):
    body = "\n".join(body_lines).encode("utf-8", "surrogateescape")
    with (
        mock.patch.object(ingest, "EVENTS_PER_SLICE", per_slice),
        mock.patch.object(ingest, "ABANDON_AFTER_REJECTIONS", abandon_after),
        mock.patch.object(ingest, "QUICK_MISSES_TRIED", quick_misses),
    ):
        outcome = both_ways(body, convert)
    if outcome is not None:
        one_at_a_time, by_lines = outcome
        assert by_lines == one_at_a_time


@pytest.mark.parametrize("convert", [native, revalidated], ids=["native", "other"])
@pytest.mark.parametrize("field", FIELDS)
def test_every_field_holding_a_long_integer_is_read_as_json_reads_it(field, convert):
    """Each field with each integer of 19 digits or more, after the first line (which
    ``read_body`` reads on its own) and before another: counted as json reads it."""
    good = json.dumps({"caller": "alpha", "prompt_tokens": 4096, "cached_tokens": 2048})
    for big in BIG_VALUES:
        for value in (big, str(big)):
            line = json.dumps({"caller": "beta", "prompt_tokens": 4096, field: value})
            body = "\n".join([good, line, good]).encode()
            one_at_a_time, by_lines = both_ways(body, convert)
            assert by_lines == one_at_a_time, (field, value)


def test_a_native_line_with_an_integer_beyond_64_bits_gets_json_reading():
    """orjson reads 10**20 as a float, which the session check refuses; json's integer is a
    valid session id, so the line is read again by json and counted with it."""
    body = (
        b'{"caller": "a", "prompt_tokens": 5}\n'
        b'{"caller": "a", "prompt_tokens": 5, "session": 100000000000000000000}\n'
    )
    assert type(read_body(body)) is NdjsonLines
    _reply, slices, rejected, _refused = Recorder(native).run(read_body(body))
    assert rejected == []
    assert [event.session for event in slices[0]] == [None, "100000000000000000000"]


@pytest.mark.parametrize("tail", ["", "\n", "\n\n  \r\n", "\n\ufeff\n"])
def test_blank_lines_after_a_full_slice_begin_no_slice(tail):
    """A body is abandoned when a new slice would begin after nothing but rejections; blank
    lines are no events, so they begin none."""
    body = ("1\n1" + tail).encode()
    with (
        mock.patch.object(ingest, "EVENTS_PER_SLICE", 2),
        mock.patch.object(ingest, "ABANDON_AFTER_REJECTIONS", 2),
    ):
        outcome = both_ways(body, native)
    assert outcome is not None
    one_at_a_time, by_lines = outcome
    assert by_lines == one_at_a_time
    assert "abandoned" not in by_lines[0] and by_lines[0]["rejected"] == 2


def test_the_quick_reading_is_tried_on_every_common_line_and_given_up_on_bad_bodies():
    """Every line of a body of common events is read in one step; a body of bad lines stops
    trying after QUICK_MISSES_TRIED misses (each costs a decode and an exception), and is
    counted the same either way."""
    calls = []

    def counting(line: bytes) -> Any:
        calls.append(line)
        return original(line)

    original = ingest.quick_event
    good = b'{"caller": "alpha", "model": "m", "prompt_tokens": 4096, "cached_tokens": 2048}'
    bad = b'{"caller": "alpha", "model": "m", "prompt_tokens": -1}'
    with mock.patch.object(ingest, "quick_event", counting):
        reply, slices, _rejected, _refused = Recorder(native).run(
            read_body(b"\n".join([good] * 500))
        )
        assert reply["accepted"] == 500 and len(calls) == 499  # the first line: read_body's
        calls.clear()
        reply, _slices, rejected, _refused = Recorder(native).run(
            read_body(b"\n".join([good] + [bad] * 500))
        )
        assert reply["accepted"] == 1 and rejected == ["negative"] * 500
        assert len(calls) == ingest.QUICK_MISSES_TRIED
        calls.clear()
        body = b"\n".join(([good] * 9 + [bad]) * 50)  # 1 line in 10 bad: always tried
        reply, _slices, rejected, _refused = Recorder(native).run(read_body(body))
        assert reply["accepted"] == 450 and len(rejected) == 50 and len(calls) == 499
