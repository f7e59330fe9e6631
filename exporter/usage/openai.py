"""The one reader of OpenAI-shaped bodies: usage, model, first content and errors.

Used by the ``openai`` format (a response the proxy logged, whole or as SSE text) and by the
tap (the live response, whole or streamed), so both read the same fields the same way:

- chat and completions put the numbers in ``usage``: ``prompt_tokens``,
  ``completion_tokens``, ``prompt_tokens_details.cached_tokens`` (the details only when vLLM
  runs with ``--enable-prompt-tokens-details``);
- the Responses API in the response object's ``usage``: ``input_tokens``, ``output_tokens``,
  ``input_tokens_details.cached_tokens``;
- Anthropic's Messages API (vLLM serves ``/v1/messages``; LiteLLM and some gateways
  translate to it): ``input_tokens`` excludes both ``cache_read_input_tokens`` and
  ``cache_creation_input_tokens``, so the prompt is their sum and the cached part is the
  cache read. A whole message has it in ``usage``; a stream in ``message_start``'s
  ``message.usage`` and then, cumulatively, in ``message_delta``'s ``usage``, whose fields
  replace the start's (vLLM sends every field there; Anthropic only ``output_tokens``).

A missing or null cached count means "not reported", never 0. Counts are checked with the
same rules and rejection reasons as every other usage record (``exporter.usage.event``).

vLLM started with ``--enable-per-request-metrics`` adds its own timings of the request: a
top-level ``metrics`` object on a whole response, and on the final usage chunk of a stream
(on the Responses API, on the response object). ``time_to_first_token_ms`` runs from the
request being scheduled to its first token and ``queue_time_ms`` from being queued in the
engine to being scheduled (``vllm/entrypoints/generate/base/protocol.py``,
``PerRequestMetrics``); either is null when vLLM lacks the timestamps, and the object is
absent for ``n > 1``. They are read as ``EngineTimings``, the engine's figures, which a
proxy's own clock cannot give.

Streams are read by ``StreamReader``, event by event whatever the chunk boundaries; nothing
here reads a clock (the caller passes the time in).

What is read is decoded JSON, so a JSON object is a ``dict`` (as ``json`` and orjson give
it), and that is what is checked for: anything else is not an object here.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from exporter.usage.event import MAX_SECONDS, InvalidEvent, duration, loads, token_count


class Endpoint(enum.Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"  # Anthropic's Messages API


ENDPOINTS = {endpoint.value: endpoint for endpoint in Endpoint}
# Endpoints whose stream carries usage only when asked via stream_options.include_usage.
USAGE_OPT_IN = (Endpoint.CHAT, Endpoint.COMPLETIONS)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int | None
    cached_tokens: int | None  # None: the server did not report it


def parse_usage(usage: Any) -> Usage | None:
    """Any of the usage shapes above -> Usage; None when there is no usage object at all.

    Raises InvalidEvent (with the reason a usage record would get) for unusable numbers.
    """
    if not isinstance(usage, dict):
        return None
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
        read = token_count(usage, "cache_read_input_tokens", required=False)
        created = token_count(usage, "cache_creation_input_tokens", required=False) or 0
        uncached = token_count(usage, "input_tokens", required=True) or 0
        prompt = uncached + (read or 0) + created
        completion = token_count(usage, "output_tokens", required=False)
        return _checked(prompt, completion, read)
    if "input_tokens" in usage or "input_tokens_details" in usage:
        prompt_key, completion_key, details_key = (
            "input_tokens",
            "output_tokens",
            "input_tokens_details",
        )
    else:
        prompt_key, completion_key, details_key = (
            "prompt_tokens",
            "completion_tokens",
            "prompt_tokens_details",
        )
    prompt = token_count(usage, prompt_key, required=True) or 0
    completion = token_count(usage, completion_key, required=False)
    details = usage.get(details_key)
    cached = (
        token_count(details, "cached_tokens", required=False) if isinstance(details, dict) else None
    )
    return _checked(prompt, completion, cached)


def _checked(prompt: int, completion: int | None, cached: int | None) -> Usage:
    if cached is not None and cached > prompt:
        raise InvalidEvent("cached_exceeds_prompt", "cached_tokens is larger than prompt_tokens")
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


def usage_of(obj: Any) -> tuple[Usage | None, str | None]:
    """(usage, model) of a whole response body or of one stream event's JSON.

    An Anthropic message always carries usage: one whose usage is not an object raises
    InvalidEvent ``malformed_messages``.
    """
    if not isinstance(obj, dict):
        return None, None
    obj = _response_object(obj)
    model = obj.get("model")
    usage = obj.get("usage")
    if obj.get("type") == "message" and not isinstance(usage, dict):
        raise InvalidEvent("malformed_messages", "an Anthropic message has no usage object")
    return parse_usage(usage), model if isinstance(model, str) else None


def _response_object(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The object that holds usage and metrics: a Responses API stream event wraps it in
    ``response``, an Anthropic ``message_start`` in ``message``."""
    for wrapper in ("response", "message"):
        inner = obj.get(wrapper)
        if isinstance(inner, dict) and "usage" in inner:
            return inner
    return obj


@dataclass(frozen=True)
class EngineTimings:
    """vLLM's own timings of one request, in seconds (None: vLLM had no figure)."""

    ttft_seconds: float | None
    queue_seconds: float | None


def engine_timings_of(obj: Any) -> EngineTimings | None:
    """vLLM's per-request ``metrics`` of a whole response or of a stream's usage event.

    None when there is no ``metrics`` object (vLLM without ``--enable-per-request-metrics``,
    or ``n > 1``). A figure that is there but not a usable number of milliseconds raises
    InvalidEvent with the reason any other unusable number gets.
    """
    if not isinstance(obj, dict):
        return None
    metrics = _response_object(obj).get("metrics")
    if not isinstance(metrics, dict):
        return None
    return EngineTimings(
        _milliseconds(metrics, "time_to_first_token_ms"), _milliseconds(metrics, "queue_time_ms")
    )


def _milliseconds(metrics: Mapping[str, Any], key: str) -> float | None:
    """A duration in [0, a day], in seconds."""
    value = duration(metrics, key, MAX_SECONDS * 1000, f"metrics.{key}", "milliseconds")
    return None if value is None else value / 1000.0


def is_usage_only_chunk(obj: Any) -> bool:
    """The final ``choices: []`` chunk that include_usage adds to a chat/completion stream."""
    return isinstance(obj, dict) and obj.get("choices") == [] and isinstance(obj.get("usage"), dict)


def _non_empty(value: Any) -> bool:
    return bool(value) if isinstance(value, (str, list, dict)) else False


_CONTENT_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")
_MESSAGES_DELTA_KEYS = ("text", "thinking", "partial_json")


def carries_content(obj: Any) -> bool:
    """True for the first stream event a user would see text (or a tool call) from."""
    if not isinstance(obj, dict):
        return False
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if _non_empty(choice.get("text")):  # completions
                return True
            delta = choice.get("delta")
            if isinstance(delta, dict):
                for key in _CONTENT_KEYS:
                    if _non_empty(delta.get(key)):
                        return True
        return False
    event_type = obj.get("type")
    if event_type == "content_block_delta":  # Anthropic: text, thinking or tool input
        delta = obj.get("delta")
        return isinstance(delta, dict) and any(
            _non_empty(delta.get(key)) for key in _MESSAGES_DELTA_KEYS
        )
    # Responses API: response.output_text.delta etc.
    return (
        isinstance(event_type, str)
        and event_type.endswith(".delta")
        and _non_empty(obj.get("delta"))
    )


def stream_error_status(obj: Any) -> int | None:
    """vLLM reports a failure inside a 200 stream as ``{"error": {..., "code": 400}}``."""
    if not isinstance(obj, dict):
        return None
    error = obj.get("error")
    if not isinstance(error, dict):
        if obj.get("type") in ("error", "response.failed"):
            return 500
        return None
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    return 500


# ---- server-sent events ------------------------------------------------------------------

_TERMINATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")
_USAGE = b'"usage"'
_ERROR = b'"error"'
_RESPONSE_FAILED = b"response.failed"


def _even_tail(chunk: bytes) -> bool:
    """The run of line feeds that ends ``chunk`` is whole blank lines: an odd one left over
    begins the next event (pairs are taken from the left), so such a chunk goes through the
    buffer, which keeps that line feed with the event it begins."""
    end = len(chunk)
    while end > 0 and chunk[end - 1] == 10:  # b"\n", counted without copying the chunk
        end -= 1
    return (len(chunk) - end) % 2 == 0


def _next_mention(chunk: bytes | bytearray, start: int) -> int:
    """Where, at or after ``start``, the first mention of usage or an error is (else -1):
    after the first content, the only events the stream reader reads."""
    first = -1
    for mention in (_USAGE, _ERROR, _RESPONSE_FAILED):
        at = chunk.find(mention, start)
        if at >= 0 and (first < 0 or at < first):
            first = at
    return first


def _find_end(buffer: bytearray, start: int) -> int:
    """Index just past the first event terminator at or after ``start``, else -1."""
    best = -1
    for terminator in _TERMINATORS:
        at = buffer.find(terminator, start)
        if at >= 0 and (best < 0 or at + len(terminator) < best):
            best = at + len(terminator)
    return best


def _find_lf_end(buffer: bytearray, start: int) -> int:
    """``_find_end`` for a buffer without a carriage return (one search, not three)."""
    at = buffer.find(b"\n\n", start)
    return at + 2 if at >= 0 else -1


def event_data(event: bytes) -> bytes | None:
    """The joined ``data:`` lines of one event (None when it has none)."""
    if event.startswith(b"data: ") and event.count(b"\n") <= 2 and b"\r" not in event:
        return event[6:].rstrip(b"\n")  # the common one-line shape vLLM sends
    lines = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines)


class StreamReader:
    """Reads one SSE response: what to forward, and the usage, model, TTFT and errors in it.

    Upstream chunk boundaries do not follow event boundaries (TCP splits and merges writes),
    so events are cut on the blank line that ends them, whatever chunks they arrived in. Two
    modes:

    - pass-through: every chunk is forwarded the moment it arrives, the bytes are only read;
    - strip: the tap injected ``stream_options.include_usage``, so the usage-only chunk it
      caused must not reach the client. Whole events are forwarded as soon as their blank
      line arrives; the usage chunk is dropped; after it the stream is pass-through again.

    JSON is decoded only where needed: every event until the first one that carries content
    (TTFT), then only events that mention usage or an error.
    """

    def __init__(
        self, strip_usage_chunk: bool, started: float, max_event_bytes: int = 8 * 1024 * 1024
    ) -> None:
        self.strip = strip_usage_chunk
        self.started = started
        self.max_event_bytes = max_event_bytes
        self.usage: Usage | None = None
        self.final_usage = False  # usage came from the choices: [] chunk (authoritative)
        self.model: str | None = None
        self.engine: EngineTimings | None = None  # vLLM's own, from the final usage chunk
        self.ttft_seconds: float | None = None
        self.error_status: int | None = None
        self.problems: list[str] = []  # rejection reasons of events that could not be read
        self._buffer = bytearray()
        self._scan_from = 0
        self._oversized = False  # inside an event too large to read; skip to its end
        # An Anthropic stream's message_start usage, which its message_deltas update.
        self._messages_usage: dict[str, Any] | None = None
        # Strip mode: terminal chunks held until the usage chunk, and its fingerprint.
        self._held: bytearray | None = None
        self._fingerprint: Any = None

    def feed(self, chunk: bytes, now: float) -> bytes:
        """Take one upstream chunk; return the bytes to send the client now."""
        if not self.strip:
            return self._read(chunk, now)
        return self._hold_terminal(self._read(chunk, now))

    def _read(self, chunk: bytes, now: float) -> bytes:
        if (
            not self._buffer
            and not self._oversized
            and chunk.endswith(b"\n\n")
            and b"\r" not in chunk
            and _even_tail(chunk)
        ):
            return self._whole_events(chunk, now)
        if not self.strip:
            self._consume(chunk, now)
            return chunk
        out = bytearray()
        self._consume(chunk, now, out)
        return bytes(out)

    def _hold_terminal(self, out: bytes) -> bytes:
        """Strip mode: what to send of ``out`` (whole events, the usage chunk removed).

        vLLM stamps ``system_fingerprint`` on a stream's terminal chunks (those with a
        ``finish_reason``) only when no usage chunk follows; asked for usage, it puts it on
        the usage chunk instead, which the tap drops. So from the first terminal chunk on,
        events are held back until the usage chunk has been read (vLLM sends it right after
        them), and go out with its ``system_fingerprint``, as vLLM would have sent them to
        the client directly."""
        if self._held is None:
            at = out.find(_TERMINAL)
            if at < 0:
                return out
            begin = out.rfind(b"\n\n", 0, at)
            begin = 0 if begin < 0 else begin + 2
            send, self._held = out[:begin], bytearray(out[begin:])
        else:
            send = b""
            self._held += out
        if self.strip:  # the usage chunk is still to come
            return send
        held, self._held = bytes(self._held), None
        return send + with_fingerprint(held, self._fingerprint)

    def _whole_events(self, chunk: bytes, now: float) -> bytes:
        """The common case, a chunk of whole events (vLLM writes one event per chunk), each
        ending in a blank line, and nothing held: the events are read where they lie, and
        the chunk is forwarded as it is, or without the injected usage chunk.

        Once the first content is seen, only events that mention usage or an error are
        read (``_read_event`` skips the others): the reading jumps from one such mention to
        the next, to the start of the event holding it, instead of visiting every event, and
        a chunk with none (most of a stream: vLLM writes one event per chunk) is forwarded
        at once."""
        start = 0
        size = len(chunk)
        while start < size:
            if self.ttft_seconds is not None:
                mention = _next_mention(chunk, start)
                if mention < 0:
                    return chunk
                # The event holding it begins after the last blank line before it (an event
                # holds none). In a run of more than two line feeds, the pairs are taken
                # from the left, as ``split`` takes them: an odd one begins the event.
                blank = chunk.rfind(b"\n\n", start, mention)
                if blank >= 0:
                    run = blank
                    while run > start and chunk[run - 1] == 10:  # b"\n"
                        run -= 1
                    start = run + (blank + 2 - run) // 2 * 2
            end = chunk.find(b"\n\n", start) + 2
            if end < 2:  # a lone line feed after the last blank line: not an event
                return chunk
            if self._read_event(chunk[start : end - 2], now):
                # The injected usage chunk is gone; the rest of the stream passes untouched.
                self.strip = False
                rest = chunk[end:]
                if rest:
                    self._whole_events(rest, now)
                return chunk[:start] + rest
            start = end
        return chunk

    def finish(self) -> bytes:
        """End of stream: whatever is still held (terminal chunks whose usage chunk never
        came, an unterminated last event)."""
        held = bytes(self._held or b"") + (bytes(self._buffer) if self.strip else b"")
        self._held = None
        self._buffer.clear()
        return held

    def _consume(self, chunk: bytes, now: float, out: bytearray | None = None) -> None:
        buffer = self._buffer
        buffer += chunk
        carriage_returns = b"\r" in buffer
        while buffer:
            end = (
                _find_end(buffer, self._scan_from)
                if carriage_returns
                else _find_lf_end(buffer, self._scan_from)
            )
            if end < 0:
                # Keep the tail that may start a terminator split across chunks.
                self._scan_from = max(0, len(buffer) - 3)
                if len(buffer) > self.max_event_bytes:
                    self._give_up_on_event(out)
                return
            event = bytes(buffer[:end])
            del buffer[:end]
            self._scan_from = 0
            if self._oversized:
                self._oversized = False
                if out is not None:
                    out += event
                continue
            drop = self._read_event(event, now)
            if out is None:
                continue
            if not drop:
                out += event
                continue
            # The injected usage chunk is gone; the rest of the stream passes untouched.
            self.strip = False
            out += buffer
            out = None

    def _give_up_on_event(self, out: bytearray | None) -> None:
        """An event larger than any usage chunk: forward it unread, resync at its end."""
        if not self._oversized:
            self.problems.append("stream_event_too_large")
        self._oversized = True
        keep = len(_TERMINATORS[1]) - 1  # these may begin the terminator
        if out is not None:
            out += self._buffer[:-keep]
        del self._buffer[:-keep]
        self._scan_from = 0

    def _read_event(self, event: bytes, now: float) -> bool:
        """Read one complete event; True when it is the injected usage chunk to drop."""
        need_content = self.ttft_seconds is None
        if not need_content and _next_mention(event, 0) < 0:
            return False
        data = event_data(event)
        if data is None or data == b"[DONE]":
            return False
        try:
            obj: Any = loads(data)
        except ValueError:
            self.problems.append("stream_event_not_json")
            return False
        if need_content and carries_content(obj):
            self.ttft_seconds = max(0.0, now - self.started)
        status = stream_error_status(obj)
        if status is not None and self.error_status is None:
            self.error_status = status
        if not isinstance(obj, dict):
            return False
        kind = obj.get("type")
        if isinstance(kind, str) and kind in _MESSAGES_USAGE_EVENTS:
            self._read_messages_usage(obj)
            return False
        if "usage" not in obj and "response" not in obj:
            return False
        return self._read_usage(obj)

    def _read_usage(self, obj: dict[str, Any]) -> bool:
        """An OpenAI event that holds usage; True when it is the injected usage chunk."""
        only_usage = is_usage_only_chunk(obj)
        try:
            usage, model = usage_of(obj)
            timings = engine_timings_of(obj)
        except InvalidEvent as err:
            self.problems.append(err.reason)
            return self.strip and only_usage  # unreadable, but still the tap's own chunk
        if model is not None:
            self.model = model
        if self.strip and only_usage:
            self._fingerprint = obj.get("system_fingerprint")
        if usage is None:
            return False
        if only_usage or not self.final_usage:
            # continuous_usage_stats puts usage on every chunk without the details; the
            # final choices: [] chunk (or the Responses API's completed event) is the truth,
            # and the only one vLLM puts its per-request metrics on.
            self.usage = usage
            self.final_usage = only_usage or "response" in obj
            if timings is not None:
                self.engine = timings
        return self.strip and only_usage

    def _read_messages_usage(self, obj: dict[str, Any]) -> None:
        """An Anthropic stream's usage: ``message_start``'s ``message.usage``, then each
        ``message_delta``'s ``usage`` over it (cumulative counts: a field there replaces the
        start's). The last delta is the final figure. An event whose usage is not an object
        is counted as ``malformed_messages``."""
        if obj["type"] == "message_start":
            message = obj.get("message")
            raw = message.get("usage") if isinstance(message, dict) else None
            model = message.get("model") if isinstance(message, dict) else None
            if isinstance(model, str):
                self.model = model
        else:
            raw = obj.get("usage")
        if not isinstance(raw, dict):
            self.problems.append("malformed_messages")
            return
        if obj["type"] == "message_start":
            self._messages_usage = raw
        elif self._messages_usage is not None:
            raw = {**self._messages_usage, **raw}
        try:
            self.usage = parse_usage(raw)
        except InvalidEvent as err:
            self.problems.append(err.reason)
            return
        self.final_usage = obj["type"] == "message_delta"


_MESSAGES_USAGE_EVENTS = frozenset({"message_start", "message_delta"})
# How vLLM writes a choice's finish_reason once it is set (null before): the terminal chunk.
_TERMINAL = b'"finish_reason":"'
_FINGERPRINT_KEY = b'"system_fingerprint"'


def with_fingerprint(events: bytes, fingerprint: Any) -> bytes:
    """``events`` with ``system_fingerprint`` added to each terminal chunk that lacks it.

    vLLM writes the field last in the chunk's object, so it goes before the object's closing
    brace: the bytes are then the ones vLLM sends without a usage chunk. A terminal chunk is
    one where ``_TERMINAL`` occurs: JSON escapes a quote inside a string, so that text can
    only be a choice's own ``finish_reason`` key with a string value."""
    if not isinstance(fingerprint, str) or _TERMINAL not in events:
        return events
    field = b',"system_fingerprint":' + json.dumps(fingerprint, ensure_ascii=False).encode()
    # Whole events and their terminators, in turn; the last piece is what follows the last
    # terminator (nothing, or the start of an event), never changed.
    parts = _EVENT_END.split(events)
    for index in range(0, len(parts) - 1, 2):
        part = parts[index]
        if _TERMINAL in part and _FINGERPRINT_KEY not in part and part.endswith(b"}"):
            parts[index] = part[:-1] + field + b"}"
    return b"".join(parts)


_EVENT_END = re.compile(rb"(\r\n\r\n|\n\n|\r\r)")


# ---- a logged response, whole ------------------------------------------------------------


@dataclass(frozen=True)
class ResponseRead:
    """What a logged response body (JSON object, JSON text or SSE text) says."""

    usage: Usage | None
    model: str | None
    engine: EngineTimings | None  # vLLM's per-request metrics, when it sent them


def read_response(response: Any) -> ResponseRead:
    """A response as a proxy logged it: a decoded object, or its raw JSON or SSE text.

    Raises InvalidEvent: ``malformed_response`` for text that is neither JSON nor SSE,
    ``missing_usage`` for a stream without a usage chunk, or the reason of a bad count.
    """
    if isinstance(response, (str, bytes)):
        raw = response.encode("utf-8", "replace") if isinstance(response, str) else response
        stripped = raw.lstrip()
        if stripped.startswith((b"data:", b"event:", b":")):
            return _read_stream(stripped)
        try:
            response = loads(stripped)
        except ValueError:
            raise InvalidEvent(
                "malformed_response", "the response text is not JSON or SSE"
            ) from None
    if not isinstance(response, dict):
        return ResponseRead(None, None, None)
    usage, model = usage_of(response)
    return ResponseRead(usage, model, engine_timings_of(response))


def _read_stream(text: bytes) -> ResponseRead:
    reader = StreamReader(strip_usage_chunk=False, started=0.0, max_event_bytes=len(text) + 1)
    reader.feed(text if text.endswith(b"\n\n") else text + b"\n\n", 0.0)
    if reader.usage is None:
        bad_counts = [problem for problem in reader.problems if not problem.startswith("stream")]
        if bad_counts:
            raise InvalidEvent(bad_counts[-1], "the stream's usage chunk has unusable numbers")
        raise InvalidEvent("missing_usage", "the stream has no chunk with a usage object")
    return ResponseRead(reader.usage, reader.model, reader.engine)
