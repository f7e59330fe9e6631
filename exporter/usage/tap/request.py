"""What the tap needs from a request body, read without parsing the whole body.

The tap needs a handful of top-level fields: ``model``, ``user`` (the caller fallback; on
Anthropic's Messages API ``metadata.user_id``), ``stream`` and ``stream_options`` (whether to
ask for the usage chunk), and keeps for later use the output limit (``max_tokens``,
``max_completion_tokens``, ``max_output_tokens``) and where the prompt is (``messages``,
``prompt`` or ``input``). Agent turns carry hundreds of
kilobytes of prompt, and decoding all of it into Python objects to read five short fields
was most of the tap's cost on long prompts. So ``scan`` walks the top-level object only:

- every top-level key is found, and each value's extent; nested objects and arrays are
  skipped as a whole, so a ``"stream": true`` inside a message is never taken for the
  top-level one. Strings are skipped with ``bytes.find`` (a long prompt costs a few
  ``memchr`` calls); containers dense with short strings, where a Python loop would be
  slower than the C decoder, are skipped by the standard library's own C scanner (on a
  Latin-1 view of the bytes, so its positions are byte offsets);
- only the values of the keys above are decoded, each by ``json`` from its own bytes, so
  they are exactly what ``json.loads`` gives for the whole body;
- a key given twice counts with its last value, as ``json.loads`` (and so vLLM, which
  decodes requests with Python's ``json``) reads it;
- skipped values are delimited, not validated: a body that is not valid JSON may still be
  scanned. vLLM refuses it (400) and the tap records that answer as it would any other.

Where the walk would need the C scanner (a body under WALK_MIN_BYTES, whose containers the
walk does not pay off on, or dense JSON), ``read`` gives the same facts from one pass of
msgspec's C decoder, which decodes the fields above, hands the prompt's value over as its
bytes (``msgspec.Raw``, no copy) and skips every other value in C (1 ms for a megabyte of
dense JSON; the walk stays ahead on long strings, which msgspec reads byte by byte). It
reads JSON strictly: where ``json.loads`` reads a body its own way (NaN and the infinities,
numbers past a float's range, integers of thousands of digits in a field it decodes, lone
surrogates, a byte-order mark, UTF-16) msgspec refuses the body and the scan or ``json``
reads it instead. Like the scan, it delimits the values it skips without holding them to
``json``'s limits (an integer of 5,000 digits in a message).

Whatever the scan cannot decide (the body is not an object, a value it needs does not
decode, text after the object, an encoding other than UTF-8) falls back to ``json``
decoding the whole body (``parse``), which the caller runs in a worker thread when the body
is large. Nothing here changes a body except ``with_include_usage``, which splices in the
usage request and leaves every other byte as the client sent it.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from exporter.usage.event import MSGSPEC_REFUSALS, loads
from exporter.usage.openai import Endpoint

BOM = b"\xef\xbb\xbf"
_QUOTE = 0x22
_BACKSLASH = 0x5C
_OPEN = (0x5B, 0x7B)  # [ {
_WHITESPACE = re.compile(rb"[ \t\n\r]*")
_OBJECT_START = re.compile(rb"(?:\xef\xbb\xbf)?[ \t\n\r]*\{")  # json.loads takes a BOM
# A key without escapes or control characters (and not absurdly long), its colon and the
# whitespace around it.
_KEY = re.compile(rb'"([^"\\\x00-\x1f]{0,1024})"[ \t\n\r]*:[ \t\n\r]*')
_SEPARATOR = re.compile(rb"[ \t\n\r]*([,}])[ \t\n\r]*")
# JSON's scalars as Python's decoder accepts them (it also takes NaN and the infinities).
_SCALAR = re.compile(
    rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|true|false|null"
    rb"|NaN|Infinity|-Infinity"
)
_STRUCTURE = re.compile(rb'["\[\]{}]')
# The C scanner over str positions (typeshed types make_scanner's argument oddly).
_c_scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
scanstring = json.decoder.scanstring  # type: ignore[attr-defined]

# The Python skip of a container gives way to the C scanner once it has taken more than
# GRACE_STEPS steps (a string or a bracket each) at fewer than BYTES_PER_STEP bytes a step
# (a Python step costs about what the C decoder spends on that many bytes), or meets a run
# of this many bytes with no string or bracket in it (whitespace or numbers, which the C
# scanner crosses faster).
GRACE_STEPS = 64
BYTES_PER_STEP = 512
MAX_PLAIN_RUN = 4096
# Below this size a body's containers go to the C scanner straight away: the walk only pays
# off across long strings.
WALK_MIN_BYTES = 16 * 1024
# Escaped quotes looked past in Python before the C scanner reads the strings instead.
ESCAPED_QUOTES = 256

PROMPT_KEYS = {
    Endpoint.CHAT: "messages",
    Endpoint.COMPLETIONS: "prompt",
    Endpoint.RESPONSES: "input",
    Endpoint.MESSAGES: "messages",
}
# Output limit keys by endpoint, the first one set (not null) wins: vLLM's chat request
# takes max_completion_tokens over the older max_tokens.
LIMIT_KEYS = {
    Endpoint.CHAT: ("max_completion_tokens", "max_tokens"),
    Endpoint.COMPLETIONS: ("max_tokens",),
    Endpoint.RESPONSES: ("max_output_tokens",),
    Endpoint.MESSAGES: ("max_tokens",),
}
# What the model reads before the prompt key, when it is a key of its own: Anthropic's
# ``system`` (rendered first). The prompt-order diagnosis fingerprints it, then the prompt.
PREAMBLE_KEYS = {Endpoint.MESSAGES: "system"}
# Where the end user's name is: OpenAI's top-level ``user``, Anthropic's ``metadata.user_id``.
USER_KEYS = {
    Endpoint.CHAT: "user",
    Endpoint.COMPLETIONS: "user",
    Endpoint.RESPONSES: "user",
    Endpoint.MESSAGES: "metadata",
}
# Keys whose values are decoded (all others are only delimited).
DECODED = frozenset(
    {
        "model",
        "user",
        "metadata",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "n",
    }
)


class Undecidable(ValueError):
    """The scan cannot say what ``json.loads`` would: decode the whole body instead."""


class NeedsDecoder(Exception):
    """The scan of a large body needs the C decoder, which is not to run on the event loop."""


@dataclass(frozen=True)
class RequestFacts:
    """One request's top-level fields that the tap reads (per call, never recorded yet).

    ``prompt_span`` is the byte range of the prompt's JSON value in the body (``messages``
    for chat, ``prompt`` for completions, ``input`` for responses), so that a later reader
    can hash or measure it without decoding it; None when it is absent, when ``read`` handed
    the prompt's bytes over instead (``prompt``), or when the facts came from a full parse
    (``scanned`` False: what neither ``read`` nor the scan can read), where
    ``prompt_bytes()`` finds it on demand. ``output_limit`` is the request's output
    token limit (an integer, else None). ``sequences`` is how many completions the request
    asks for (chat and completions' ``n``; 1 when absent or not an integer above 1).
    """

    is_object: bool = False  # False: not a JSON object (nothing else is known)
    model: str | None = None
    user: Any = None
    stream: bool = False  # "stream": true
    has_stream_options: bool = False
    stream_options: Any = None
    output_limit: int | None = None
    sequences: int = 1
    prompt_span: tuple[int, int] | None = None
    scanned: bool = True
    # The prompt's JSON bytes as sent, from ``read`` (a msgspec.Raw: a buffer over the
    # body); None when absent or not read that way. The same for the preamble (Anthropic's
    # ``system``), and the span of that one.
    prompt: Any = field(default=None, repr=False)
    preamble: Any = field(default=None, repr=False)
    preamble_span: tuple[int, int] | None = None
    # Where the include_usage injection goes.
    object_start: int = -1  # the top-level "{" (found by the scan only)
    stream_options_span: tuple[int, int] | None = None  # its last value's bytes

    @property
    def wants_usage(self) -> bool:
        """The client asked for the usage chunk itself."""
        options = self.stream_options
        return isinstance(options, dict) and options.get("include_usage") is True


NOT_AN_OBJECT = RequestFacts(scanned=False)


# ---- the scan -----------------------------------------------------------------------------


def scan_spans(body: bytes, decoder: bool = True) -> tuple[int, dict[str, tuple[int, int]]]:
    """(index of the top-level "{", {key: byte span of its last value}) of a JSON object.

    Raises Undecidable where it cannot tell what ``json.loads`` would make of the body, and
    NeedsDecoder, without ``decoder``, where it would hand a container to the C scanner.
    """
    opening = _OBJECT_START.match(body)
    if opening is None:
        raise Undecidable("not an object")
    start = opening.end() - 1
    spans: dict[str, tuple[int, int]] = {}
    skipper = _Skipper(body, decoder)
    pos = _ws(body, start + 1)
    if body[pos : pos + 1] == b"}":
        return start, _after_object(body, pos + 1, spans)
    key_match = _KEY.match
    separator_match = _SEPARATOR.match
    while True:
        plain = key_match(body, pos)
        if plain is not None:  # a key without escapes, and its colon
            key = _utf8(plain.group(1))
            value_start = plain.end()
        else:
            if body[pos : pos + 1] != b'"':
                raise Undecidable("expected a key")
            key_end = skipper.string_end(pos)
            if not decoder and key_end - pos > WALK_MIN_BYTES:
                raise NeedsDecoder
            key = _key(body[pos:key_end])
            pos = _ws(body, key_end)
            if body[pos : pos + 1] != b":":
                raise Undecidable("expected ':'")
            value_start = _ws(body, pos + 1)
        value_end = skipper.skip_value(value_start)
        spans.pop(key, None)  # a repeated key's last value wins, in its last position
        spans[key] = (value_start, value_end)
        separator = separator_match(body, value_end)
        if separator is None:
            raise Undecidable("expected ',' or '}'")
        pos = separator.end()
        if separator.group(1) == b"}":
            return start, _after_object(body, pos, spans)


def _ws(body: bytes, pos: int) -> int:
    return _WHITESPACE.match(body, pos).end()  # type: ignore[union-attr]  # always matches


def _after_object(
    body: bytes, pos: int, spans: dict[str, tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    if _ws(body, pos) != len(body):
        raise Undecidable("text after the object")
    return spans


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Undecidable("key is not UTF-8") from None


def _key(raw: bytes) -> str:
    """A long key, or one with an escape in it, decoded by ``json``."""
    key = _decode(raw)
    if not isinstance(key, str):
        raise Undecidable("key does not decode")
    return key


class _Skipper:
    """Finds where one JSON value ends."""

    def __init__(self, body: bytes, decoder: bool) -> None:
        self.body = body
        self.decoder = decoder  # the C scanner may be used
        self._text: str | None = None
        self._escaped_quotes = 0

    def string_end(self, opening: int) -> int:
        """Index just past the closing quote of the string opened at ``opening``.

        ``memchr`` to the next quote, and a look back for the backslashes that would escape
        it. A body full of escaped quotes would make that a Python loop per quote, so past
        ESCAPED_QUOTES of them the C scanner reads the strings instead.
        """
        body = self.body
        find = body.find
        pos = opening + 1
        while True:
            quote = find(b'"', pos)
            if quote < 0:
                raise Undecidable("unterminated string")
            before = quote - 1
            while body[before] == _BACKSLASH:
                before -= 1
            if (quote - 1 - before) % 2 == 0:  # not escaped
                return quote + 1
            self._escaped_quotes += 1
            if self._escaped_quotes > ESCAPED_QUOTES:
                try:
                    _text, end = scanstring(self.text(), opening + 1, False)
                except ValueError:
                    raise Undecidable("string does not decode") from None
                return int(end)
            pos = quote + 1

    def text(self) -> str:
        """For the C scanner: the body as Latin-1, one character per byte, so that str
        positions are byte offsets (JSON's structure is all ASCII; other bytes only ever
        sit inside strings)."""
        if not self.decoder:
            raise NeedsDecoder
        if self._text is None:
            self._text = self.body.decode("latin-1")
        return self._text

    def skip_value(self, pos: int) -> int:
        body = self.body
        if pos >= len(body):
            raise Undecidable("missing value")
        first = body[pos]
        if first == _QUOTE:
            return self.string_end(pos)
        if first in _OPEN:
            end = self._skip_container(pos) if len(body) >= WALK_MIN_BYTES else -1
            return end if end >= 0 else self._c_skip(pos)
        scalar = _SCALAR.match(body, pos)
        if scalar is None:
            raise Undecidable("not a JSON value")
        return scalar.end()

    def _skip_container(self, pos: int) -> int:
        """End of the container at ``pos``, or -1 when the C scanner would be faster."""
        body = self.body
        search = _STRUCTURE.search
        start = pos
        depth = 0
        steps = 0
        while True:
            found = search(body, pos, pos + MAX_PLAIN_RUN)
            if found is None:
                if pos + MAX_PLAIN_RUN < len(body):
                    return -1  # a long run of whitespace or numbers
                raise Undecidable("unterminated container")
            at = found.start()
            steps += 1
            if steps > GRACE_STEPS and at - start < steps * BYTES_PER_STEP:
                return -1  # dense: short strings and small containers
            char = body[at]
            if char == _QUOTE:
                pos = self.string_end(at)
                continue
            pos = at + 1
            if char in _OPEN:
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return pos

    def _c_skip(self, pos: int) -> int:
        """The C scanner, on the Latin-1 view."""
        try:
            _value, end = _c_scan(self.text(), pos)
        except (StopIteration, ValueError, RecursionError):
            raise Undecidable("container does not decode") from None
        return int(end)


# ---- facts ---------------------------------------------------------------------------------


def scan(body: bytes, endpoint: Endpoint, decoder: bool = True) -> RequestFacts:
    """The request's facts from a scan; raises Undecidable (then use ``parse``).

    Without ``decoder`` it raises NeedsDecoder where the C decoder would have to read a
    container or a large value (then run it again with the decoder, off the event loop).
    """
    start, spans = scan_spans(body, decoder)
    values: dict[str, Any] = {}
    for key in DECODED & spans.keys():
        begin, end = spans[key]
        if not decoder and end - begin > WALK_MIN_BYTES:
            raise NeedsDecoder
        values[key] = _decode(body[begin:end])
    prompt_span = spans.get(PROMPT_KEYS[endpoint])
    preamble = PREAMBLE_KEYS.get(endpoint)
    return _facts(
        values,
        endpoint,
        scanned=True,
        object_start=start,
        prompt_span=prompt_span,
        stream_options_span=spans.get("stream_options"),
        preamble_span=spans.get(preamble) if preamble else None,
    )


def _request_type(endpoint: Endpoint) -> type:
    """The fields ``read`` decodes (absent: UNSET), the prompt (and preamble) kept as bytes."""
    fields: list[tuple[str, Any, Any]] = [(key, Any, msgspec.UNSET) for key in sorted(DECODED)]
    fields.append((PROMPT_KEYS[endpoint], msgspec.Raw, msgspec.UNSET))
    if endpoint in PREAMBLE_KEYS:
        fields.append((PREAMBLE_KEYS[endpoint], msgspec.Raw, msgspec.UNSET))
    return msgspec.defstruct(f"Request_{endpoint.name.lower()}", fields)


_READERS: dict[Endpoint, Callable[[bytes], Any]] = {
    endpoint: msgspec.json.Decoder(_request_type(endpoint)).decode for endpoint in PROMPT_KEYS
}
_ORDERED_DECODED = tuple(sorted(DECODED))


def read(body: bytes, endpoint: Endpoint) -> RequestFacts:
    """The request's facts from one pass of msgspec's decoder; raises Undecidable where it
    refuses the body (then ``scan`` or ``parse``, which read it as ``json.loads`` does)."""
    try:
        request = _READERS[endpoint](body)
    except MSGSPEC_REFUSALS:
        raise Undecidable("msgspec refuses the body") from None
    unset = msgspec.UNSET
    values = {}
    for key in _ORDERED_DECODED:
        value = getattr(request, key)
        if value is not unset:
            values[key] = value
    prompt = getattr(request, PROMPT_KEYS[endpoint])
    preamble = (
        getattr(request, PREAMBLE_KEYS[endpoint], unset) if endpoint in PREAMBLE_KEYS else unset
    )
    return _facts(
        values,
        endpoint,
        scanned=True,
        prompt=None if prompt is unset else prompt,
        preamble=None if preamble is unset else preamble,
    )


def _decode(raw: bytes) -> Any:
    """One delimited value, as ``json.loads`` decodes it (its own scanner, without the
    encoding detection and whitespace handling a whole document needs)."""
    try:
        text = raw.decode("utf-8")
        value, end = _c_scan(text, 0)
    except (UnicodeDecodeError, StopIteration, ValueError, RecursionError):
        raise Undecidable("a value does not decode") from None
    if end != len(text):
        raise Undecidable("a value does not decode")
    return value


def parse(body: bytes, endpoint: Endpoint) -> RequestFacts:
    """The request's facts from decoding the whole body (what ``scan`` falls back to)."""
    try:
        obj = loads(body) if body else None
    except ValueError:
        return NOT_AN_OBJECT
    if not isinstance(obj, dict):
        return NOT_AN_OBJECT
    return _facts(obj, endpoint, scanned=False)


def facts_of(body: bytes, endpoint: Endpoint) -> RequestFacts:
    """The request's facts, by the cheapest reader that can tell:

    - from WALK_MIN_BYTES up, the scan's walk first (a long prompt is a few ``memchr``
      calls, where msgspec reads every byte), as long as it needs no C decoder;
    - then msgspec's ``read`` (one pass in C: most bodies);
    - where msgspec refuses the body, the scan with the C decoder (from WALK_MIN_BYTES up),
      else ``parse`` (``json`` decoding the whole body).
    """
    large = len(body) >= WALK_MIN_BYTES
    if large:
        try:
            return scan(body, endpoint, decoder=False)
        except (NeedsDecoder, Undecidable):
            pass
    try:
        return read(body, endpoint)
    except Undecidable:
        pass
    if large:
        try:
            return scan(body, endpoint)
        except Undecidable:
            pass
    return parse(body, endpoint)


def prompt_bytes(body: bytes, endpoint: Endpoint, facts: RequestFacts) -> memoryview | bytes | None:
    """The prompt's JSON value as sent (a view, no copy); None when the body has none.

    Where the model reads a preamble first (Anthropic's ``system``), the preamble's JSON
    value then the prompt's, joined (a copy): what comes first in the model's input comes
    first here, so a variable system prompt shows as a variable top."""
    if facts.prompt is not None or facts.preamble is not None:  # handed over by msgspec
        prompt = None if facts.prompt is None else memoryview(facts.prompt)
        preamble = None if facts.preamble is None else memoryview(facts.preamble)
    elif facts.scanned:  # the scan's spans, or none (msgspec found no prompt)
        prompt = _view(body, facts.prompt_span)
        preamble = _view(body, facts.preamble_span)
    else:  # a full parse keeps no positions: found now
        try:
            _start, spans = scan_spans(body)
        except Undecidable:
            return None
        prompt = _view(body, spans.get(PROMPT_KEYS[endpoint]))
        key = PREAMBLE_KEYS.get(endpoint)
        preamble = _view(body, spans.get(key)) if key else None
    if preamble is None:
        return prompt
    return bytes(preamble) + bytes(prompt) if prompt is not None else preamble


def _view(body: bytes, span: tuple[int, int] | None) -> memoryview | None:
    return None if span is None else memoryview(body)[span[0] : span[1]]


def _facts(
    values: dict[str, Any],
    endpoint: Endpoint,
    scanned: bool,
    object_start: int = -1,
    prompt_span: tuple[int, int] | None = None,
    stream_options_span: tuple[int, int] | None = None,
    prompt: Any = None,
    preamble: Any = None,
    preamble_span: tuple[int, int] | None = None,
) -> RequestFacts:
    model = values.get("model")
    limit = None
    for key in LIMIT_KEYS[endpoint]:
        value = values.get(key)
        if value is not None:
            limit = value if type(value) is int else None
            break
    n = values.get("n")
    user = values.get(USER_KEYS[endpoint])
    if endpoint is Endpoint.MESSAGES:
        user = user.get("user_id") if isinstance(user, dict) else None
    return RequestFacts(
        is_object=True,
        model=model if isinstance(model, str) else None,
        user=user,
        stream=values.get("stream") is True,
        has_stream_options="stream_options" in values,
        stream_options=values.get("stream_options"),
        output_limit=limit,
        sequences=n if type(n) is int and n > 1 else 1,
        prompt_span=prompt_span,
        scanned=scanned,
        object_start=object_start,
        stream_options_span=stream_options_span,
        prompt=prompt,
        preamble=preamble,
        preamble_span=preamble_span,
    )


# ---- the one change the tap makes to a request ---------------------------------------------

INCLUDE_USAGE = b'"stream_options":{"include_usage":true},'


def with_include_usage(body: bytes, facts: RequestFacts) -> bytes:
    """The body asking upstream for the usage chunk; every other byte stays put.

    Without ``stream_options`` the field is inserted first in the object. With one, its
    (last) value is replaced by the same options plus ``include_usage: true`` and without
    ``continuous_usage_stats``, which would put usage on every chunk the client never asked
    usage for. Only a body the scan cannot read (another encoding than UTF-8, say) is
    written out again whole, as UTF-8 JSON equal to the client's but for
    ``stream_options``.
    """
    start, span = facts.object_start, facts.stream_options_span
    if start < 0:  # read by msgspec or decoded whole: find the places now
        opening = _OBJECT_START.match(body)
        if not facts.has_stream_options and opening is not None and b"\x00" not in body:
            # Only the object's "{" is needed, and json or msgspec read the body as an
            # object: UTF-8
            # (UTF-16 and UTF-32 text has NULs, which UTF-8 JSON cannot), so its first "{"
            # after any BOM and whitespace is the object's. The scan would say the same.
            start = opening.end() - 1
        else:
            try:
                start, spans = scan_spans(body)
                span = spans.get("stream_options")
            except Undecidable:
                start = -1
    if start >= 0 and not facts.has_stream_options:
        at = start + 1
        if body[_ws(body, at) : _ws(body, at) + 1] == b"}":  # {}: no member to separate
            return body[:at] + INCLUDE_USAGE[:-1] + body[at:]
        return body[:at] + INCLUDE_USAGE + body[at:]
    options = facts.stream_options
    merged = dict(options) if isinstance(options, dict) else {}
    merged["include_usage"] = True
    merged.pop("continuous_usage_stats", None)
    if start >= 0 and span is not None:
        value = json.dumps(merged, separators=(",", ":")).encode("ascii")
        return body[: span[0]] + value + body[span[1] :]
    whole = loads(body)
    whole["stream_options"] = merged
    return json.dumps(whole, separators=(",", ":")).encode("ascii")
