"""Property: ``quick_row`` (msgspec's one-step decode and check of a native event) gives
exactly ``validate_row(json.loads(line))`` whenever it gives a row at all.

The ingest tries it first on every NDJSON line of the native format and falls back to the
reference reading on None or on any exception, so a row it gives where the reference would
differ (another value, another type, or a rejection) is an event counted wrong.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from exporter.usage.event import (
    FIELDS,
    MAX_CALLER_CHARS,
    MAX_SECONDS,
    MAX_SEQUENCES,
    MAX_TIMESTAMP,
    MAX_TOKENS,
    InvalidEvent,
    quick_row,
    validate,
    validate_row,
)
from exporter.values import event_row

TOKEN_EDGES = [0, 1, 2048, MAX_TOKENS, MAX_TOKENS + 1, -1, -(2**63), 2**63 - 1, 2**63, 2**64,
               10**30, 1.0, 2048.0, float(MAX_TOKENS) + 0.5, -0.0, True]
SECONDS_EDGES = [0.0, -0.0, 1, 0.5, MAX_SECONDS, MAX_SECONDS + 1e-6, MAX_SECONDS + 1,
                 int(MAX_SECONDS) + 1, -1e-300, 5e-324, float("nan"), float("inf"),
                 -float("inf"), 1e308, 10**30, True]
TIME_EDGES = [1.8e9 + 0.001, MAX_TIMESTAMP, MAX_TIMESTAMP * (1 + 1e-15), int(MAX_TIMESTAMP),
              int(MAX_TIMESTAMP) + 1, 0, -0.0, -1.0, float("inf"), True]
NAME_EDGES = ["agent-0", "agent-1", "qwen3.8-27b", "s1", "", " lead", "tail ", "caf\u00e9",
              "\U0001f600", "tab\there", "nul\x00", "\ud800", "\u200b", "x" * MAX_CALLER_CHARS,
              "x" * (MAX_CALLER_CHARS + 1), 7, None]
SEQUENCE_EDGES = [1, 2, MAX_SEQUENCES, MAX_SEQUENCES + 1, 0, -1, 2.0, 1.5, 2**64, True]
STATUS_EDGES = [200, 204, 299, 300, 301, 429, 503, 100, 99, 600, "200", "299", "503", "ok", "",
                "timeout", True, False, 200.0, None]
OTHER = st.one_of(st.none(), st.booleans(), st.just([]), st.just({}), st.just([1, {"a": 2}]),
                  st.integers(), st.floats(), st.text(max_size=8))


def field_value(key: str) -> st.SearchStrategy[Any]:
    """Values each check is about, for ``key``: mostly its edges, else anything."""
    if key in ("caller", "model", "session"):
        edges: list[Any] = NAME_EDGES
    elif key == "status":
        edges = STATUS_EDGES
    elif key == "time":
        edges = TIME_EDGES
    elif key == "sequences":
        edges = SEQUENCE_EDGES
    elif key.endswith("tokens"):
        edges = TOKEN_EDGES
    else:
        edges = SECONDS_EDGES
    return st.one_of(st.sampled_from(edges), st.sampled_from(edges), OTHER)


VALID = {
    "caller": st.sampled_from(["agent-0", "agent-1", "caf\u00e9"]),
    "model": st.sampled_from(["qwen3.8-27b", ""]),
    "prompt_tokens": st.integers(2048, 100_000),
    "cached_tokens": st.sampled_from([0, 2048, 4096]),
    "completion_tokens": st.integers(0, 4096),
    "ttft_seconds": st.floats(0.0, 120.0),
    "queue_seconds": st.floats(0.0, 5.0),
    "session": st.sampled_from(["s1", "s2"]),
    "time": st.floats(1.7e9, 1.9e9),
    "status": st.sampled_from([200, 204]),
    "engine_ttft_seconds": st.floats(0.0, 120.0),
    "engine_queue_seconds": st.floats(0.0, 5.0),
    "max_tokens": st.integers(0, 8192),
    "sequences": st.integers(1, 4),
}


@st.composite
def lines(draw: st.DrawFn) -> bytes:
    """A native event's line: a valid event (any subset of its optional fields), of which a
    few fields, if any, take the values each check is about (bounds, types, characters),
    with unknown and repeated keys, ASCII or not, compact or spaced."""
    required = ("caller", "model", "prompt_tokens")
    optional = draw(st.lists(st.sampled_from([key for key in FIELDS if key not in required]),
                             unique=True))
    pairs = [(key, draw(VALID[key])) for key in (*required, *optional)]
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from([*FIELDS, "unknown", "Caller"]))
        value = draw(field_value(key))
        if draw(st.booleans()):  # replaced in place, else repeated (or added) at the end
            pairs = [(k, value if k == key else v) for k, v in pairs]
        else:
            pairs.append((key, value))
    ensure_ascii = draw(st.booleans())
    spaced = draw(st.booleans())
    separator, colon = (", ", ": ") if spaced else (",", ":")
    text = "{" + separator.join(
        json.dumps(key) + colon + json.dumps(value, ensure_ascii=ensure_ascii)
        for key, value in pairs) + "}"
    if draw(st.integers(0, 19)) == 0:
        text = draw(st.sampled_from(["[", " ", "\r", "\ufeff", "1", "null", "[]"])) + text
    line = text.encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 9)) == 0:  # bytes that are not UTF-8, in a value nothing reads
        line = line[:-1] + b', "unknown": "\xff\xfe"}'
    return line


def reference(line: bytes) -> tuple[str, Any]:
    """What the ingest's own reading gives: ("row", the row) or ("rejected", reason)."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return ("rejected", "not_json")
    try:
        return ("row", validate_row(value))
    except InvalidEvent as err:
        return ("rejected", err.reason)


def exactly(row: Any) -> list[tuple[type, str]]:
    """A row compared by type and repr (1 == 1.0 and 0.0 == -0.0 in Python; not here)."""
    return [(type(value), repr(value)) for value in row]


@settings(max_examples=1500, deadline=None)
@given(lines())
def test_a_quick_row_is_the_reference_reading(line: bytes) -> None:
    expected = reference(line)  # first: it remembers the names it accepts, as the ingest does
    try:
        got = quick_row(line)
    except Exception:  # the ingest reads the line again: nothing to hold
        return
    event("quick" if got is not None else "left to the reference reading")
    if got is not None:
        assert expected[0] == "row", (line, expected)
        assert exactly(got) == exactly(expected[1]), line


def test_the_common_event_takes_the_quick_path() -> None:
    """A tap's event whose names were accepted before is read in one step (the ingest's
    speed rests on it), and one with a new name is left to the reference reading."""
    line = (b'{"caller":"agent-7","model":"qwen3.8-27b","prompt_tokens":13349,'
            b'"cached_tokens":10240,"completion_tokens":510,"ttft_seconds":42.766,'
            b'"queue_seconds":0.759,"session":"agent-7-s1","time":1800000000.01,"status":200,'
            b'"engine_ttft_seconds":40,"max_tokens":1024}')
    assert reference(line)[0] == "row"
    row = quick_row(line)
    assert row is not None and exactly(row) == exactly(reference(line)[1])
    assert row[11] is None and row[10] == 40.0 and type(row[10]) is float
    assert quick_row(line.replace(b"agent-7-s1", b"agent-7-s9")) is None, "a new session"
    assert quick_row(line.replace(b"\"status\":200", b"\"status\":503")) is None, "a failure"
    assert quick_row(line.replace(b'"cached_tokens":10240', b'"cached_tokens":20000')) is None
    assert quick_row(line.replace(b"agent-7", "agent-\u00e9".encode())) is None, "not ASCII"


def test_the_quick_fields_are_in_the_rows_order() -> None:
    """``quick_row``'s struct is built from FIELDS, and its row is the struct's fields in that
    order: FIELDS must be ``UsageRow``'s order, field for field."""
    event = validate({name: None for name in FIELDS} | {
        "caller": "c", "model": "m", "prompt_tokens": 9, "cached_tokens": 8,
        "completion_tokens": 7, "ttft_seconds": 6.0, "queue_seconds": 5.0, "session": "s",
        "time": 4.0, "status": 204, "engine_ttft_seconds": 3.0, "engine_queue_seconds": 2.0,
        "max_tokens": 1, "sequences": 10})
    assert event_row(event) == tuple(getattr(event, name) for name in FIELDS)
    assert len(set(event_row(event))) == len(FIELDS), "every field told apart"
