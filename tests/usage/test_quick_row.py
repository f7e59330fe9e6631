"""Property: ``quick_event`` (msgspec's one-step decode and check of a native event) gives
exactly ``validate(json.loads(line))`` whenever it gives an event at all.

The ingest tries it first on every NDJSON line of the native format and falls back to the
reference reading on None or on any exception, so a row it gives where the reference would
differ (another value, another type, or a rejection) is an event counted wrong.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import event, given, settings
from hypothesis import strategies as st

import exporter.usage.event as event_module
from exporter.usage.event import (
    FIELDS,
    MAX_CALLER_CHARS,
    MAX_EVENT_ID_CHARS,
    MAX_SECONDS,
    MAX_SEQUENCES,
    MAX_TIMESTAMP,
    MAX_TOKENS,
    InvalidEvent,
    quick_event,
    validate,
)
from exporter.values import MAX_BACKEND_CHARS, UsageEvent

TOKEN_EDGES = [
    0,
    1,
    2048,
    MAX_TOKENS,
    MAX_TOKENS + 1,
    -1,
    -(2**63),
    2**63 - 1,
    2**63,
    2**64,
    10**30,
    1.0,
    2048.0,
    float(MAX_TOKENS) + 0.5,
    -0.0,
    True,
]
SECONDS_EDGES = [
    0.0,
    -0.0,
    1,
    0.5,
    MAX_SECONDS,
    MAX_SECONDS + 1e-6,
    MAX_SECONDS + 1,
    int(MAX_SECONDS) + 1,
    -1e-300,
    5e-324,
    float("nan"),
    float("inf"),
    -float("inf"),
    1e308,
    10**30,
    True,
]
TIME_EDGES = [
    1.8e9 + 0.001,
    MAX_TIMESTAMP,
    MAX_TIMESTAMP * (1 + 1e-15),
    int(MAX_TIMESTAMP),
    int(MAX_TIMESTAMP) + 1,
    0,
    -0.0,
    -1.0,
    float("inf"),
    True,
]
NAME_EDGES = [
    "agent-0",
    "agent-1",
    "qwen3.8-27b",
    "s1",
    "",
    " lead",
    "tail ",
    "caf\u00e9",
    "\U0001f600",
    "tab\there",
    "nul\x00",
    "\ud800",
    "\u200b",
    "x" * MAX_CALLER_CHARS,
    "x" * (MAX_CALLER_CHARS + 1),
    7,
    None,
]
ID_EDGES = [
    "req-1",
    "0f8fa6b1-5b5c-4c1e-9d3a-1b2c3d4e5f60",
    "",
    " ",
    "x" * MAX_EVENT_ID_CHARS,
    "x" * (MAX_EVENT_ID_CHARS + 1),
    "nul\x00",
    "caf\u00e9",
    7,
    2**64,
    1.5,
    None,
]
BACKEND_EDGES = [
    "http://vllm-7:8000/v1",
    "replica-7",
    "",
    " ",
    "x" * MAX_BACKEND_CHARS,
    "x" * (MAX_BACKEND_CHARS + 1),
    "http://vllm\n:8000",
    "caf\u00e9",
    "\u202ehttp://evil",
    7,
    2**64,
    1.5,
    None,
]
SEQUENCE_EDGES = [1, 2, MAX_SEQUENCES, MAX_SEQUENCES + 1, 0, -1, 2.0, 1.5, 2**64, True]
STATUS_EDGES = [
    200,
    204,
    299,
    300,
    301,
    429,
    503,
    100,
    99,
    600,
    "200",
    "299",
    "503",
    "ok",
    "",
    "timeout",
    True,
    False,
    200.0,
    None,
]
OTHER = st.one_of(
    st.none(),
    st.booleans(),
    st.just([]),
    st.just({}),
    st.just([1, {"a": 2}]),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
)


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
    elif key == "id":
        edges = ID_EDGES
    elif key == "backend":
        edges = BACKEND_EDGES
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
    "id": st.sampled_from(["req-1", "req-2"]),
    "backend": st.sampled_from(["http://127.0.0.1:8000/v1", "replica-7"]),
}


@st.composite
def lines(draw: st.DrawFn) -> bytes:
    """A native event's line: a valid event (any subset of its optional fields), of which a
    few fields, if any, take the values each check is about (bounds, types, characters),
    with unknown and repeated keys, ASCII or not, compact or spaced."""
    required = ("caller", "model", "prompt_tokens")
    optional = draw(
        st.lists(st.sampled_from([key for key in FIELDS if key not in required]), unique=True)
    )
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
    text = (
        "{"
        + separator.join(
            json.dumps(key) + colon + json.dumps(value, ensure_ascii=ensure_ascii)
            for key, value in pairs
        )
        + "}"
    )
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
        return ("row", validate(value))
    except InvalidEvent as err:
        return ("rejected", err.reason)


def exactly(event: Any) -> list[tuple[type, str]]:
    """An event compared field by field by type and repr (1 == 1.0 and 0.0 == -0.0 in
    Python; not here)."""
    return [(type(value), repr(value)) for value in msgspec.structs.astuple(event)]


@settings(max_examples=1500, deadline=None)
@given(lines())
def test_a_quick_row_is_the_reference_reading(line: bytes) -> None:
    expected = reference(line)  # first: it remembers the names it accepts, as the ingest does
    try:
        got = quick_event(line)
    except Exception:  # the ingest reads the line again: nothing to hold
        return
    event("quick" if got is not None else "left to the reference reading")
    if got is not None:
        assert expected[0] == "row", (line, expected)
        assert exactly(got) == exactly(expected[1]), line


def test_the_common_event_takes_the_quick_path() -> None:
    """A tap's event whose names were accepted before is read in one step (the ingest's
    speed rests on it), and one with a new name is left to the reference reading."""
    line = (
        b'{"caller":"agent-7","model":"qwen3.8-27b","prompt_tokens":13349,'
        b'"cached_tokens":10240,"completion_tokens":510,"ttft_seconds":42.766,'
        b'"queue_seconds":0.759,"session":"agent-7-s1","time":1800000000.01,"status":200,'
        b'"engine_ttft_seconds":40,"max_tokens":1024}'
    )
    assert reference(line)[0] == "row"
    row = quick_event(line)
    assert row is not None and exactly(row) == exactly(reference(line)[1])
    assert row.engine_queue_seconds is None and row.engine_ttft_seconds == 40.0
    assert type(row.engine_ttft_seconds) is float
    assert quick_event(line.replace(b"agent-7-s1", b"agent-7-s9")) is None, "a new session"
    assert quick_event(line.replace(b'"status":200', b'"status":503')) is None, "a failure"
    assert quick_event(line.replace(b'"cached_tokens":10240', b'"cached_tokens":20000')) is None
    assert quick_event(line.replace(b"agent-7", "agent-\u00e9".encode())) is None, "not ASCII"


def test_the_usage_event_is_the_only_field_list() -> None:
    """The native format's keys, the fields validate checks (each by its declared type),
    the fields msgspec decodes a line into, and the event the signals count are one list:
    UsageEvent's. No other product module spells the fields out in order."""
    names = tuple(field.name for field in msgspec.structs.fields(UsageEvent))
    assert FIELDS == names
    assert tuple(name for name, _check in event_module._CHECKS) == names
    assert event_module._decode_native_event.__self__.type is UsageEvent
    event = validate(
        {
            "caller": "c",
            "model": "m",
            "prompt_tokens": 9,
            "cached_tokens": 8,
            "completion_tokens": 7,
            "ttft_seconds": 6.0,
            "queue_seconds": 5.0,
            "session": "s",
            "time": 4.0,
            "status": 204,
            "engine_ttft_seconds": 3.0,
            "engine_queue_seconds": 2.0,
            "max_tokens": 1,
            "sequences": 10,
            "id": "e1",
            "backend": "http://vllm-0:8000",
        }
    )
    assert len(set(msgspec.structs.astuple(event))) == len(FIELDS), "every field told apart"
    package = Path(event_module.__file__).resolve().parents[1]
    for path in package.rglob("*.py"):
        if path.name == "values.py":
            continue
        for sequence in ordered_names(ast.parse(path.read_text(encoding="utf-8"))):
            for at in range(len(sequence) - 3):
                run = tuple(sequence[at : at + 4])
                assert not any(run == names[i : i + 4] for i in range(len(names) - 3)), (
                    f"{path.name} spells out {run}"
                )


def ordered_names(tree: ast.AST) -> list[list[str]]:
    """The names each positional construct of the code holds, in order: the items of a
    tuple, list or set (strings or variables: a tuple unpacked too), a call's positional
    arguments, a function's parameters. What goes by name (a dict's keys, keyword
    arguments) cannot put a value in the wrong field; docstrings and comments are prose."""
    found: list[list[str]] = []

    def name(node: ast.AST | None) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return node.id
        return ""

    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            found.append([name(item) for item in node.elts])
        elif isinstance(node, ast.Call):
            found.append([name(arg) for arg in node.args])
        elif isinstance(node, ast.arguments):
            found.append([arg.arg for arg in [*node.posonlyargs, *node.args, *node.kwonlyargs]])
    return found
