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
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from exporter.redaction import KEY_HASH_DIGITS, KEY_LABEL_PREFIX
from exporter.values import (
    MAX_BACKEND_CHARS,
    MAX_CALLER_CHARS,
    MAX_EVENT_ID_CHARS,
    MAX_MODEL_CHARS,
    MAX_SECONDS,
    MAX_SEQUENCES,
    MAX_SESSION_CHARS,
    MAX_STATUS_CHARS,
    MAX_TIMESTAMP,
    MAX_TOKENS,
    OVERFLOW_LABEL,
    UsageEvent,
    status_is_error,
)

# Every field, in UsageEvent's order: the native format's keys (the prompt fingerprint,
# which only the tap makes, travels beside the event, never in it).
FIELDS = tuple(field.name for field in msgspec.structs.fields(UsageEvent))

# Every reason validate() can give, so the docs and tests can enumerate them.
REASONS = (
    "not_an_object",
    "missing_caller",
    "bad_caller",
    "caller_too_long",
    "bad_model",
    "bad_session",
    "missing_prompt_tokens",
    "not_a_number",
    "negative",
    "not_finite",
    "too_large",
    "cached_exceeds_prompt",
    "bad_status",
    "reserved_caller",
    "bad_id",
    "bad_backend",
)

# The reasons ``validate`` can give differently for a JSON integer beyond 64 bits read as
# an integer (json) or as a float (orjson): its status is refused with another message, and
# its model, session or id is a valid name as an integer's text. Every other reason is
# reached alike (such a float is out of every number field's range, as the integer is).
READING_DEPENDENT_REASONS = frozenset(
    {"bad_status", "bad_model", "bad_session", "bad_id", "bad_backend"}
)


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


def duration(
    obj: Mapping[str, Any], key: str, limit: float, name: str, unit: str
) -> int | float | None:
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


_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_KEY_LABEL_CHARS = len(KEY_LABEL_PREFIX) + KEY_HASH_DIGITS


def is_reserved_caller(name: str) -> bool:
    """Whether ``name`` is one the exporter itself gives a caller: the overflow label
    (``__other__``) or the form of a hashed key (``key-`` and 12 hex digits,
    ``redaction.key_label``), in any case. A sender naming itself so would be counted with
    what the exporter folded, or as a key the operator may have aliased (--callers.alias)."""
    if len(name) == _KEY_LABEL_CHARS:
        return name[: len(KEY_LABEL_PREFIX)].lower() == KEY_LABEL_PREFIX and _HEX_DIGITS.issuperset(
            name[len(KEY_LABEL_PREFIX) :]
        )
    return len(name) == len(OVERFLOW_LABEL) and name.lower() == OVERFLOW_LABEL


def _caller(obj: Mapping[str, Any], own: bool = False) -> str:
    caller = obj.get("caller")
    if type(caller) is str:
        caller = caller.strip(" ")  # "alice " is alice; "   " names nobody
        if 0 < len(caller) <= MAX_CALLER_CHARS and caller.isprintable():
            if own or not is_reserved_caller(caller):
                return caller
            raise InvalidEvent(
                "reserved_caller",
                "caller is a name the exporter gives "
                "(__other__, or key- and 12 hex digits: a hashed key)",
            )
    if caller is None or caller == "":
        raise InvalidEvent("missing_caller", "caller is required")
    if type(caller) is not str:
        raise InvalidEvent("bad_caller", "caller must be a string")
    if len(caller) > MAX_CALLER_CHARS:
        raise InvalidEvent(
            "caller_too_long", f"caller is longer than {MAX_CALLER_CHARS} characters"
        )
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


def _model(value: Any, key: str) -> str:
    if type(value) is str and value in _valid_models:
        return value
    if type(value) is str and len(value) <= MAX_MODEL_CHARS and value.isprintable():
        _remember(_valid_models, value)
        return value
    return _text({key: value}, key, MAX_MODEL_CHARS, "bad_model") or ""


def _session(value: Any, key: str) -> str | None:
    if value is None or type(value) is str and value in _valid_sessions:
        return value  # type: ignore[no-any-return]
    if type(value) is str and len(value) <= MAX_SESSION_CHARS and value.isprintable():
        _remember(_valid_sessions, value)
        return value
    return _text({key: value}, key, MAX_SESSION_CHARS, "bad_session")


def _caller_name(value: Any, key: str) -> str:
    if type(value) is str and value in _valid_callers:
        return value
    if (
        type(value) is str
        and 0 < len(value) <= MAX_CALLER_CHARS
        and value.isprintable()
        and value[0] != " "
        and value[-1] != " "
        and not is_reserved_caller(value)
    ):
        _remember(_valid_callers, value)
        return value
    return _caller({key: value})


def _own_caller_name(value: Any, key: str) -> str:
    """A caller name the reader made itself (the tap's hash of a key): held to every rule
    but the reserved names, and never remembered as accepted (``_valid_callers`` lets the
    quick reading take a name from outside)."""
    return _caller({key: value}, own=True)


def _printable_name(limit: int, reason: str) -> Callable[[Any, str], str | None]:
    """The check of a name given as printable text of 1 to ``limit`` characters (a number
    as its text), refused with ``reason``: an event id, a backend."""

    def check(value: Any, key: str) -> str | None:
        if value is None or type(value) is str and 0 < len(value) <= limit and value.isprintable():
            return value  # type: ignore[no-any-return]
        if type(value) is int:
            return check(str(value), key)
        raise InvalidEvent(reason, f"{key} must be 1 to {limit} printable characters")

    return check


# An id names the request per caller; a backend the vLLM replica that served it.
_event_id = _printable_name(MAX_EVENT_ID_CHARS, "bad_id")
_backend = _printable_name(MAX_BACKEND_CHARS, "bad_backend")


def _tokens(value: Any, key: str) -> int | None:
    if value is None or type(value) is int and 0 <= value <= MAX_TOKENS:
        return value  # type: ignore[no-any-return]
    return token_count({key: value}, key, required=False)


def _seconds_checker(limit: float) -> Callable[[Any, str], float | None]:
    def check(value: Any, key: str) -> float | None:
        if value is None or type(value) is float and 0.0 <= value <= limit:
            return value  # type: ignore[no-any-return]
        return _seconds({key: value}, key, limit)

    return check


def _status_of(value: Any, key: str) -> int | str | None:
    if value is None or type(value) is int and 200 <= value < 300:
        return value  # type: ignore[no-any-return]
    return _status({"status": value})


def _sequences(value: Any, key: str) -> int | None:
    """A whole number from 1 to MAX_SEQUENCES."""
    if value is None or type(value) is int and 1 <= value <= MAX_SEQUENCES:
        return value  # type: ignore[no-any-return]
    count = token_count({key: value}, key, required=False)
    if count == 0:
        raise InvalidEvent("not_a_number", f"{key} must be at least 1")
    if count is not None and count > MAX_SEQUENCES:
        raise InvalidEvent("too_large", f"{key} is larger than {MAX_SEQUENCES}")
    return count


# Each type of UsageEvent's fields (values.py) and the check of a value declared with it:
# the fast common case inline, anything else to the helper that accepts the less common form
# (a whole float as tokens, an integer as seconds, a numeric session) or says why not.
_CHECK_BY_TYPE: dict[str, Callable[[Any, str], Any]] = {
    "CallerName": _caller_name,
    "ModelName": _model,
    "SessionId": _session,
    "Tokens": _tokens,
    "Seconds": _seconds_checker(MAX_SECONDS),
    "Timestamp": _seconds_checker(MAX_TIMESTAMP),
    "Status": _status_of,
    "Sequences": _sequences,
    "EventId": _event_id,
    "BackendName": _backend,
}


def _declared_type(field: msgspec.structs.FieldInfo) -> str:
    """The name of the type a field is declared with (``Tokens | None`` -> ``Tokens``)."""
    annotation = UsageEvent.__annotations__[field.name]
    return str(annotation).split("|")[0].strip()


# (field, its check), in UsageEvent's order. A field of a type without a check fails here,
# at import: every field is validated, and by the rule of its type.
_CHECKS = tuple(
    (field.name, _CHECK_BY_TYPE[_declared_type(field)])
    for field in msgspec.structs.fields(UsageEvent)
)


def validate(obj: Mapping[str, Any]) -> UsageEvent:
    """Check one native-form record (the keys of ``FIELDS``) and build its UsageEvent.

    Only ``caller`` and ``prompt_tokens`` are required; ``prompt_tokens`` may be left out of
    an event whose ``status`` is an error (a failed request has no usage). Unknown keys are
    ignored so that senders can add fields before we know them.
    """
    if type(obj) is not dict and not isinstance(obj, Mapping):
        raise InvalidEvent("not_an_object", "each event must be a JSON object")
    return _validated(obj.get)


def checked(event: UsageEvent, own_caller: bool = False) -> UsageEvent:
    """``event`` (built by a reader from what it read) held to ``validate``'s rules: the
    same event, or InvalidEvent with the reason ``validate`` would give its native form.
    ``own_caller``: the caller is a name the reader made (the tap's ``key-`` hash of the
    request's key), which may have the form reserved to the exporter."""
    return _validated(
        lambda name: getattr(event, name), _own_caller_name if own_caller else _caller_name
    )


def _validated(
    get: Callable[[str], Any], caller_name: Callable[[Any, str], str] = _caller_name
) -> UsageEvent:
    """The checks of ``_CHECKS`` in order, after the three that decide what the others mean:
    who sent it, whether it failed, how long its prompt was (a failed request needs none)."""
    caller = caller_name(get("caller"), "caller")
    status = _status_of(get("status"), "status")
    prompt_tokens = _tokens(get("prompt_tokens"), "prompt_tokens")
    if prompt_tokens is None:
        if not status_is_error(status):
            raise InvalidEvent("missing_prompt_tokens", "prompt_tokens is required")
        prompt_tokens = 0
    values: list[Any] = []
    for name, check in _CHECKS:
        if name in _DECIDED_FIRST:
            values.append(
                caller if name == "caller" else status if name == "status" else prompt_tokens
            )
            continue
        value = check(get(name), name)
        if name == "cached_tokens" and value is not None and value > prompt_tokens:
            raise InvalidEvent(
                "cached_exceeds_prompt", "cached_tokens is larger than prompt_tokens"
            )
        values.append(value)
    return UsageEvent(*values)


_DECIDED_FIRST = frozenset({"caller", "status", "prompt_tokens"})


# ---- the common native event, decoded and checked in one step --------------------------------
# msgspec decodes a line straight into a UsageEvent, checking each number's type and range in
# C from the field's declared type (half of what ``validate`` does in Python). What it cannot
# check (a name's characters, the status, cached <= prompt) is checked by ``quick_event``
# against what ``validate`` already accepted. A line without caller, model or prompt_tokens
# does not decode: ``validate`` decides what it means.
_decode_native_event = msgspec.json.Decoder(UsageEvent).decode


def quick_event(line: bytes) -> UsageEvent | None:
    """``validate(json.loads(line))`` for the common native event, or None (or one of
    ``MSGSPEC_REFUSALS``) where that must decide: the line is not an ASCII JSON object
    whose fields are all of their declared type and in range, a name was not already
    accepted by ``validate`` (``_valid_callers``...), the status is not a success or
    absent, ``cached_tokens`` exceeds ``prompt_tokens``, or the id or the backend is not
    printable.

    Only ASCII lines: msgspec does not check the UTF-8 of the values it skips (an unknown
    key's), which ``json`` refuses. Whatever it accepts, ``json`` reads the same way
    (tests/usage/test_quick_row.py holds the two together).
    """
    if not line.isascii():
        return None
    event = _decode_native_event(line)
    cached_tokens = event.cached_tokens
    status = event.status
    session = event.session
    event_id = event.id
    backend = event.backend
    if (
        event.caller in _valid_callers
        and event.model in _valid_models
        and (session is None or session in _valid_sessions)
        and (cached_tokens is None or cached_tokens <= event.prompt_tokens)
        and (status is None or type(status) is int and 200 <= status < 300)
        and (event_id is None or event_id.isprintable())
        and (backend is None or backend.isprintable())
    ):
        return event
    return None
