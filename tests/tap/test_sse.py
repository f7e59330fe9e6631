"""The stream reader alone: whatever the chunk boundaries, the client gets every byte but the
injected usage chunk, and the usage is read from it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.usage.openai import StreamReader, event_data

from .conftest import fixture_bytes, without_usage_chunk

CHAT = fixture_bytes("03_chat_stream_warm.sse.txt")
COMPLETION = fixture_bytes("06_completion_stream.sse.txt")
RESPONSES = fixture_bytes("09_responses_stream_warm.sse.txt")


def run(raw: bytes, cuts: list[int], strip: bool) -> tuple[bytes, StreamReader]:
    reader = StreamReader(strip_usage_chunk=strip, started=0.0)
    out = b""
    points = sorted({cut % (len(raw) + 1) for cut in cuts} | {0, len(raw)})
    for now, (start, end) in enumerate(zip(points, points[1:], strict=False)):
        out += reader.feed(raw[start:end], float(now))
    return out + reader.finish(), reader


cuts = st.lists(st.integers(min_value=0, max_value=10_000), max_size=40)


@settings(max_examples=200, deadline=None)
@given(cuts=cuts, raw=st.sampled_from([CHAT, COMPLETION]))
def test_strip_mode_removes_only_the_usage_chunk(cuts, raw):
    out, reader = run(raw, cuts, strip=True)
    assert out == without_usage_chunk(raw)
    assert reader.usage is not None and reader.usage.cached_tokens in (1376, 1344)
    assert reader.ttft_seconds is not None
    assert reader.problems == []


@settings(max_examples=200, deadline=None)
@given(cuts=cuts, raw=st.sampled_from([CHAT, COMPLETION, RESPONSES]))
def test_pass_through_mode_forwards_everything(cuts, raw):
    out, reader = run(raw, cuts, strip=False)
    assert out == raw
    assert reader.usage is not None and reader.usage.cached_tokens in (1376, 1344, 256)


@settings(max_examples=100, deadline=None)
@given(cuts=cuts)
def test_crlf_line_endings(cuts):
    raw = CHAT.replace(b"\n", b"\r\n")
    out, reader = run(raw, cuts, strip=True)
    assert b'"usage"' not in out
    assert out == without_usage_chunk(CHAT).replace(b"\n", b"\r\n")
    assert reader.usage is not None and reader.usage.cached_tokens == 1376


@given(
    raw=st.sampled_from([CHAT, COMPLETION, RESPONSES]),
    strip=st.booleans(),
    failure=st.sampled_from(
        [
            None,
            b'data: {"error": {"message": "engine died", "code": 503}}\n\n',
            b'data: {"type": "response.failed"}\n\n',
        ]
    ),
)
def test_event_by_event_as_vllm_writes_them(raw, strip, failure):
    """vLLM writes one event per chunk: after the first content, the chunks without usage or
    an error pass untouched, and the usage chunk and an error after them are still read."""
    strip = strip and raw is not RESPONSES  # the Responses API has no injected chunk
    events = [part + b"\n\n" for part in raw.split(b"\n\n") if part]
    if failure is not None:
        events.insert(len(events) - 1, failure)
    reader = StreamReader(strip_usage_chunk=strip, started=0.0)
    out = b"".join(reader.feed(event, float(n)) for n, event in enumerate(events))
    whole = b"".join(events)
    assert out + reader.finish() == (without_usage_chunk(whole) if strip else whole)
    assert reader.usage is not None and reader.usage.cached_tokens in (1376, 1344, 256)
    assert reader.ttft_seconds is not None and reader.ttft_seconds < len(events) - 2
    assert reader.error_status == (None if failure is None else 503 if b"503" in failure else 500)


def reading(reader: StreamReader) -> tuple:
    return (
        reader.usage,
        reader.model,
        reader.engine,
        reader.ttft_seconds,
        reader.error_status,
        reader.problems,
        reader.final_usage,
    )


# No content at all (a stream cut short, or a logged one): nothing to jump by.
NO_CONTENT = b"".join(
    part + b"\n\n"
    for part in CHAT.split(b"\n\n")
    if b'"content":"' not in part or b'"content":""' in part
)


@settings(max_examples=300, deadline=None)
@given(
    raw=st.sampled_from([CHAT, COMPLETION, RESPONSES, NO_CONTENT]),
    extra=st.lists(
        st.sampled_from(
            [
                b": keep-alive",
                b"event: ping",
                b"data: {not json",
                b"data: [DONE]",
                b'data: {"error": {"message": "engine died", "code": 503}}',
                b'data: {"type": "response.failed"}',
                b'data: {"usage": 1}',
                b'data: {"choices": [{"delta": {"content": "x"}}]}',
            ]
        ),
        max_size=4,
    ),
    seed=st.randoms(use_true_random=False),
    strip=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=6),
)
def test_whole_chunks_read_as_the_byte_by_byte_path_does(raw, extra, seed, strip, cuts):
    """A chunk of whole events is read where it lies, jumping to the events that mention
    usage or an error once the content has begun; fed byte by byte, the same stream goes
    through the buffer, event by event. Both must forward the same bytes and read the same,
    whatever the events and however many line feeds end them (a run of more than two)."""
    events = [part for part in raw.split(b"\n\n") if part]
    for event in extra:
        events.insert(seed.randrange(len(events) + 1), event)
    stream = b"".join(event + b"\n" * seed.choice([2, 2, 2, 3, 4, 5]) for event in events)
    if not stream.endswith(b"\n\n"):
        stream += b"\n"
    whole = StreamReader(strip_usage_chunk=strip, started=0.0)
    points = sorted(
        {0, len(stream)}
        | {
            cut % (len(stream) + 1)
            for cut in cuts
            if stream[: cut % (len(stream) + 1)].endswith(b"\n\n")
        }
    )
    out = b"".join(whole.feed(stream[a:b], 1.0) for a, b in zip(points, points[1:], strict=False))
    out += whole.finish()
    by_byte = StreamReader(strip_usage_chunk=strip, started=0.0)
    reference = b"".join(by_byte.feed(stream[i : i + 1], 1.0) for i in range(len(stream)))
    reference += by_byte.finish()
    assert out == reference
    assert reading(whole) == reading(by_byte)


def test_ttft_is_the_time_of_the_first_content_chunk():
    reader = StreamReader(strip_usage_chunk=False, started=10.0)
    events = [part + b"\n\n" for part in CHAT.split(b"\n\n") if part]
    reader.feed(events[0], 11.0)  # role only, empty content
    assert reader.ttft_seconds is None
    reader.feed(events[1], 12.5)
    reader.feed(events[2], 13.0)
    assert reader.ttft_seconds == 2.5


def test_an_oversized_event_is_forwarded_unread_and_the_stream_resyncs():
    big = b"data: " + b"x" * 5000 + b"\n\n"
    raw = big + CHAT
    reader = StreamReader(strip_usage_chunk=True, started=0.0, max_event_bytes=1024)
    out = b"".join(reader.feed(raw[i : i + 100], 0.0) for i in range(0, len(raw), 100))
    out += reader.finish()
    assert out == big + without_usage_chunk(CHAT)
    assert reader.problems == ["stream_event_too_large"]
    assert reader.usage is not None and reader.usage.cached_tokens == 1376


def test_garbage_events_are_counted_and_forwarded():
    raw = b"data: {not json\n\n: a comment\n\nevent: ping\n\n" + CHAT
    out, reader = run(raw, [3, 50, 51], strip=True)
    assert out == raw[: raw.index(CHAT)] + without_usage_chunk(CHAT)
    assert reader.problems == ["stream_event_not_json"]
    assert reader.usage is not None


def test_event_data_joins_multi_line_data():
    assert event_data(b'event: x\ndata: {"a":\ndata:1}\n\n') == b'{"a":\n1}'
    assert event_data(b": comment only\n\n") is None
    assert event_data(b"data: [DONE]\n\n") == b"[DONE]"


@pytest.mark.parametrize("run, cut_after", [(3, 3), (3, 2), (4, 3), (5, 3), (5, 4)])
def test_a_run_of_line_feeds_split_between_chunks_before_the_usage_chunk(run, cut_after):
    """The terminal chunk ends in a run of more than two line feeds, the chunk boundary falls
    inside the run, and the injected usage chunk follows: the pairs are taken from the left
    across the boundary as byte by byte, so exactly the bytes the byte-by-byte path sends go
    out (an odd line feed at a chunk's end begins the usage chunk and goes with it)."""
    events = [part for part in CHAT.split(b"\n\n") if part]
    terminal = next(i for i, event in enumerate(events) if b'"finish_reason":"length"' in event)
    stream = b""
    for index, event in enumerate(events):
        stream += event + b"\n" * (run if index == terminal else 2)
    cut = stream.index(events[terminal]) + len(events[terminal]) + cut_after
    whole = StreamReader(strip_usage_chunk=True, started=0.0)
    out = whole.feed(stream[:cut], 1.0) + whole.feed(stream[cut:], 1.0) + whole.finish()
    by_byte = StreamReader(strip_usage_chunk=True, started=0.0)
    reference = b"".join(by_byte.feed(stream[i : i + 1], 1.0) for i in range(len(stream)))
    reference += by_byte.finish()
    assert out == reference
    assert b'"usage"' not in out and out.endswith(b"data: [DONE]\n\n")
    assert reading(whole) == reading(by_byte)
