"""One proxy request's usage, as every reader hands it to the signals: ``UsageEvent``.

Readers (HTTP ingest, file tail, tap proxy, format converters) all end in ``validate``, so one
set of rules decides what is accepted, and every rejection carries a short machine ``reason``
(a bounded label value for ``vllm_cache_usage_events_rejected_total``) plus a human message
that never repeats the offending value (it may be an API key).

``validate`` runs once per event on the ingest hot path (docs/performance.md), so it
checks exact types first and only falls back to the slower general cases when they miss.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from exporter.values import PromptPrint, UsageEvent, UsageRow, status_is_error

# Absurd sizes: no prompt is this large (the longest-context models hold ~10M tokens).
MAX_TOKENS = 10_000_000
# No request asks for more sequences of one prompt than this (OpenAI caps n at 128).
MAX_SEQUENCES = 128
# No single request waits or computes for more than a day; larger values are unit mistakes.
MAX_SECONDS = 86_400.0
# Unix time in seconds, up to the year 5138: beyond it a number is no timestamp.
MAX_TIMESTAMP = 1e11
MAX_CALLER_CHARS = 256
MAX_MODEL_CHARS = 256
MAX_SESSION_CHARS = 256
MAX_STATUS_CHARS = 32

FIELDS = ("caller", "model", "prompt_tokens", "cached_tokens", "completion_tokens",
          "ttft_seconds", "queue_seconds", "session", "time", "status",
          "engine_ttft_seconds", "engine_queue_seconds",
          # foresight
          "max_tokens",
          # n: sequences of one prompt
          "sequences")

# Every reason validate() can give, so the docs and tests can enumerate them.
REASONS = (
    "not_an_object", "missing_caller", "bad_caller", "caller_too_long", "bad_model",
    "bad_session", "missing_prompt_tokens", "not_a_number", "negative", "not_finite",
    "too_large", "cached_exceeds_prompt", "bad_status",
)

# The reasons ``validate_row`` can give differently for a JSON integer beyond 64 bits read as
# an integer (json) or as a float (orjson): its status is refused with another message, and
# its model or session is a valid name as an integer's text. Every other reason is reached
# alike (such a float is out of every number field's range, as the integer is).
READING_DEPENDENT_REASONS = frozenset({"bad_status", "bad_model", "bad_session"})


# A run of 19 digits or more: where orjson may read a number otherwise than json.
DIGITS_TO_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
LONG_DIGITS = b"0" * 19


def has_long_digits(data: bytes) -> bool:
    """Whether ``data`` holds a run of 19 or more digits. The one value orjson reads
    otherwise than ``json`` is an integer beyond 64 bits (a float, not an int); such an
    integer has 20 digits or more, so this is a cheap superset of the texts it can be in."""
    return LONG_DIGITS in data.translate(DIGITS_TO_ZERO)


_msgspec_loads = msgspec.json.Decoder().decode
# What msgspec raises on a document it does not read (then json's reading decides). A
# ValidationError is a DecodeError; in older releases DecodeError is no ValueError, and
# invalid UTF-8 raises UnicodeDecodeError.
MSGSPEC_REFUSALS = (msgspec.DecodeError, ValueError, RecursionError)


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads``'s reading, whose every failure is a ValueError.

    Bytes are read by msgspec (about 3x ``json`` on a tap answer; no pre-scan needed) where it
    reads them at all: it reads standard JSON as ``json`` does, integers beyond 64 bits
    included, and refuses everything ``json`` reads its own way (NaN and the infinities,
    numbers past a float's range, integers of thousands of digits, lone surrogate escapes, a
    byte-order mark, UTF-16 and UTF-32, nesting past its limit): those get ``json``'s reading,
    or its error. ``tests/usage/test_loads.py`` holds the two equal.

    Outside input can nest arrays a thousand deep in two kilobytes; the decoder then raises
    RecursionError, which is a malformed record like any other, not a crash.
    """
    if type(data) is bytes:
        try:
            return _msgspec_loads(data)
        except MSGSPEC_REFUSALS:
            pass
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


class InvalidEvent(ValueError):
    """A usage record that cannot be counted.

    ``reason`` is a short, bounded machine word (a metric label value); ``str()`` is the human
    explanation. Neither ever contains the rejected value itself.
    """

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason


def token_count(obj: Mapping[str, Any], key: str, required: bool) -> int | None:
    value = obj.get(key)
    if type(value) is int:
        if 0 <= value <= MAX_TOKENS:
            return value
    elif value is None:
        if required:
            raise InvalidEvent("missing_prompt_tokens", f"{key} is required")
        return None
    elif type(value) is float:
        if not math.isfinite(value):
            raise InvalidEvent("not_finite", f"{key} must be a finite number")
        if value != int(value):
            raise InvalidEvent("not_a_number", f"{key} must be a whole number of tokens")
        value = int(value)
        if 0 <= value <= MAX_TOKENS:
            return value
    else:
        raise InvalidEvent("not_a_number", f"{key} must be a number")
    if value < 0:
        raise InvalidEvent("negative", f"{key} must not be negative")
    raise InvalidEvent("too_large", f"{key} is larger than {MAX_TOKENS:,}")


def _seconds(obj: Mapping[str, Any], key: str, limit: float) -> float | None:
    """A number of seconds in [0, limit]."""
    value = duration(obj, key, limit, key, "seconds")
    return None if value is None else float(value)


def duration(obj: Mapping[str, Any], key: str, limit: float, name: str,
             unit: str) -> int | float | None:
    """A finite, non-negative number in ``unit`` up to ``limit``, or None when absent.
    Compared before any float conversion: JSON integers are unbounded, and float(2**1024)
    raises instead of giving a number. ``name`` is how the error calls the field."""
    value = obj.get(key)
    if value is None:
        return None
    kind = type(value)
    if kind is not float and kind is not int:
        raise InvalidEvent("not_a_number", f"{name} must be a number of {unit}")
    if kind is float and not math.isfinite(value):
        raise InvalidEvent("not_finite", f"{name} must be a finite number")
    if value < 0:
        raise InvalidEvent("negative", f"{name} must not be negative")
    if value > limit:
        raise InvalidEvent("too_large", f"{name} is larger than {limit:,.0f} {unit}")
    return value  # type: ignore[no-any-return]


def _text(obj: Mapping[str, Any], key: str, limit: int, reason: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if type(value) is int:  # numeric session ids are common
        value = str(value)
    if type(value) is not str:
        raise InvalidEvent(reason, f"{key} must be a string")
    if len(value) > limit or not value.isprintable():
        raise InvalidEvent(reason, f"{key} must be at most {limit} printable characters")
    return value


def _caller(obj: Mapping[str, Any]) -> str:
    caller = obj.get("caller")
    if type(caller) is str:
        caller = caller.strip(" ")  # "alice " is alice; "   " names nobody
        if 0 < len(caller) <= MAX_CALLER_CHARS and caller.isprintable():
            return caller
    if caller is None or caller == "":
        raise InvalidEvent("missing_caller", "caller is required")
    if type(caller) is not str:
        raise InvalidEvent("bad_caller", "caller must be a string")
    if len(caller) > MAX_CALLER_CHARS:
        raise InvalidEvent("caller_too_long",
                           f"caller is longer than {MAX_CALLER_CHARS} characters")
    raise InvalidEvent("bad_caller", "caller contains control or invisible characters")


def _status(obj: Mapping[str, Any]) -> int | str | None:
    status = obj.get("status")
    if status is None:
        return None
    if type(status) is int:
        if 100 <= status <= 599:
            return status
        raise InvalidEvent("bad_status", "status must be an HTTP status (100-599) or a word")
    if type(status) is str and 0 < len(status) <= MAX_STATUS_CHARS and status.isprintable():
        if status.isascii() and status.isdigit():
            return _status({"status": int(status)})
        return status
    raise InvalidEvent("bad_status", "status must be an HTTP status (100-599) or a short word")


def _make(caller: str, model: str, prompt_tokens: int, cached_tokens: int | None,
          completion_tokens: int | None, ttft_seconds: float | None,
          queue_seconds: float | None, session: str | None, time: float | None,
          status: int | str | None, engine_ttft_seconds: float | None = None,
          engine_queue_seconds: float | None = None,
          max_tokens: int | None = None, sequences: int | None = None) -> UsageEvent:
    """Build a UsageEvent from values already checked, without the frozen ``__init__``.

    A frozen dataclass sets each field through ``object.__setattr__``; filling ``__dict__``
    in one call is ~5x cheaper, and this runs once per ingested event.
    """
    event = _new(UsageEvent)
    event.__dict__.update(caller=caller, model=model, prompt_tokens=prompt_tokens,
                          cached_tokens=cached_tokens, completion_tokens=completion_tokens,
                          ttft_seconds=ttft_seconds, queue_seconds=queue_seconds,
                          session=session, time=time, status=status,
                          engine_ttft_seconds=engine_ttft_seconds,
                          engine_queue_seconds=engine_queue_seconds,
                          max_tokens=max_tokens, sequences=sequences)
    return event


def with_prompt(event: UsageEvent, prompt: PromptPrint) -> UsageEvent:
    """``dataclasses.replace(event, prompt=prompt)``, as ``_make`` builds events: a tenth of
    ``replace``'s cost (which runs the frozen ``__init__`` and walks the fields), once per
    call the tap records."""
    copy = _new(UsageEvent)
    copy.__dict__.update(event.__dict__)
    copy.__dict__["prompt"] = prompt
    return copy


_new = object.__new__

# Caller, model and session names that passed their checks recently: the same few names
# come back event after event, and a dict lookup costs a third of checking one again.
# Each holds at most VALID_NAMES_KEPT names and starts over when full.
VALID_NAMES_KEPT = 4096
_valid_callers: dict[str, None] = {}
_valid_models: dict[str, None] = {}
_valid_sessions: dict[str, None] = {}


def _remember(valid: dict[str, None], name: str) -> None:
    if len(valid) >= VALID_NAMES_KEPT:
        valid.clear()
    valid[name] = None


def validate(obj: Mapping[str, Any]) -> UsageEvent:
    """Check one native-form record (the keys of ``FIELDS``) and build its UsageEvent.

    Only ``caller`` and ``prompt_tokens`` are required; ``prompt_tokens`` may be left out of
    an event whose ``status`` is an error (a failed request has no usage). Unknown keys are
    ignored so that senders can add fields before we know them.
    """
    return _make(*validate_row(obj))


def validate_row(obj: Mapping[str, Any]) -> UsageRow:
    """``validate``, giving the event as a ``UsageRow`` (the batched ingest path's form).

    Each field is tried against its common shape inline (an exact type and range check);
    anything else goes to the helper that either accepts the less common form or raises.
    """
    if type(obj) is not dict and not isinstance(obj, Mapping):
        raise InvalidEvent("not_an_object", "each event must be a JSON object")
    get = obj.get
    caller = get("caller")
    if type(caller) is not str or caller not in _valid_callers:
        if type(caller) is str and 0 < len(caller) <= MAX_CALLER_CHARS \
                and caller.isprintable() and caller[0] != " " and caller[-1] != " ":
            _remember(_valid_callers, caller)
        else:
            caller = _caller(obj)
    status = get("status")
    if status is not None and not (type(status) is int and 200 <= status < 300):
        status = _status(obj)
    prompt_tokens = get("prompt_tokens")
    if not (type(prompt_tokens) is int and 0 <= prompt_tokens <= MAX_TOKENS):
        prompt_tokens = token_count(obj, "prompt_tokens",
                                required=not status_is_error(status)) or 0
    cached_tokens = get("cached_tokens")
    if cached_tokens is not None and not (type(cached_tokens) is int
                                          and 0 <= cached_tokens <= MAX_TOKENS):
        cached_tokens = token_count(obj, "cached_tokens", required=False)
    if cached_tokens is not None and cached_tokens > prompt_tokens:
        raise InvalidEvent("cached_exceeds_prompt",
                           "cached_tokens is larger than prompt_tokens")
    completion_tokens = get("completion_tokens")
    if completion_tokens is not None and not (type(completion_tokens) is int
                                              and 0 <= completion_tokens <= MAX_TOKENS):
        completion_tokens = token_count(obj, "completion_tokens", required=False)
    ttft = get("ttft_seconds")
    if ttft is not None and not (type(ttft) is float and 0.0 <= ttft <= MAX_SECONDS):
        ttft = _seconds(obj, "ttft_seconds", MAX_SECONDS)
    queue = get("queue_seconds")
    if queue is not None and not (type(queue) is float and 0.0 <= queue <= MAX_SECONDS):
        queue = _seconds(obj, "queue_seconds", MAX_SECONDS)
    when = get("time")
    if when is not None and not (type(when) is float and 0.0 <= when <= MAX_TIMESTAMP):
        when = _seconds(obj, "time", MAX_TIMESTAMP)
    model = get("model")
    if type(model) is not str or model not in _valid_models:
        if type(model) is str and len(model) <= MAX_MODEL_CHARS and model.isprintable():
            _remember(_valid_models, model)
        else:
            model = _text(obj, "model", MAX_MODEL_CHARS, "bad_model") or ""
    session = get("session")
    if session is not None and (type(session) is not str or session not in _valid_sessions):
        if type(session) is str and len(session) <= MAX_SESSION_CHARS and session.isprintable():
            _remember(_valid_sessions, session)
        else:
            session = _text(obj, "session", MAX_SESSION_CHARS, "bad_session")
    # vLLM's own per-request timings, when the reader found them.
    engine_ttft = get("engine_ttft_seconds")
    if engine_ttft is not None and not (type(engine_ttft) is float
                                        and 0.0 <= engine_ttft <= MAX_SECONDS):
        engine_ttft = _seconds(obj, "engine_ttft_seconds", MAX_SECONDS)
    engine_queue = get("engine_queue_seconds")
    if engine_queue is not None and not (type(engine_queue) is float
                                         and 0.0 <= engine_queue <= MAX_SECONDS):
        engine_queue = _seconds(obj, "engine_queue_seconds", MAX_SECONDS)
    # foresight: the completion budget the request declared (range-checked as a token count
    # before any conversion, like the others).
    max_tokens = get("max_tokens")
    if max_tokens is not None and not (type(max_tokens) is int
                                       and 0 <= max_tokens <= MAX_TOKENS):
        max_tokens = token_count(obj, "max_tokens", required=False)
    sequences = get("sequences")
    if sequences is not None and not (type(sequences) is int
                                      and 1 <= sequences <= MAX_SEQUENCES):
        sequences = _sequences(obj)
    return (caller, model, prompt_tokens, cached_tokens, completion_tokens, ttft, queue,
            session, when, status, engine_ttft, engine_queue, max_tokens, sequences)


def _sequences(obj: Mapping[str, Any]) -> int | None:
    """``sequences``: a whole number from 1 to MAX_SEQUENCES."""
    value = token_count(obj, "sequences", required=False)
    if value is None:
        return None
    if value == 0:
        raise InvalidEvent("not_a_number", "sequences must be at least 1")
    if value > MAX_SEQUENCES:
        raise InvalidEvent("too_large", f"sequences is larger than {MAX_SEQUENCES}")
    return value


# ---- the common native event, decoded and checked in one step --------------------------------
# msgspec decodes a line straight into the fields below, checking each number's type and range
# in C (half of what ``validate_row`` does in Python, and faster than orjson's decode to a
# dict alone). What it cannot check (a name's characters, the status, cached <= prompt) is
# checked by ``quick_row`` against what ``validate_row`` already accepted.
_Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
_Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
_Timestamp = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TIMESTAMP)]


# Each field's type as msgspec checks it (every one may also be absent or null).
_NATIVE_TYPES: dict[str, Any] = {
    "caller": str, "model": str, "session": str, "status": int | str,
    "prompt_tokens": _Tokens, "cached_tokens": _Tokens, "completion_tokens": _Tokens,
    "max_tokens": _Tokens, "time": _Timestamp, "ttft_seconds": _Seconds,
    "queue_seconds": _Seconds, "engine_ttft_seconds": _Seconds,
    "engine_queue_seconds": _Seconds,
    "sequences": Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQUENCES)],
}
# The fields of ``FIELDS``, in its order, which is ``UsageRow``'s (``astuple`` of one is the
# row; tests/usage/test_quick_row.py holds the orders together). Unknown keys are skipped, a
# repeated key's last value counts, as ``json``.
_NativeEvent = msgspec.defstruct(
    "_NativeEvent", [(name, _NATIVE_TYPES[name] | None, None) for name in FIELDS], gc=False)


_decode_native_event = msgspec.json.Decoder(_NativeEvent).decode
_as_row = msgspec.structs.astuple


def quick_row(line: bytes) -> UsageRow | None:
    """``validate_row(json.loads(line))`` for the common native event, or None (or any
    exception) where that must decide: the line is not an ASCII JSON object whose numbers are
    all of their field's type and in its range, a name was not already accepted by
    ``validate_row`` (``_valid_callers``...), the status is not a success or absent,
    ``prompt_tokens`` is missing, or ``cached_tokens`` exceeds it.

    Only ASCII lines: msgspec does not check the UTF-8 of the values it skips (an unknown
    key's), which ``json`` refuses. Whatever it accepts, ``json`` reads the same way
    (tests/usage/test_quick_row.py holds the two together).
    """
    if not line.isascii():
        return None
    event: Any = _decode_native_event(line)  # a _NativeEvent (built at run time)
    prompt_tokens = event.prompt_tokens
    cached_tokens = event.cached_tokens
    status = event.status
    session = event.session
    if event.caller in _valid_callers and event.model in _valid_models \
            and (session is None or session in _valid_sessions) \
            and prompt_tokens is not None \
            and (cached_tokens is None or cached_tokens <= prompt_tokens) \
            and (status is None or type(status) is int and 200 <= status < 300):
        return _as_row(event)  # type: ignore[return-value]
    return None
