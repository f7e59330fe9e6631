"""Property: ``event.loads`` (msgspec where it reads the bytes at all, else ``json``) gives
``json.loads``'s value, type for type, or fails where it fails, always with a ValueError.

Every reader of OpenAI-shaped bodies (the tap's requests, answers and stream events, logged
responses) decodes through it, so a value orjson read otherwise would be a token count, a
model or a flag read wrong.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from exporter.usage.event import loads

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=12),
    st.integers(),
    st.integers(min_value=2**62, max_value=2**66),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-0.0, 5e-324, 1e308]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
# What json.loads reads beyond standard JSON, and what neither reads.
ODD = st.sampled_from(
    [
        b'{"a": NaN}',
        b"[Infinity, -Infinity]",
        b"1e400",
        b"[-1e400]",
        b'"\\ud800"',
        b'{"k": "\\udc00x"}',
        b"\xef\xbb\xbf{}",
        '{"a": 1}'.encode("utf-16"),
        '{"a": 1}'.encode("utf-16-le"),
        '{"a": 1}'.encode("utf-32"),
        b'{"a": 1, "a": 2}',
        b'{"a": 1} x',
        b"",
        b" ",
        b"[" * 3000 + b"]" * 3000,
        b'{"a": "\xff"}',
        b"01",
        b'{"prompt_tokens": 12345678901234567890123}',
        b"1.00000000000000000001",
        b"1" * 5000,
        b"[" + b"1" * 4300 + b"]",
        b"[" + b"1" * 4301 + b"]",
        b"1e-400",
        b"-0",
        b"2.2250738585072011e-308",
        b"9007199254740993",
        b"9007199254740993.0",
        b"0.1e1",
        b"1E5",
        b"-0.0",
        rb'"\u0000"',
        rb"\u00e9",
        rb'{"\u00e9": 1}',
    ]
)


def read_by(data: bytes) -> str:
    try:
        msgspec.json.decode(data)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return "json"
    return "msgspec"


def outcome(read: Any, data: Any) -> tuple[str, str]:
    try:
        value = read(data)
    except ValueError:
        return ("error", "")
    except RecursionError:
        return ("recursion", "")
    return ("value", repr(value))


@settings(max_examples=800, deadline=None)
@example(b'{"usage": {"prompt_tokens": 18446744073709551616}}')
@example(b"19446744073709551617")  # msgspec before 0.19 read it as 10**18 + 1
@given(
    st.one_of(
        VALUES.map(lambda value: json.dumps(value).encode()),
        VALUES.map(
            lambda value: json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
        ),
        ODD,
        st.binary(max_size=24),
    )
)
def test_loads_reads_as_json_does(data: bytes) -> None:
    expected = outcome(json.loads, data)
    if expected[0] == "recursion":
        expected = ("error", "")  # loads turns it into a ValueError, as documented
    got = outcome(loads, data)
    event(read_by(data))
    assert got == expected, data


def test_a_long_integer_is_read_as_an_integer() -> None:
    """orjson reads an integer beyond 64 bits as a float; msgspec, as json, as an integer."""
    value = loads(b'{"prompt_tokens": 18446744073709551616}')
    assert type(value["prompt_tokens"]) is int and value["prompt_tokens"] == 2**64
