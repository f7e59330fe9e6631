"""The tap's scan of a request body agrees with ``json.loads`` wherever ``json.loads`` reads
the body, and never fails in any other way on anything else."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from exporter.usage.openai import Endpoint
from exporter.usage.tap import request as scanner
from exporter.usage.tap.request import (
    NOT_AN_OBJECT,
    NeedsDecoder,
    RequestFacts,
    Undecidable,
    facts_of,
    prompt_bytes,
    read,
    scan,
    scan_spans,
    with_include_usage,
)

KEYS = [
    "model",
    "user",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "messages",
    "prompt",
    "input",
    "include_usage",
    "content",
    "role",
    "continuous_usage_stats",
    "metadata",
    "user_id",
    "n",
    "system",
]
WHITESPACE = st.sampled_from(["", " ", "  ", "\n", "\t", "\r\n", " \n\t "])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "",
            "\\",
            '"',
            '\\"',
            '"stream": true',
            "}",
            "]",
            "{",
            "[",
            "\u00e9\u4e2d",
            "\U0001f600",
            "\x00\x1f",
            "\ufeff",
        ]
    ),
)


@st.composite
def string_text(draw: st.DrawFn, value: str) -> str:
    """A JSON string for ``value``, as one of the ways a client may write it."""
    style = draw(st.sampled_from(["raw", "ascii", "escape_all"]))
    if style == "raw":
        return json.dumps(value, ensure_ascii=False)
    if style == "ascii":
        return json.dumps(value)
    out = []
    for char in value:
        code = ord(char)
        if code > 0xFFFF:  # a surrogate pair
            code -= 0x10000
            out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
        else:
            out.append(f"\\u{code:04x}")
    return '"' + "".join(out) + '"'


@st.composite
def json_text(draw: st.DrawFn, depth: int = 0) -> str:
    """Any JSON value, written with arbitrary whitespace, escapes and repeated keys."""
    kind = draw(
        st.sampled_from(["scalar", "scalar", "array", "object"] if depth < 4 else ["scalar"])
    )
    if kind == "scalar":
        value = draw(SCALARS)
        if isinstance(value, str):
            return draw(string_text(value))
        return json.dumps(value)
    if kind == "array":
        items = draw(st.lists(json_text(depth + 1), max_size=4))
        return (
            "["
            + ",".join(draw(WHITESPACE) + item + draw(WHITESPACE) for item in items)
            + draw(WHITESPACE)
            + "]"
        )
    return object_text(draw, depth + 1)


def object_text(draw: st.DrawFn, depth: int) -> str:
    pairs = draw(
        st.lists(
            st.tuples(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), json_text(depth)),
            max_size=6,
        )
    )
    members = [
        draw(WHITESPACE)
        + draw(string_text(key))
        + draw(WHITESPACE)
        + ":"
        + draw(WHITESPACE)
        + value
        + draw(WHITESPACE)
        for key, value in pairs
    ]
    return "{" + ",".join(members) + draw(WHITESPACE) + "}"


@st.composite
def request_body(draw: st.DrawFn) -> bytes:
    text = draw(WHITESPACE) + object_text(draw, 0) + draw(WHITESPACE)
    body = text.encode("utf-8", "surrogatepass")
    return (scanner.BOM + body) if draw(st.booleans()) else body


def same(a: Any, b: Any) -> bool:
    """Equal as JSON values (NaN equals NaN, 1 differs from 1.0)."""
    return json.dumps(a) == json.dumps(b)


def expected_facts(obj: dict[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """What the tap should know, from json.loads' reading, written independently."""
    limit_keys = {
        Endpoint.CHAT: ["max_completion_tokens", "max_tokens"],
        Endpoint.COMPLETIONS: ["max_tokens"],
        Endpoint.RESPONSES: ["max_output_tokens"],
        Endpoint.MESSAGES: ["max_tokens"],
    }[endpoint]
    limit = next((obj[key] for key in limit_keys if obj.get(key) is not None), None)
    options = obj.get("stream_options")
    user = obj.get("user")
    if endpoint is Endpoint.MESSAGES:  # Anthropic names the end user in metadata.user_id
        metadata = obj.get("metadata")
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
    return {
        "model": obj["model"] if isinstance(obj.get("model"), str) else None,
        "user": json.dumps(user),
        "stream": obj.get("stream") is True,
        "has_stream_options": "stream_options" in obj,
        "stream_options": json.dumps(options),
        "wants_usage": isinstance(options, dict) and options.get("include_usage") is True,
        "output_limit": limit if type(limit) is int else None,
        "sequences": obj["n"] if type(obj.get("n")) is int and obj["n"] > 1 else 1,
    }


def observed_facts(facts: RequestFacts) -> dict[str, Any]:
    return {
        "model": facts.model,
        "user": json.dumps(facts.user),
        "stream": facts.stream,
        "has_stream_options": facts.has_stream_options,
        "stream_options": json.dumps(facts.stream_options),
        "wants_usage": facts.wants_usage,
        "output_limit": facts.output_limit,
        "sequences": facts.sequences,
    }


def loads_object(body: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


PROMPT_KEYS = {
    Endpoint.CHAT: "messages",
    Endpoint.COMPLETIONS: "prompt",
    Endpoint.RESPONSES: "input",
    Endpoint.MESSAGES: "messages",
}


def check_agrees(body: bytes, endpoint: Endpoint) -> None:
    """What the tap uses (``facts_of``) and the scan alone both read what json.loads reads,
    whenever json.loads reads an object; neither raises anything else ever."""
    obj = loads_object(body)
    facts = facts_of(body, endpoint)
    try:
        scanned: RequestFacts | None = scan(body, endpoint)
    except Undecidable:
        scanned = None
    if obj is None:
        return
    assert observed_facts(facts) == expected_facts(obj, endpoint)
    if len(body) >= scanner.WALK_MIN_BYTES:
        assert scanned is not None  # a valid object (UTF-8) never needs the full parse
    if scanned is None:
        return
    assert observed_facts(scanned) == expected_facts(obj, endpoint)
    prompt_key = PROMPT_KEYS[endpoint]
    prompt = prompt_bytes(body, endpoint, facts)
    span = scanned.prompt_span
    # Anthropic's system prompt comes first in the model's input, so first in the print.
    preamble = scanned.preamble_span if endpoint is Endpoint.MESSAGES else None
    expected = b"".join(body[slice(*part)] for part in (preamble, span) if part is not None)
    assert (None if prompt is None else bytes(prompt)) == (expected or None)
    if preamble is not None:
        assert same(json.loads(body[slice(*preamble)]), obj["system"])
    if prompt_key in obj:
        assert prompt is not None and span is not None
        assert same(json.loads(body[slice(*span)]), obj[prompt_key])
        assert bytes(prompt).endswith(body[slice(*span)])
    else:
        assert span is None


# ---- properties ------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_body())
def test_every_top_level_value_is_what_json_loads_reads(body: bytes) -> None:
    obj = json.loads(body)
    _start, spans = scan_spans(body)
    assert set(spans) == set(obj)
    for key, (begin, end) in spans.items():
        assert same(json.loads(body[begin:end]), obj[key]), key


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_body(), st.sampled_from(list(Endpoint)))
def test_facts_are_what_json_loads_reads(body: bytes, endpoint: Endpoint) -> None:
    check_agrees(body, endpoint)
    scan(body, endpoint)  # valid UTF-8 JSON objects need no full parse (raises otherwise)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_body(), st.data())
def test_a_damaged_body_never_breaks_the_scan(body: bytes, data: st.DataObject) -> None:
    """Any byte changed, cut or inserted: facts_of answers (never raises), and agrees with
    json.loads whenever json.loads still reads an object."""
    at = data.draw(st.integers(min_value=0, max_value=len(body)))
    how = data.draw(st.sampled_from(["replace", "cut", "insert"]))
    byte = bytes([data.draw(st.integers(min_value=0, max_value=255))])
    if how == "replace":
        body = body[:at] + byte + body[at + 1 :]
    elif how == "cut":
        body = body[:at]
    else:
        body = body[:at] + byte + body[at:]
    for endpoint in Endpoint:
        check_agrees(body, endpoint)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_break_the_scan(body: bytes) -> None:
    for endpoint in Endpoint:
        check_agrees(body, endpoint)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_body(), st.integers(min_value=1, max_value=40))
def test_the_python_walk_and_the_c_scanner_agree(body: bytes, padding_kb: int) -> None:
    """Past WALK_MIN_BYTES containers are walked in Python (long strings by memchr); both
    ways give the same spans, and without the decoder the walk says when it needs it."""
    obj = loads_object(body)
    assume(obj is not None)
    padded = body.rstrip()[:-1].rstrip()  # reopen the object: add a long prompt-like member
    separator = b"" if padded.endswith(b"{") else b","
    padded += separator + b'"pad":[{"content":"' + b"x" * (padding_kb * 1024) + b'"}]}'
    reference = json.loads(padded)
    _start, spans = scan_spans(padded)
    assert set(spans) == set(reference)
    for key, (begin, end) in spans.items():
        assert same(json.loads(padded[begin:end]), reference[key])
    try:
        _start, walked = scan_spans(padded, decoder=False)
    except NeedsDecoder:
        return
    assert walked == spans


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_body())
def test_include_usage_changes_nothing_else(body: bytes) -> None:
    obj = json.loads(body)
    facts = scan(body, Endpoint.CHAT)
    sent = with_include_usage(body, facts)
    # Facts from the full parse (small bodies) find the same places.
    assert with_include_usage(body, scanner.parse(body, Endpoint.CHAT)) == sent
    rewritten = json.loads(sent)
    options = obj.get("stream_options")
    expected = dict(options) if isinstance(options, dict) else {}
    expected["include_usage"] = True
    expected.pop("continuous_usage_stats", None)
    assert same(rewritten["stream_options"], expected)
    assert same(
        {k: v for k, v in rewritten.items() if k != "stream_options"},
        {k: v for k, v in obj.items() if k != "stream_options"},
    )
    # Byte for byte: only the inserted field or the last stream_options value differ.
    if facts.stream_options_span is None:
        at = facts.object_start + 1
        inserted = scanner.INCLUDE_USAGE if obj else scanner.INCLUDE_USAGE[:-1]
        assert sent == body[:at] + inserted + body[at:]
    else:
        begin, end = facts.stream_options_span
        assert sent.startswith(body[:begin]) and sent.endswith(body[end:])


# ---- the cases the properties might not draw -------------------------------------------


def test_each_body_goes_to_the_cheapest_reader_that_can_tell() -> None:
    small = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
    prompt = b'[{"role":"user","content":"hi"}]'
    long_string = small[:-1] + b',"pad":"' + b"x" * scanner.WALK_MIN_BYTES + b'"}'
    dense = small[:-1] + b',"pad":[' + b",".join([b'{"a":"b"}'] * 4000) + b"]}"

    def prompt_of(body: bytes, facts: RequestFacts) -> bytes:
        found = prompt_bytes(body, Endpoint.CHAT, facts)
        assert found is not None
        return bytes(found)

    # Small, or large and dense: msgspec (the prompt handed over as its bytes).
    for body in (small, dense):
        facts = facts_of(body, Endpoint.CHAT)
        assert facts == read(body, Endpoint.CHAT) and facts.prompt_span is None
        assert (facts.model, facts.stream, prompt_of(body, facts)) == ("m", True, prompt)
    # Large with long strings: the walk (the prompt as a span of the body).
    facts = facts_of(long_string, Endpoint.CHAT)
    assert facts == scan(long_string, Endpoint.CHAT, decoder=False)
    assert facts.prompt is None and facts.prompt_span is not None
    assert (facts.model, facts.stream, prompt_of(long_string, facts)) == ("m", True, prompt)
    # What msgspec refuses (NaN, which json reads): json for a small body, the scan with the
    # C decoder for a large dense one; the same facts, the prompt found all the same.
    for body, scanned in ((small, False), (dense, True)):
        body = body[:-1] + b',"t":NaN}'
        with pytest.raises(Undecidable):
            read(body, Endpoint.CHAT)
        facts = facts_of(body, Endpoint.CHAT)
        assert (facts.model, facts.stream, facts.scanned) == ("m", True, scanned)
        assert prompt_of(body, facts) == prompt
        check_agrees(body, Endpoint.CHAT)


@pytest.mark.parametrize(
    "body, stream, model",
    [
        # A "stream": true or a model inside a message is not the request's.
        (
            b'{"model":"m","messages":[{"role":"user","content":"x","stream":true,'
            b'"model":"inner"}],"stream":false}',
            False,
            "m",
        ),
        (b'{"messages":[{"content":{"stream":true}}],"model":"m"}', False, "m"),
        (b'{"messages":"{\\"stream\\": true}","model":"m"}', False, "m"),
        # Escapes: an escaped quote, a backslash before the closing quote, an escaped key.
        (
            b'{"messages":[{"content":"say \\"hi\\" \\\\"}],"str\\u0065am":true,"model":"m"}',
            True,
            "m",
        ),
        (b'{"messages":[{"content":"\\\\\\\\"}],"stream":true,"model":"\\u00e9"}', True, "\u00e9"),
        # Duplicate keys: the last one counts, as with json.loads.
        (b'{"stream":true,"model":"a","stream":false,"model":"b"}', False, "b"),
        (b'{"stream":false,"stream":true}', True, None),
        # A byte-order mark (json.loads takes one on bytes), whitespace everywhere.
        (b'\xef\xbb\xbf \r\n{ "stream" :\ttrue , "model" : "m" }\n', True, "m"),
    ],
)
def test_top_level_fields_only(body: bytes, stream: bool, model: str | None) -> None:
    for facts in (facts_of(body, Endpoint.CHAT), scan(body, Endpoint.CHAT)):
        assert (facts.stream, facts.model) == (stream, model)
    check_agrees(body, Endpoint.CHAT)


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","messages":' + deep(100_000) + b',"stream":true}',
        b'{"model":"m","messages":[{"content":"'
        + b"x" * 20_000
        + b'"},'
        + deep(100_000)
        + b'],"stream":true}',
        b'{"stream_options":' + deep(100_000) + b',"stream":true}',
        b'{"stream":true,"max_tokens":' + b"9" * 100_000 + b"}",
        b'{"model":"m","messages":[' + b"9" * 100_000 + b'],"stream":true}',
        b'{"model":"\xff\xfe","stream":true}',
        b'{"m\xffodel":"m","stream":true}',
        b'{"model":"m","stream":true} {}',
        b'{"model":"m","stream":tru}',
        b'{"model":"m","stream":true,}',
        b'["model","m"]',
        '{"model":"m","stream":true}'.encode("utf-16"),
        b"",
        b"{",
        b'{"' + b"\\" * 10_001 + b'"',
    ],
)
def test_hostile_bodies_are_read_as_json_loads_reads_them_or_not_at_all(body: bytes) -> None:
    for endpoint in Endpoint:
        facts = facts_of(body, endpoint)  # never raises
        check_agrees(body, endpoint)
        if loads_object(body) is None and not facts.scanned:
            assert facts == NOT_AN_OBJECT


def test_huge_numbers_are_decoded_as_json_loads_decodes_them() -> None:
    facts = facts_of(
        b'{"max_tokens":1e999,"stream":true,"stream_options":{"x":1e-999}}', Endpoint.CHAT
    )
    assert facts.output_limit is None  # inf is no token count
    assert facts.stream_options == {"x": 0.0}
    facts = facts_of(b'{"max_tokens":' + b"1" * 4000 + b"}", Endpoint.COMPLETIONS)
    assert facts.output_limit == int("1" * 4000)


def test_invalid_utf8_in_a_skipped_string_leaves_the_fields_readable() -> None:
    """json.loads refuses the body; vLLM will too (400). The tap still knows whose it is."""
    body = b'{"user":"alice","messages":[{"content":"\xff\xfe"}],"stream":true}'
    facts = scan(body, Endpoint.CHAT)
    assert (facts.user, facts.stream, facts.scanned) == ("alice", True, True)


def test_many_escaped_quotes_go_to_the_c_scanner() -> None:
    body = b'{"messages":[{"content":"' + b'\\"' * 50_000 + b'"}],"model":"m","stream":true}'
    assert facts_of(body, Endpoint.CHAT).model == "m"
    with pytest.raises(NeedsDecoder):
        scan(body, Endpoint.CHAT, decoder=False)


@pytest.mark.parametrize(
    "endpoint, body, limit, prompt",
    [
        (
            Endpoint.CHAT,
            b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":5}',
            5,
            b'[{"role":"user","content":"hi"}]',
        ),
        (Endpoint.CHAT, b'{"max_completion_tokens":7,"max_tokens":5,"messages":[]}', 7, b"[]"),
        (Endpoint.CHAT, b'{"max_completion_tokens":null,"max_tokens":5}', 5, None),
        (Endpoint.CHAT, b'{"max_tokens":true}', None, None),
        (Endpoint.CHAT, b'{"max_tokens":5.0}', None, None),
        (Endpoint.COMPLETIONS, b'{"prompt":"once upon",  "max_tokens":9}', 9, b'"once upon"'),
        (Endpoint.COMPLETIONS, b'{"prompt":[1,2,3],"max_completion_tokens":9}', None, b"[1,2,3]"),
        (Endpoint.RESPONSES, b'{"input":"x","max_output_tokens":3,"max_tokens":9}', 3, b'"x"'),
    ],
)
def test_output_limit_and_prompt(
    endpoint: Endpoint, body: bytes, limit: int | None, prompt: bytes | None
) -> None:
    facts = facts_of(body, endpoint)
    assert facts.output_limit == limit
    found = prompt_bytes(body, endpoint, facts)
    assert (bytes(found) if found is not None else None) == prompt
    parsed = scanner.parse(body, endpoint)  # the same from a full parse: found on demand
    found = prompt_bytes(body, endpoint, parsed)
    assert (bytes(found) if found is not None else None) == prompt


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32-le"])
def test_a_body_the_scan_cannot_read_is_rewritten_whole_only_for_stream_options(
    encoding: str,
) -> None:
    """json reads UTF-16 and UTF-32 bodies, with or without a BOM; a UTF-16-LE one begins
    with the object's "{" byte all the same, and nothing may be spliced after it."""
    body = '{"stream":true,"model":"m"}'.encode(encoding)
    facts = facts_of(body, Endpoint.CHAT)
    assert not facts.scanned and facts.stream
    assert json.loads(with_include_usage(body, facts)) == {
        "stream": True,
        "model": "m",
        "stream_options": {"include_usage": True},
    }


@example(b'{"stream":true}')
@given(st.binary(max_size=64))
def test_scan_raises_only_undecidable(body: bytes) -> None:
    try:
        scan(body, Endpoint.CHAT)
    except Undecidable:
        pass


def test_not_a_number_is_kept_as_json_loads_keeps_it() -> None:
    facts = facts_of(b'{"stream_options":{"x":NaN},"stream":true}', Endpoint.CHAT)
    assert math.isnan(facts.stream_options["x"])


def handed_to_threads(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The functions the running loop hands to worker threads from now on."""
    loop = asyncio.get_running_loop()
    handed: list[Any] = []
    original = loop.run_in_executor

    def spy(executor: Any, work: Any, *args: Any) -> Any:
        handed.append(work)
        return original(executor, work, *args)

    monkeypatch.setattr(loop, "run_in_executor", spy)
    return handed


def test_large_bodies_are_read_on_the_loop_unless_only_a_decoder_can_read_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past PARSE_INLINE_MAX_BYTES a body goes to a worker thread only when neither the walk
    nor (up to READ_INLINE_MAX_BYTES) msgspec can read it."""
    from exporter.usage.tap import proxy

    head = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"pad":'
    long_string = head + b'"' + b"x" * 400_000 + b'"}'
    dense = head + b"[" + b",".join([b'{"a":"b"}'] * 40_000) + b"]}"  # 400 KB of it
    huge_dense = head + b"[" + b",".join([b'{"a":"b"}'] * 150_000) + b"]}"  # 1.5 MB
    refused = dense[:-1] + b',"t":NaN}'  # msgspec refuses it; json reads it
    assert proxy.PARSE_INLINE_MAX_BYTES < len(dense) < proxy.READ_INLINE_MAX_BYTES
    assert len(huge_dense) > proxy.READ_INLINE_MAX_BYTES

    async def facts(body: bytes) -> tuple[RequestFacts, bool]:
        threaded = handed_to_threads(monkeypatch)
        return await proxy.read_request(body, Endpoint.CHAT), bool(threaded)

    for body, off_the_loop in (
        (long_string, False),
        (dense, False),
        (huge_dense, True),
        (refused, True),
    ):
        found, threaded = asyncio.run(facts(body))
        assert threaded == off_the_loop
        assert (found.model, found.stream) == ("m", True)
        prompt = prompt_bytes(body, Endpoint.CHAT, found)
        assert prompt is not None and bytes(prompt) == b'[{"role":"user","content":"hi"}]'


def test_asking_a_large_dense_body_for_usage_finds_its_options_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Facts read by msgspec have no positions: a large body whose stream_options must be
    rewritten is searched by the C scanner in a worker thread, and changes only there."""
    from exporter.usage.tap import proxy

    messages = b"[" + b",".join([b'{"a":"b"}'] * 40_000) + b"]"  # 400 KB, dense
    options = b'{"continuous_usage_stats":true}'
    body = (
        b'{"model":"m","stream":true,"stream_options":'
        + options
        + b',"messages":'
        + messages
        + b"}"
    )
    small = b'{"model":"m","stream":true,"stream_options":' + options + b',"messages":[]}'

    async def rewritten(body: bytes) -> tuple[bytes, list[Any]]:
        threaded = handed_to_threads(monkeypatch)
        facts = await proxy.read_request(body, Endpoint.CHAT)
        return await proxy.ask_for_usage(body, facts), threaded

    sent, threaded = asyncio.run(rewritten(body))
    assert threaded == [with_include_usage]  # read by msgspec on the loop, rewritten off it
    assert sent == body.replace(options, b'{"include_usage":true}')
    sent, threaded = asyncio.run(rewritten(small))
    assert threaded == []
    assert sent == small.replace(options, b'{"include_usage":true}')


def test_an_anthropic_prompt_print_starts_with_its_system_prompt():
    """The model reads Messages' ``system`` first: a timestamp at its top is a variable top,
    so the print covers the system prompt, then the messages, whichever reader ran."""
    system = "Current time: 2026-12-01T20:00Z. " + "You are a careful agent. " * 40
    messages = [{"role": "user", "content": "step 1"}]
    for body in (
        json.dumps(
            {"model": "m", "max_tokens": 8, "system": system, "messages": messages}
        ).encode(),
        json.dumps(
            {"messages": messages, "system": system, "pad": "x" * 20000, "max_tokens": 8}
        ).encode(),
    ):
        for facts in (
            facts_of(body, Endpoint.MESSAGES),
            scan(body, Endpoint.MESSAGES),
            scanner.parse(body, Endpoint.MESSAGES),
        ):
            printed = bytes(prompt_bytes(body, Endpoint.MESSAGES, facts) or b"")
            assert printed == json.dumps(system).encode() + json.dumps(messages).encode()
    # Without a system prompt, the messages alone.
    body = json.dumps({"messages": messages}).encode()
    assert (
        bytes(prompt_bytes(body, Endpoint.MESSAGES, facts_of(body, Endpoint.MESSAGES)) or b"")
        == json.dumps(messages).encode()
    )
