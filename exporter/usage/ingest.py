"""``POST /v1/usage``: proxies push per-request usage records to the exporter.

The body is one JSON object, a JSON array of them, or NDJSON (one per line), in the format
named by ``?format=`` (default ``--usage.ingest.format``). A batch is never all-or-nothing:
good events are counted even when others are rejected, and the reply lists each rejected
event's index and reason. Only whole-request problems refuse the batch: a missing or wrong
bearer token (401), a body over ``--usage.ingest.max-body-bytes`` (413, also when chunked),
an unknown format or a body that is not JSON at all (400). Those count in
``vllm_cache_usage_ingest_requests_rejected_total`` and nowhere else. A batch in which every
event was rejected answers 422 (with the same reply), so a misconfigured sender notices.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import json.scanner
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from exporter.usage.event import InvalidEvent
from exporter.usage.formats import Converter
from exporter.values import UsageEvent

log = logging.getLogger(__name__)

READER = "http"
ROUTE = "/v1/usage"
# The reply lists at most this many rejected events (the count is always complete).
MAX_ERRORS_IN_REPLY = 1000
# Events processed between yields to the event loop, so a 16 MiB batch does not stall
# /metrics scrapes for its whole duration.
EVENTS_PER_SLICE = 5000


class BodyError(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class BatchResult:
    accepted: int = 0
    rejected: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)

    def add_error(self, index: int, reason: str, message: str, line: int | None) -> None:
        self.rejected += 1
        if len(self.errors) < MAX_ERRORS_IN_REPLY:
            entry: dict[str, Any] = {"index": index, "reason": reason, "message": message}
            if line is not None:
                entry["line"] = line
            self.errors.append(entry)

    def reply(self) -> dict[str, Any]:
        out: dict[str, Any] = {"accepted": self.accepted, "rejected": self.rejected,
                               "errors": self.errors}
        if self.rejected > len(self.errors):
            out["errors_truncated"] = True
        return out


@dataclass
class Batch:
    """A decoded body: its values in order, and the NDJSON lines that could not be decoded.

    Kept as plain lists (no object per event): this is on the ingest hot path.
    """

    values: list[Any]
    lines: list[int] | None = None  # 1-based NDJSON line of each value, None for JSON
    bad: dict[int, str] = field(default_factory=dict)  # index -> reason (value is None)


# The C scanner, without loads' checks (typeshed types make_scanner's argument oddly).
_scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
_BLANK = " \t\r"


def split_body(body: bytes) -> Batch:
    """A body -> its events, in order: a JSON object, a JSON array, or NDJSON lines."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BodyError("bad_body", "the body is not UTF-8") from None
    stripped = text.strip()
    if not stripped:
        raise BodyError("bad_body", "the body is empty")
    try:  # one object or array, perhaps pretty-printed; NDJSON fails after its first line
        whole = json.loads(stripped)
    except ValueError:
        pass
    else:
        return Batch(whole if isinstance(whole, list) else [whole])
    batch = _split_lines(stripped)
    if len(batch.values) == 1 and batch.bad:
        raise BodyError("bad_body", "the body is not JSON, a JSON array, or NDJSON")
    return batch


def _split_lines(text: str) -> Batch:
    values: list[Any] = []
    lines: list[int] = []
    bad: dict[int, str] = {}
    scan = _scan
    find = text.find
    size = len(text)
    position = 0
    number = 0
    while position < size:
        end = find("\n", position)
        if end < 0:
            end = size
        number += 1
        start = position
        position = end + 1
        while start < end and text[start] in _BLANK:
            start += 1
        if start == end:
            continue
        try:
            value, stop = scan(text, start)
        except (StopIteration, ValueError):
            stop = -1
        if stop < 0 or stop > end or (stop < end and text[stop:end].strip()):
            bad[len(values)] = "malformed_json"
            value = None
        values.append(value)
        lines.append(number)
    return Batch(values, lines, bad)


class UsageIngest:
    """``POST /v1/usage``: its formats, auth and size rules, and where its events go.

    ``record`` takes each accepted event, ``reject`` the reason of each event that could not
    be used, ``reject_request`` the reason of each request refused as a whole.
    """

    def __init__(self, converters: Mapping[str, Converter], default_format: str, token: str,
                 max_body_bytes: int, record: Callable[[UsageEvent], object],
                 reject: Callable[[str], None],
                 reject_request: Callable[[str], None]) -> None:
        self.converters = dict(converters)
        self.default_format = default_format
        self.token = token.encode("utf-8")
        self.max_body_bytes = max_body_bytes
        self.record = record
        self.reject = reject
        self.reject_request = reject_request

    def authorized(self, request: web.Request) -> bool:
        if not self.token:
            return True
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(credentials.strip().encode("utf-8"), self.token)

    async def process(self, batch: Batch, convert: Converter) -> BatchResult:
        result = BatchResult()
        record = self.record
        reject = self.reject
        values, lines, bad = batch.values, batch.lines, batch.bad
        accepted = 0
        for start in range(0, len(values), EVENTS_PER_SLICE):
            if start:
                await asyncio.sleep(0)
            for index in range(start, min(start + EVENTS_PER_SLICE, len(values))):
                if bad and index in bad:
                    reject(bad[index])
                    result.add_error(index, bad[index], "this line is not valid JSON",
                                     lines[index] if lines else None)
                    continue
                try:
                    event = convert(values[index])
                except InvalidEvent as err:
                    reject(err.reason)
                    result.add_error(index, err.reason, str(err),
                                     lines[index] if lines else None)
                    continue
                except Exception:  # a converter bug must not cost the rest of the batch
                    log.warning("usage event %d could not be converted", index, exc_info=True)
                    reject("unprocessable")
                    result.add_error(index, "unprocessable", "the event could not be read",
                                     lines[index] if lines else None)
                    continue
                record(event)
                accepted += 1
        result.accepted = accepted
        return result

    def _refuse(self, status: int, reason: str, message: str,
                headers: dict[str, str] | None = None) -> web.Response:
        self.reject_request(reason)
        return web.json_response({"accepted": 0, "error": reason, "message": message},
                                 status=status, headers=headers)

    async def handle(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return self._refuse(401, "unauthorized",
                                "a valid 'Authorization: Bearer <token>' header is required",
                                {"WWW-Authenticate": 'Bearer realm="vllm-cache-exporter"'})
        format_name = request.query.get("format", self.default_format)
        convert = self.converters.get(format_name)
        if convert is None:
            return self._refuse(400, "bad_format",
                                f"unknown or unconfigured format; use one of "
                                f"{', '.join(sorted(self.converters))}")
        limit = self.max_body_bytes
        too_large = f"the body is larger than {limit} bytes (--usage.ingest.max-body-bytes)"
        if request.content_length is not None and request.content_length > limit:
            response = self._refuse(413, "body_too_large", too_large)
            response.force_close()
            return response
        body = bytearray()
        while True:  # read ourselves: a chunked body has no Content-Length to check up front
            chunk = await request.content.readany()
            if not chunk:
                break
            body.extend(chunk)
            if len(body) > limit:
                response = self._refuse(413, "body_too_large", too_large)
                response.force_close()  # do not read the rest of an oversized body
                return response
        try:
            batch = split_body(bytes(body))
        except BodyError as err:
            return self._refuse(400, err.reason, str(err))
        result = await self.process(batch, convert)
        # 422 only when nothing at all could be used, so a sender notices; a partly bad batch
        # is a success whose reply names the bad events.
        status = 422 if result.rejected and not result.accepted else 200
        return web.json_response(result.reply(), status=status)
