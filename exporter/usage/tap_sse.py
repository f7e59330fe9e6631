"""Incremental reading of a server-sent-event stream as it passes through the tap.

Upstream chunk boundaries do not follow event boundaries (TCP splits and merges writes), so
events are cut on the blank line that ends them, whatever chunks they arrived in. Two modes:

- pass-through: every chunk is forwarded the moment it arrives, the bytes are only read;
- strip: the tap injected ``stream_options.include_usage``, so the usage-only chunk it
  caused must not reach the client. Whole events are forwarded as soon as their blank line
  arrives; the usage chunk is dropped; after it the stream is pass-through again. Every other
  event reaches the client byte for byte.

JSON is decoded only where needed: every event until the first one that carries content
(TTFT), then only events that mention usage or an error. Nothing here reads a clock: the
caller passes the time in.
"""

from __future__ import annotations

import json
from typing import Any

from exporter.usage.tap_usage import (
    BadUsage,
    Usage,
    carries_content,
    is_usage_only_chunk,
    stream_error_status,
    usage_of,
)

_TERMINATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")
_USAGE = b'"usage"'
_ERROR = b'"error"'
_RESPONSE_FAILED = b"response.failed"


def _find_end(buffer: bytearray, start: int) -> int:
    """Index just past the first event terminator at or after ``start``, else -1."""
    best = -1
    for terminator in _TERMINATORS:
        at = buffer.find(terminator, start)
        if at >= 0 and (best < 0 or at + len(terminator) < best):
            best = at + len(terminator)
    return best


def event_data(event: bytes) -> bytes | None:
    """The joined ``data:`` lines of one event (None when it has none)."""
    if event.startswith(b"data: ") and event.count(b"\n") <= 2 and b"\r" not in event:
        return event[6:].rstrip(b"\n")  # the common one-line shape vLLM sends
    lines = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines)


class StreamReader:
    """Reads one SSE response: what to forward, and the usage, model, TTFT and errors in it."""

    def __init__(self, strip_usage_chunk: bool, started: float,
                 max_event_bytes: int = 8 * 1024 * 1024) -> None:
        self.strip = strip_usage_chunk
        self.started = started
        self.max_event_bytes = max_event_bytes
        self.usage: Usage | None = None
        self.final_usage = False  # usage came from the choices: [] chunk (authoritative)
        self.model: str | None = None
        self.ttft_seconds: float | None = None
        self.error_status: int | None = None
        self.problems: list[str] = []  # counted by the tap as rejections (reader "tap")
        self.events = 0
        self._buffer = bytearray()
        self._scan_from = 0
        self._oversized = False  # inside an event too large to read; skip to its end

    def feed(self, chunk: bytes, now: float) -> bytes:
        """Take one upstream chunk; return the bytes to send the client now."""
        if not self.strip:
            self._consume(chunk, now)
            return chunk
        out = bytearray()
        self._consume(chunk, now, out)
        return bytes(out)

    def finish(self) -> bytes:
        """End of stream: whatever is still held (an unterminated last event)."""
        held = bytes(self._buffer) if self.strip else b""
        self._buffer.clear()
        return held

    def _consume(self, chunk: bytes, now: float, out: bytearray | None = None) -> None:
        buffer = self._buffer
        buffer += chunk
        while buffer:
            end = _find_end(buffer, self._scan_from)
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
        self.events += 1
        need_content = self.ttft_seconds is None
        if not need_content and _USAGE not in event and _ERROR not in event \
                and _RESPONSE_FAILED not in event:
            return False
        data = event_data(event)
        if data is None or data == b"[DONE]":
            return False
        try:
            obj: Any = json.loads(data)
        except ValueError:
            self.problems.append("stream_event_not_json")
            return False
        if need_content and carries_content(obj):
            self.ttft_seconds = max(0.0, now - self.started)
        status = stream_error_status(obj)
        if status is not None and self.error_status is None:
            self.error_status = status
        if not isinstance(obj, dict) or ("usage" not in obj and "response" not in obj):
            return False
        try:
            usage, model = usage_of(obj)
        except BadUsage as err:
            self.problems.append(err.reason)
            return False
        if model is not None:
            self.model = model
        if usage is None:
            return False
        only_usage = is_usage_only_chunk(obj)
        if only_usage or not self.final_usage:
            # continuous_usage_stats puts usage on every chunk without the details; the
            # final choices: [] chunk (or the Responses API's completed event) is the truth.
            self.usage = usage
            self.final_usage = only_usage or "response" in obj
        return self.strip and only_usage
