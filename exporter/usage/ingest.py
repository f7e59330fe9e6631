"""``POST /v1/usage``: proxies push per-request usage records to the exporter.

The body is one JSON object, a JSON array of them, or NDJSON (one per line), in the format
named by ``?format=`` (default ``--usage.ingest.format``), sent as it is or with
``Content-Encoding: gzip`` or ``deflate`` (``exporter.usage.body``). A batch is never
all-or-nothing: good events are counted even when others are rejected, and the reply lists
each rejected event's index and reason. Only whole-request problems refuse the batch: a
missing or wrong bearer token (401), a body over ``--usage.ingest.max-body-bytes`` (413, also
when chunked, also once decoded), one that took more than 30 s to arrive (408), no room for
its bytes (503 with ``Retry-After``), a content coding other than gzip or deflate (415), an
unknown format, a body that does not decode as its coding says, or one that is not JSON at
all (400). Those count in ``vllm_cache_usage_ingest_requests_rejected_total`` and nowhere
else. A batch in which every event was rejected answers 422 (with the same reply), so a
misconfigured sender notices. A body with no events at all (empty, blank lines, ``[]``) is an
empty batch: 200, nothing counted, as a sender flushing an empty buffer expects.

Retried batches count once. An event with an ``id`` already counted for its caller within
``--usage.dedup.window`` is counted as ``duplicate`` and nowhere else (the signals keep the
ids: ``UsageState.record_events``); the reply says how many (``"duplicates"``). A request
with an ``Idempotency-Key`` header (1 to 255 visible ASCII characters, else 400) that was
answered within the window is not read again: it gets the first answer's status and counts
(``"duplicate": true``), counted as ``duplicate`` in the refused requests; one that comes
while the first is still being processed gets 409 with ``Retry-After`` (``in_progress``). A
key is remembered only once its body was read and its events counted (200 or 422), so a
request refused before that (408, 413, 503...) can be retried with the same key.

Memory is bounded whatever the senders do: the bytes of every body being read or processed
share one budget of ``max_concurrent_bodies`` times the body limit (``BodyBytes``). A body
takes its bytes as they arrive, so a sender trickling one holds only what it has sent and
cannot lock the others out; a body that finds the budget full waits a little for room,
then gets 503. A body is decoded one event at a time, never as a whole list of Python
objects.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import itertools
import json
import json.scanner
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from orjson import JSONDecodeError as OrjsonDecodeError
from orjson import loads as _orjson_loads

from exporter.usage.body import BodyRefused
from exporter.usage.body import read_body as read_request_body
from exporter.usage.event import (
    DIGITS_TO_ZERO,
    LONG_DIGITS,
    MSGSPEC_REFUSALS,
    READING_DEPENDENT_REASONS,
    InvalidEvent,
    has_long_digits,
    quick_event,
    validate,
)
from exporter.usage.formats import Converter
from exporter.values import RecentKeys, UsageEvent

log = logging.getLogger(__name__)

ROUTE = "/v1/usage"
# The reply lists at most this many rejected events (the count is always complete).
MAX_ERRORS_IN_REPLY = 1000
# Events processed between yields to the event loop, so a 16 MiB batch does not stall
# /metrics scrapes for its whole duration. A slice's accepted events are recorded together
# before the yield: at most this many events are held per body being read.
EVENTS_PER_SLICE = 2000
# A body that finds no room in the body budget waits this long for some, then gets 503; at
# most this many wait at once (a waiting request holds no more than aiohttp's read buffer).
SLOT_WAIT_SECONDS = 5.0
MAX_WAITING = 64
RETRY_AFTER_SECONDS = 1
# A body whose first this-many events are all rejected is garbage, or a sender that has the
# format wrong: the rest of it is not read (422, counted as "abandoned"), so that one bad
# sender cannot hold a body slot for minutes.
ABANDON_AFTER_REJECTIONS = 10_000
# The one-step reading of the common native event (``quick_event``) is tried on every line of
# an NDJSON body until it has missed this many lines and more than half of those read: then
# the rest of the body goes straight to the general reading (a miss costs more than it).
QUICK_MISSES_TRIED = 64
# Idempotency-Key: its longest form (Stripe's limit) and the characters it may hold (visible
# ASCII: it is compared as sent). Without a shared memory (``batches``) the ingest keeps this
# many keys for at least this long.
MAX_IDEMPOTENCY_KEY_CHARS = 255
DEFAULT_BATCH_KEYS = 10_000
DEFAULT_BATCH_KEY_SECONDS = 600.0
# What a key is remembered with while its body is processed (then: its answer, ``Answered``).
IN_PROGRESS = "in progress"

BOM = b"\xef\xbb\xbf"
_LINE_BLANK = b" \t\r"
_WHITESPACE = " \t\r\n"
# The C scanner, without loads' checks (typeshed types make_scanner's argument oddly).
_scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


class Overloaded(Exception):
    """No room in the body budget within SLOT_WAIT_SECONDS."""


class BodyBytes:
    """The bytes of the bodies being read or processed, against one budget.

    A body takes room for each piece as it arrives and gives it all back once answered, so
    the budget bounds the memory of every body at once (``capacity``: as many bodies of the
    largest size as ``--usage.ingest.max-concurrent-bodies``) while a sender trickling a body
    holds only the bytes it has sent. Room is handed out first come, first served: a
    request waiting for room is never overtaken by a later one.
    """

    def __init__(self, capacity: int, max_waiting: int = MAX_WAITING) -> None:
        self.capacity = capacity
        self.used = 0
        self.max_waiting = max_waiting
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def full(self) -> bool:
        """Whether a request is waiting for room (tests wait for this)."""
        return bool(self._waiting) or self.used >= self.capacity

    async def take(self, size: int, wait: float) -> bool:
        """Room for ``size`` more bytes, waiting up to ``wait`` seconds; False if none."""
        if not self._waiting and self.used + size <= self.capacity:
            self.used += size
            return True
        if size > self.capacity or len(self._waiting) >= self.max_waiting:
            return False
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((size, granted))
        try:
            await asyncio.wait((granted,), timeout=wait)
        except asyncio.CancelledError:
            self._forget(size, granted)
            raise
        if granted.done():
            return True
        self._forget(size, granted)
        return False

    def _forget(self, size: int, granted: asyncio.Future[None]) -> None:
        if granted.done() and not granted.cancelled():
            self.give_back(size)  # granted just as the wait ended
        else:
            granted.cancel()
            self._hand_out()  # a later, smaller request may fit now

    def give_back(self, size: int) -> None:
        self.used -= size
        self._hand_out()

    def _hand_out(self) -> None:
        while self._waiting:
            size, granted = self._waiting[0]
            if granted.done():  # gave up waiting
                self._waiting.popleft()
                continue
            if self.used + size > self.capacity:
                return
            self._waiting.popleft()
            self.used += size
            granted.set_result(None)


class BodyError(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class BatchResult:
    accepted: int = 0
    rejected: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    abandoned: bool = False
    duplicates: int = 0  # events with an id already counted: not counted again

    @property
    def status(self) -> int:
        """422 only when nothing at all could be used, so a sender notices; a partly bad
        batch is a success whose reply names the bad events, and so is one of copies."""
        return 422 if self.rejected and not self.accepted and not self.duplicates else 200

    def add_error(self, index: int, reason: str, message: str, line: int | None) -> None:
        self.rejected += 1
        if len(self.errors) < MAX_ERRORS_IN_REPLY:
            entry: dict[str, Any] = {"index": index, "reason": reason, "message": message}
            if line is not None:
                entry["line"] = line
            self.errors.append(entry)

    def reply(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "accepted": self.accepted,
            "rejected": self.rejected,
            "errors": self.errors,
        }
        if self.rejected > len(self.errors):
            out["errors_truncated"] = True
        if self.duplicates:
            out["duplicates"] = self.duplicates
        if self.abandoned:
            out["abandoned"] = True
            out["message"] = (
                f"the first {self.rejected} events were all rejected; the rest "
                "of the body was not read"
            )
        return out


def batch_key(idempotency_key: str) -> int:
    """How an Idempotency-Key is remembered: its hash (Python's, keyed at random per
    process), as event ids are (``UsageState.record_events``)."""
    return hash(("Idempotency-Key", idempotency_key))


@dataclass(frozen=True)
class Answered:
    """What a batch under an Idempotency-Key was answered: a retry gets the same."""

    accepted: int  # its copies (events counted before) included: they are counted
    rejected: int
    status: int


class Unreadable:
    """An NDJSON line that could not be decoded, and why (it stands in for the value)."""

    __slots__ = ("reason", "message")

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        self.message = message


NOT_UTF8 = Unreadable("bad_encoding", "this line is not UTF-8")
NOT_JSON = Unreadable("malformed_json", "this line is not valid JSON")
# An item of a body: (the decoded value or an Unreadable, the 1-based NDJSON line or None in
# a JSON document). Plain tuples: one is made per event on the hot path.
Item = tuple[Any, "int | None"]


def iter_body(body: bytes | bytearray) -> Iterator[Item]:
    """A body's events, in order and one at a time: a JSON object, a JSON array, or NDJSON.

    Only the current event is decoded, so a body costs about its own size in memory, not
    the size of every event it holds as Python objects. NDJSON lines are decoded one by
    one: an invalid UTF-8 byte, a byte-order mark or a line nested too deeply costs that
    line only. Raises BodyError, before the first item, when the body is none of the three.
    """
    yield from read_body(body)


def read_body(body: bytes | bytearray) -> Iterable[Item]:
    """``iter_body``, raising BodyError at once rather than at the first item.

    The ingest's own entry: an NDJSON body comes back as its ``NdjsonLines``, whose lines
    ``UsageIngest.process`` reads directly rather than an item at a time.
    """
    start = len(BOM) if body.startswith(BOM) else 0
    size = len(body)
    while start < size and body[start] in b" \t\r\n":
        start += 1
    if start == size:  # no events: an empty batch, as an empty JSON array is
        return ()
    first_newline = body.find(b"\n", start)
    if body[start] == ord("["):
        try:
            text = _decode(body, start)
            for _value in _array_elements(text):  # a whole-array check that keeps nothing
                pass
        except BodyError:
            if first_newline < 0:
                raise
            # NDJSON whose first line happens to be an array: the lines say what is bad.
        else:
            return ((value, None) for value in _array_elements(text))
    if body[start] == ord("{") and first_newline >= 0 and not _is_value(body, start, first_newline):
        # Not NDJSON (its first line is not a value): perhaps one pretty-printed object.
        try:
            text = body[start:].decode("utf-8")
        except UnicodeDecodeError:
            text = ""  # not one document; the lines will say which of them are bad
        value, stop = _scan_value(text, 0)
        if stop >= 0 and not text[stop:].strip(_WHITESPACE):
            return iter(((value, None),))
    data = bytes(memoryview(body)[start:])
    lines = data.split(b"\n")
    del data
    for number, line in enumerate(lines, 1):
        first = read_line(line, number)
        if first is not None:
            break
    else:  # nothing but blank lines and byte-order marks: an empty batch
        return ()
    if type(first[0]) is Unreadable and first_newline < 0:
        raise BodyError("bad_body", "the body is not JSON, a JSON array, or NDJSON")
    return NdjsonLines(lines, first, number)


def _is_value(body: bytes | bytearray, start: int, end: int) -> bool:
    """Whether ``body[start:end]`` is one complete JSON value (an NDJSON line)."""
    try:
        text = body[start:end].decode("utf-8")
    except UnicodeDecodeError:
        return False
    _value, stop = _scan_value(text, 0)
    return stop >= 0 and not text[stop:].strip(_WHITESPACE)


def _decode(body: bytes | bytearray, start: int) -> str:
    try:
        return body[start:].decode("utf-8")
    except UnicodeDecodeError:
        raise BodyError("bad_body", "the body is not UTF-8") from None


def _scan_value(text: str, position: int) -> tuple[Any, int]:
    """One JSON value at ``position``: (value, end), or (None, -1) when there is none.

    RecursionError is a malformed value like any other: outside input can nest a thousand
    arrays in two kilobytes.
    """
    try:
        return _scan(text, position)  # type: ignore[no-any-return]
    except (StopIteration, ValueError, RecursionError):
        return None, -1


def _skip_whitespace(text: str, position: int) -> int:
    size = len(text)
    while position < size and text[position] in _WHITESPACE:
        position += 1
    return position


def _array_elements(text: str) -> Iterator[Any]:
    """The elements of the JSON array ``text``; BodyError where it breaks.

    A JSON array is one document: a break anywhere in it (a truncated body) refuses it
    whole, before any element counts, so a sender that retries it counts nothing twice.
    ``iter_body`` runs through it once to check it, keeping nothing, then reads it again
    one element at a time."""
    position = _skip_whitespace(text, 1)  # after "["
    if text[position : position + 1] == "]":
        position += 1
    else:
        while True:
            value, stop = _scan_value(text, position)
            if stop < 0:
                raise BodyError("bad_body", "the JSON array is malformed")
            yield value
            position = _skip_whitespace(text, stop)
            separator = text[position : position + 1]
            position += 1
            if separator == "]":
                break
            if separator != ",":
                raise BodyError("bad_body", "the JSON array is malformed")
            position = _skip_whitespace(text, position)
    if text[position:].strip(_WHITESPACE):
        raise BodyError("bad_body", "text follows the JSON array")


class NdjsonLines:
    """An NDJSON body split into its lines (after any leading BOM and whitespace).

    Iterating gives its items one at a time, as ``iter_body`` does; ``UsageIngest.process``
    reads the lines themselves (``_process_lines``), which is where the ingest spends its
    time.
    """

    __slots__ = ("lines", "first", "first_line", "_long_digits")

    def __init__(self, lines: list[bytes], first: Item, first_line: int) -> None:
        self.lines = lines
        # The first item, already read (to tell NDJSON from other bodies), and its line.
        self.first = first
        self.first_line = first_line
        self._long_digits: set[int] | None = None

    @property
    def long_digits(self) -> set[int]:
        """The (1-based) numbers of the lines left to ``json`` (see ``_line_items``): a scan
        of the whole body, made when first asked (the native format needs none)."""
        if self._long_digits is None:
            self._long_digits = _long_digit_lines(b"\n".join(self.lines))
        return self._long_digits

    def __iter__(self) -> Iterator[Item]:
        yield self.first
        yield from _line_items(self.lines, self.long_digits, self.first_line)


def _line_items(lines: list[bytes], long_digits: set[int], start: int = 0) -> Iterator[Item]:
    """NDJSON lines, decoded by orjson where it reads a line exactly as ``json`` does.

    orjson refuses what ``json`` takes beyond the JSON standard (NaN and the infinities,
    numbers past a float's range, lone surrogate escapes, a byte-order mark): those lines,
    and blank or broken ones, go through ``_decode_line`` and so get ``json``'s reading and
    the same reasons as before. The one thing orjson reads differently is an integer beyond
    64 bits (as a float): lines with a run of 19 or more digits (a cheap superset of those)
    are left to ``json``.
    """
    for number, line in enumerate(itertools.islice(lines, start, None), start + 1):
        item = _read_line(line, number, long_digits)
        if item is not None:
            yield item


def _read_line(line: bytes, number: int, long_digits: set[int]) -> Item | None:
    """One NDJSON line's item (None for a blank line), as ``_line_items`` reads it."""
    return _decoded(line, number, bool(long_digits) and number in long_digits)


def _decoded(line: bytes, number: int, json_only: bool) -> Item | None:
    """A line's item by orjson, or by ``json`` where orjson refuses it or ``json_only`` (a
    run of 19 digits, which orjson may read differently)."""
    if json_only:
        return _decode_line(line, number)
    try:
        return _orjson_loads(line), number
    except ValueError:  # orjson.JSONDecodeError is a ValueError
        return _decode_line(line, number)


def read_line(line: bytes, number: int) -> Item | None:
    """One NDJSON line read on its own, exactly as ``json`` reads it (orjson where the two
    agree; whether they may not is decided by the line itself): None for a blank line, else
    (the value or an ``Unreadable``, ``number``). The file follower's reading too."""
    return _decoded(line, number, has_long_digits(line))


def _is_blank(line: bytes) -> bool:
    """Whether ``_decode_line`` reads ``line`` as no event at all."""
    line = line.strip(_LINE_BLANK)
    return not line or line == BOM


def _decode_line(line: bytes, number: int) -> Item | None:
    """``json``'s reading of one NDJSON line (None for a blank line)."""
    line = line.strip(_LINE_BLANK)
    if line.startswith(BOM):
        line = line[len(BOM) :]
    if not line:
        return None
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return NOT_UTF8, number
    value, stop = _scan_value(text, 0)
    if stop < 0 or text[stop:].strip(_WHITESPACE):
        return NOT_JSON, number
    return value, number


def _long_digit_lines(data: bytes) -> set[int]:
    """The (1-based) numbers of the lines holding a run of 19 or more digits."""
    marked = data.translate(DIGITS_TO_ZERO)
    at = marked.find(LONG_DIGITS)
    numbers: set[int] = set()
    line, counted_to = 1, 0
    while at >= 0:
        line += marked.count(b"\n", counted_to, at)
        numbers.add(line)
        counted_to = marked.find(b"\n", at)
        if counted_to < 0:
            break
        at = marked.find(LONG_DIGITS, counted_to)
    return numbers


class UsageIngest:
    """``POST /v1/usage``: its formats, auth and size rules, and where its events go.

    ``record_events`` takes the accepted events of a body in order, a slice
    (``EVENTS_PER_SLICE``) at a time; ``reject`` the reason of each event
    that could not be used, ``reject_request`` the reason of each request refused as a whole.
    """

    def __init__(
        self,
        converters: Mapping[str, Converter],
        default_format: str,
        token: str,
        max_body_bytes: int,
        record_events: Callable[[Sequence[UsageEvent]], int | None],
        reject: Callable[[str], None],
        reject_request: Callable[[str], None],
        max_concurrent_bodies: int = 4,
        batches: RecentKeys | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.converters = dict(converters)
        self.default_format = default_format
        self.token = token.encode("utf-8")
        self.max_body_bytes = max_body_bytes
        self.record_events = record_events
        self.reject = reject
        self.reject_request = reject_request
        self.max_concurrent_bodies = max_concurrent_bodies
        self.body_bytes = BodyBytes(max_concurrent_bodies * max_body_bytes)
        # The Idempotency-Keys of batches answered lately (by their hash), each with its
        # answer (``Answered``) or IN_PROGRESS.
        self.batches = (
            batches
            if batches is not None
            else RecentKeys(DEFAULT_BATCH_KEYS, DEFAULT_BATCH_KEY_SECONDS)
        )
        self.clock = clock

    def authorized(self, request: web.Request) -> bool:
        if not self.token:
            return True
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(credentials.strip().encode("utf-8"), self.token)

    async def process(self, items: Iterable[Item], convert: Converter) -> BatchResult:
        """Count a body's events in order, a slice (``EVENTS_PER_SLICE``) at a time.

        An NDJSON body is read line by line (``_process_lines``) when orjson's reading of
        each accepted line is ``json``'s: always in the native format, whose check rejects
        every number orjson reads differently (an integer beyond 64 bits, read as a float of
        at least 2**63 in size, is out of every field's range or of its type), so such a
        line is rejected and then read again by ``json``; in other formats, when no line
        holds a run of 19 digits (``_long_digit_lines``).
        """
        if type(items) is NdjsonLines and (convert is validate or not items.long_digits):
            return await self._process_lines(items, convert)
        return await self._process_items(iter(items), convert)

    async def _process_items(self, items: Iterator[Item], convert: Converter) -> BatchResult:
        """``process``, one decoded item at a time (JSON arrays, and NDJSON bodies with
        lines left to ``json``)."""
        result = BatchResult()
        record_events = self.record_events
        events: list[UsageEvent] = []
        accepted = duplicates = 0
        slice_left = EVENTS_PER_SLICE
        for index, (value, line) in enumerate(items):
            if not slice_left:
                slice_left = EVENTS_PER_SLICE
                # The slice's events are counted before anything else may run.
                if events:
                    duplicates += record_events(events) or 0
                    accepted += len(events)
                    events = []
                if await self._abandon_after_slice(accepted, result):
                    break
            slice_left -= 1
            event = self._item_event(value, line, index, convert, result)
            if event is not None:
                events.append(event)
        if events:
            duplicates += record_events(events) or 0
            accepted += len(events)
        # Copies were handed in with the others (in order), but are not counted again.
        result.accepted = accepted - duplicates
        result.duplicates = duplicates
        return result

    async def _process_lines(self, body: NdjsonLines, convert: Converter) -> BatchResult:
        """``process`` for an NDJSON body: the same items, slices and replies as one item
        at a time, without an item per line. Each line is decoded by orjson and converted
        in one step; only a line that step refuses is looked at again: one orjson refused
        gets ``json``'s reading (or is blank, no event), one the converter refused is
        rejected with its reason, unless that reason may differ on ``json``'s reading (a run
        of 19 digits in the line, and a reason of ``READING_DEPENDENT_REASONS``), or the
        converter failed otherwise: then it is read again on its own
        (``read_line``, ``_item_event``)."""
        result = BatchResult()
        record_events = self.record_events
        events: list[UsageEvent] = []
        append = events.append
        accepted = duplicates = 0
        event = self._item_event(*body.first, 0, convert, result)
        if event is not None:
            append(event)
        slice_left = EVENTS_PER_SLICE - 1
        # Other formats come here only when no line holds a run of 19 digits (``process``).
        native = convert is validate
        quick = quick_event
        quick_on = native
        quick_misses = 0
        position = body.first_line  # the number of the line at hand, once counted up
        for line in itertools.islice(body.lines, position, None):
            position += 1
            if not slice_left:
                if _is_blank(line):  # a new slice begins with its first event
                    continue
                slice_left = EVENTS_PER_SLICE
                # The slice's events are counted before anything else may run.
                if events:
                    duplicates += record_events(events) or 0
                    accepted += len(events)
                    events = []
                    append = events.append
                if await self._abandon_after_slice(accepted, result):
                    break
            if quick_on:
                # The common native event in one step (msgspec); anything else, including
                # a line msgspec refuses, is read below as if it had never been tried.
                try:
                    event = quick(line)
                except MSGSPEC_REFUSALS:
                    event = None
                if event is not None:
                    append(event)
                    slice_left -= 1
                    continue
                # A body of mostly uncommon lines (bad ones, new names) stops trying: each
                # miss costs a decode and often an exception before the reading below.
                quick_misses += 1
                if quick_misses >= QUICK_MISSES_TRIED and 2 * quick_misses > position:
                    quick_on = False
            if self._read_line(
                line,
                position,
                accepted + len(events) + result.rejected,
                convert,
                native,
                result,
                events,
            ):
                slice_left -= 1
        if events:
            duplicates += record_events(events) or 0
            accepted += len(events)
        # Copies were handed in with the others (in order), but are not counted again.
        result.accepted = accepted - duplicates
        result.duplicates = duplicates
        return result

    def _read_line(
        self,
        line: bytes,
        position: int,
        index: int,
        convert: Converter,
        native: bool,
        result: BatchResult,
        events: list[UsageEvent],
    ) -> bool:
        """One line the quick step did not take: decoded by orjson and converted, else as
        ``_process_lines`` says (json's reading, a rejection, or a second reading). False
        for a blank line, which is no item at all."""
        try:
            events.append(convert(_orjson_loads(line)))
        except OrjsonDecodeError:
            item = _decode_line(line, position)
            if item is None:  # a blank line is no event
                return False
            event = self._item_event(item[0], position, index, convert, result)
            if event is not None:
                events.append(event)
        except InvalidEvent as err:
            if native and err.reason in READING_DEPENDENT_REASONS and has_long_digits(line):
                self._line_again(line, position, index, convert, result, events)
            else:  # the converter's verdict on the line as json reads it too
                self._refused(err, index, position, result)
        except Exception:  # a converter bug: the item path says it, once
            self._line_again(line, position, index, convert, result, events)
        return True

    def _line_again(
        self,
        line: bytes,
        number: int,
        index: int,
        convert: Converter,
        result: BatchResult,
        events: list[UsageEvent],
    ) -> None:
        """A line read on its own, as if it had never been tried (it is not blank)."""
        item = read_line(line, number)
        assert item is not None
        event = self._item_event(item[0], item[1], index, convert, result)
        if event is not None:
            events.append(event)

    async def _abandon_after_slice(self, accepted: int, result: BatchResult) -> bool:
        """Yield to the loop between slices; whether the body is to be abandoned (nothing
        accepted in the first ``ABANDON_AFTER_REJECTIONS`` events)."""
        await asyncio.sleep(0)
        if not accepted and result.rejected >= ABANDON_AFTER_REJECTIONS:
            result.abandoned = True
            self.reject_request("abandoned")
            return True
        return False

    def _refused(
        self, err: InvalidEvent, index: int, line: int | None, result: BatchResult
    ) -> None:
        self.reject(err.reason)
        result.add_error(index, err.reason, str(err), line)

    def _item_event(
        self, value: Any, line: int | None, index: int, convert: Converter, result: BatchResult
    ) -> UsageEvent | None:
        """One item's event, or None with the item rejected and its reason counted."""
        if type(value) is Unreadable:
            self.reject(value.reason)
            result.add_error(index, value.reason, value.message, line)
            return None
        try:
            return convert(value)
        except InvalidEvent as err:
            self._refused(err, index, line, result)
        except Exception:  # a converter bug must not cost the rest of the batch
            log.warning("usage event %d could not be converted", index, exc_info=True)
            self.reject("unprocessable")
            result.add_error(index, "unprocessable", "the event could not be read", line)
        return None

    def _refuse(
        self, status: int, reason: str, message: str, headers: dict[str, str] | None = None
    ) -> web.Response:
        self.reject_request(reason)
        return web.json_response(
            {"accepted": 0, "error": reason, "message": message}, status=status, headers=headers
        )

    def _overloaded(self) -> web.Response:
        response = self._refuse(
            503,
            "overloaded",
            f"the bodies being read already hold "
            f"{self.body_bytes.capacity} bytes ({self.max_concurrent_bodies} x "
            "--usage.ingest.max-body-bytes); retry shortly",
            {"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
        response.force_close()  # the unread body is not worth reading
        return response

    def _batch_key(self, request: web.Request) -> int | None | web.Response:
        """The hash of the request's Idempotency-Key (None without one), or the answer to
        give at once: 400 for a malformed key, the first answer's for a key answered within
        the window, 409 for one still being processed."""
        key = request.headers.get("Idempotency-Key")
        if key is None:
            return None
        if (
            not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_CHARS
            or not key.isascii()
            or not key.isprintable()
            or " " in key
        ):
            return self._refuse(
                400,
                "bad_idempotency_key",
                f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} "
                "visible ASCII characters",
            )
        hashed = batch_key(key)
        return self._answered_before(hashed) or hashed

    def _answered_before(self, key: int) -> web.Response | None:
        """The answer to a batch whose key is remembered, else None."""
        known = self.batches.get(key, self.clock())
        if known is None:
            return None
        if known is IN_PROGRESS:
            return self._refuse(
                409,
                "in_progress",
                "a request with this Idempotency-Key is being processed; retry shortly",
                {"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        assert type(known) is Answered
        self.reject_request("duplicate")
        return web.json_response(
            {
                "accepted": known.accepted,
                "rejected": known.rejected,
                "errors": [],
                "duplicate": True,
                "message": "a request with this Idempotency-Key was answered "
                "already; nothing was counted again",
            },
            status=known.status,
        )

    async def handle(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return self._refuse(
                401,
                "unauthorized",
                "a valid 'Authorization: Bearer <token>' header is required",
                {"WWW-Authenticate": 'Bearer realm="vllm-cache-exporter"'},
            )
        format_name = request.query.get("format", self.default_format)
        convert = self.converters.get(format_name)
        if convert is None:
            return self._refuse(
                400,
                "bad_format",
                f"unknown or unconfigured format; use one of {', '.join(sorted(self.converters))}",
            )
        key = self._batch_key(request)
        if isinstance(key, web.Response):
            return key
        held = 0
        budget = self.body_bytes

        async def reserve(size: int) -> None:
            nonlocal held
            if not await budget.take(size, SLOT_WAIT_SECONDS):
                raise Overloaded
            held += size

        try:
            try:
                body = await read_request_body(
                    request.content,
                    request.content_length,
                    self.max_body_bytes,
                    request.headers.get("Content-Encoding", ""),
                    reserve=reserve,
                )
            except BodyRefused as refused:
                message = refused.message
                if refused.reason == "body_too_large":
                    message = (
                        f"the body is larger than {self.max_body_bytes} bytes "
                        "(--usage.ingest.max-body-bytes)"
                    )
                headers = {"Accept-Encoding": "gzip, deflate"} if refused.status == 415 else None
                response = self._refuse(refused.status, refused.reason, message, headers)
                response.force_close()  # the rest of the body is not worth reading
                return response
            except Overloaded:
                return self._overloaded()
            except ConnectionError:
                return web.Response(status=499)  # the sender left: nobody reads an answer
            if key is None:
                return await self._process_body(body, convert)
            return await self._process_keyed(body, convert, key)
        finally:
            if held:
                budget.give_back(held)

    async def _process_keyed(self, body: bytes, convert: Converter, key: int) -> web.Response:
        """``_process_body`` under an Idempotency-Key: claimed while processed (another
        request with it may have been answered while this one's body arrived), remembered
        with the answer once the events are counted, let go if it never got that far."""
        answered = self._answered_before(key)
        if answered is not None:
            return answered
        self.batches.put(key, IN_PROGRESS, self.clock())
        result: BatchResult | None = None
        try:
            response, result = await self._counted(body, convert)
        finally:
            if result is None:
                self.batches.pop(key)
            else:
                self.batches.put(
                    key,
                    Answered(result.accepted + result.duplicates, result.rejected, result.status),
                    self.clock(),
                )
        return response

    async def _process_body(self, body: bytes, convert: Converter) -> web.Response:
        return (await self._counted(body, convert))[0]

    async def _counted(
        self, body: bytes, convert: Converter
    ) -> tuple[web.Response, BatchResult | None]:
        """The answer to a body that arrived whole, and what was counted of it (None: the
        body was refused as a whole, nothing counted)."""
        try:
            items = read_body(body)
        except BodyError as err:
            return self._refuse(400, err.reason, str(err)), None
        result = await self.process(items, convert)  # an empty JSON array: nothing wrong
        return web.json_response(result.reply(), status=result.status), result
