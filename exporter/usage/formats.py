"""Converters from what proxies already emit to ``UsageEvent``, one per ``--usage.*.format``.

- ``native``: the UsageEvent keys themselves (``event.validate``).
- ``litellm``: LiteLLM's StandardLoggingPayload, as its ``generic_api`` callback posts it.
- ``openai``: a record holding a raw OpenAI-compatible response body (or its streamed final
  usage chunk, or the SSE text) plus the caller and timings the proxy measured.
- ``mapping``: any JSON, with a YAML file of dotted paths per UsageEvent field.

The replica that served a request (``backend``) is the record's ``backend`` key in the
native, ``openai`` and ``mapping`` formats, LiteLLM's ``api_base`` in its payload.

Every converter builds the native form and hands it to ``validate``, so the same limits and
rejection reasons apply whatever the format.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import yaml

from exporter.usage.event import FIELDS, InvalidEvent, validate
from exporter.usage.openai import engine_timings_of, parse_usage, read_response
from exporter.values import MAX_BACKEND_CHARS, UsageEvent, status_is_error

Converter = Callable[[Any], UsageEvent]


class MappingError(ValueError):
    """A ``--usage.mapping.file`` that cannot be used; ``str()`` names the field."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


_MISSING = object()


def get_path(obj: Any, path: str | Sequence[str]) -> Any:
    """``a.b.0.c`` into nested mappings/lists; None when any step is missing."""
    parts = path.split(".") if isinstance(path, str) else path
    for part in parts:
        if isinstance(obj, Mapping):
            obj = obj.get(part, _MISSING)
        elif isinstance(obj, list) and part.lstrip("-").isdigit():
            index = int(part)
            obj = obj[index] if -len(obj) <= index < len(obj) else _MISSING
        else:
            return None
        if obj is _MISSING:
            return None
    return obj


def _object(obj: Any) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise InvalidEvent("not_an_object", "each event must be a JSON object")
    return obj


# ---- native ----------------------------------------------------------------------------

native: Converter = validate


# ---- LiteLLM ---------------------------------------------------------------------------


class LiteLLMFormat:
    """StandardLoggingPayload (``litellm/types/utils.py``) -> UsageEvent.

    - caller: the first non-empty of ``caller_fields`` (default: the virtual key's alias,
      the team alias, ``end_user``); never the key hash, which is not a name.
    - model: ``model`` (what LiteLLM sent to vLLM, without a ``custom_llm_provider/``
      prefix), else ``model_group``.
    - cached tokens: the provider's usage object (``metadata.usage_object``, else
      ``hidden_params.usage_object``, else ``response.usage``),
      ``prompt_tokens_details.cached_tokens``.
    - TTFT (proxy-measured): ``completionStartTime - startTime``, for streamed requests
      only: LiteLLM sets ``completionStartTime`` to ``endTime`` when the response was not
      streamed, and its own TTFT metric is streaming-only for the same reason.
    - TTFT and queue wait (engine-measured): a non-streamed response keeps vLLM's own
      ``metrics`` object (``--enable-per-request-metrics``) in ``response``, read wherever
      it is present; LiteLLM drops it from streams. The payload has no admission wait.
    - session: the first non-empty of ``SESSION_FIELDS``. ``session_id`` is filled (from the
      ``x-litellm-session-id`` header, ``metadata.session_id`` or ``litellm_session_id``)
      only under ``request_correlation_in_logs: true``; without it, the header and
      ``metadata.session_id`` still reach ``metadata.requester_metadata.session_id``.
      ``trace_id`` is never read: it is a fresh id per call when the client sent none, which
      would make every call a conversation of its own.
    - status: ``status`` ("success" / "failure"); failures count as errors.
    - max_tokens: the request's ``model_parameters.max_tokens`` (else
      ``max_completion_tokens``): LiteLLM keeps the optional parameters it sent there.
    - sequences: ``model_parameters.n`` (an integer; anything else is left out).
    - backend: ``api_base`` (the vLLM the call went to), else ``hidden_params.api_base``,
      without credentials; a value that is no usable backend (not text, empty, too long,
      unprintable) is left out and the event still counts, without a target.
    """

    SESSION_FIELDS = (("session_id",), ("metadata", "requester_metadata", "session_id"))
    MAX_TOKENS_FIELDS = (
        ("model_parameters", "max_tokens"),
        ("model_parameters", "max_completion_tokens"),
    )

    def __init__(self, caller_fields: Sequence[str]) -> None:
        self.caller_fields = [field.split(".") for field in caller_fields]

    def __call__(self, obj: Any) -> UsageEvent:
        payload = _object(obj)
        caller = _first_text(payload, self.caller_fields)
        status = payload.get("status")
        usage = None
        if not (type(status) in (int, str) and status_is_error(status)):
            # A failed call has no usage worth reading; a successful one must have usable
            # numbers wherever it carries them.
            usage = parse_usage(
                get_path(payload, ("metadata", "usage_object"))
                or get_path(payload, ("hidden_params", "usage_object"))
                or get_path(payload, ("response", "usage"))
            )
        model = payload.get("model") or payload.get("model_group")
        provider = payload.get("custom_llm_provider")
        if type(model) is str and type(provider) is str and model.startswith(provider + "/"):
            model = model[len(provider) + 1 :]  # "hosted_vllm/qwen" is vLLM's "qwen"
        prompt_tokens = payload.get("prompt_tokens")
        completion_tokens = payload.get("completion_tokens")
        native_form: dict[str, Any] = {
            "caller": caller,
            "model": model,
            "prompt_tokens": prompt_tokens
            if prompt_tokens is not None
            else usage.prompt_tokens
            if usage
            else None,
            "cached_tokens": usage.cached_tokens if usage else None,
            "completion_tokens": completion_tokens
            if completion_tokens is not None
            else usage.completion_tokens
            if usage
            else None,
            "session": _first_text(payload, self.SESSION_FIELDS),
            "status": status,
        }
        native_form["time"] = _timestamp(payload.get("startTime"))
        native_form["ttft_seconds"] = _litellm_ttft(payload)
        native_form["max_tokens"] = _first_text(payload, self.MAX_TOKENS_FIELDS)
        n = get_path(payload, ("model_parameters", "n"))
        if type(n) is int and n >= 1:
            native_form["sequences"] = n
        backend = _backend(payload.get("api_base")) or _backend(
            get_path(payload, ("hidden_params", "api_base"))
        )
        if backend is not None:
            native_form["backend"] = backend
        timings = engine_timings_of(payload.get("response"))
        if timings is not None:
            native_form["engine_ttft_seconds"] = timings.ttft_seconds
            native_form["engine_queue_seconds"] = timings.queue_seconds
        return validate(native_form)


def _backend(value: Any) -> str | None:
    """LiteLLM's ``api_base`` as a backend: its text without any user:password, or None
    where it cannot be one (the call is still counted: the backend is only where it ran)."""
    if type(value) is not str:
        return None
    value = value.strip()
    scheme, separator, rest = value.partition("://")
    if separator:
        end = len(rest)
        for mark in "/?#":  # the authority ends at the path, the query or the fragment
            at = rest.find(mark)
            if at >= 0:
                end = min(end, at)
        value = f"{scheme}://{rest[:end].rpartition('@')[2]}{rest[end:]}"
    if 0 < len(value) <= MAX_BACKEND_CHARS and value.isprintable():
        return value
    return None


def _litellm_ttft(payload: Mapping[str, Any]) -> float | None:
    """LiteLLM's own first-chunk time, which only a streamed request has."""
    start, first, end = (
        _timestamp(payload.get(key)) for key in ("startTime", "completionStartTime", "endTime")
    )
    stream = payload.get("stream")
    if (
        start is not None
        and first is not None
        and (stream is True or (stream is None and end is not None and first < end))
    ):
        return max(0.0, first - start)
    return None


# Unix seconds: beyond this a value is no timestamp (and a huge int would overflow a float).
MAX_TIMESTAMP = 1e12


def _timestamp(value: Any) -> float | None:
    """A finite time in seconds, else None (the TTFT is then unknown, the event still counts)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not -MAX_TIMESTAMP <= value <= MAX_TIMESTAMP:  # also false for NaN
        return None
    return float(value)


def _first_text(payload: Mapping[str, Any], paths: Sequence[Sequence[str]]) -> Any:
    """The first present, non-empty value of ``paths`` (LiteLLM writes "" for none)."""
    for path in paths:
        value = get_path(payload, path)
        if value not in (None, ""):
            return value
    return None


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)


# ---- OpenAI response record ------------------------------------------------------------


class OpenAIFormat:
    """``{"caller", "response", ...timings}`` -> UsageEvent.

    ``response`` is the response body the proxy got from vLLM: a JSON object (a whole
    response, or the final chunk of a stream, the one with ``choices: []`` and the usage),
    or its raw text (JSON, or the SSE stream, in which the last chunk with a usage wins).
    The record's own ``model``, ``ttft_seconds``, ``queue_seconds``, ``session``, ``time``,
    ``status`` and ``max_tokens`` keys are taken as they are (the proxy's measurements).
    vLLM's per-request ``metrics`` (``--enable-per-request-metrics``) in the response give
    the engine's own TTFT and queue wait, kept apart from the proxy's.
    """

    def __call__(self, obj: Any) -> UsageEvent:
        record = _object(obj)
        status = record.get("status")
        failed = type(status) in (int, str) and status_is_error(status)
        native_form: dict[str, Any] = {key: record[key] for key in FIELDS if key in record}
        if failed and not isinstance(record.get("response"), (Mapping, str, bytes)):
            return validate(native_form)  # a failed request has no usage; counted as an error
        read = read_response(record.get("response"))
        if read.usage is None:
            if failed:
                return validate(native_form)
            raise InvalidEvent("missing_usage", "the response carries no usage object")
        native_form.setdefault("prompt_tokens", read.usage.prompt_tokens)
        native_form.setdefault("cached_tokens", read.usage.cached_tokens)
        native_form.setdefault("completion_tokens", read.usage.completion_tokens)
        if not native_form.get("model"):
            native_form["model"] = read.model
        if read.engine is not None:
            native_form.setdefault("engine_ttft_seconds", read.engine.ttft_seconds)
            native_form.setdefault("engine_queue_seconds", read.engine.queue_seconds)
        return validate(native_form)


# ---- user mapping ----------------------------------------------------------------------


class MappingFormat:
    """Any JSON record, read with a YAML mapping of UsageEvent fields to dotted paths.

    Each field maps to a path (``usage.prompt_tokens``), a list of paths (the first that is
    present wins), or ``{path: ..., scale: 0.001, minus: other.path, plus: [a, b]}`` for
    values that need arithmetic (milliseconds, a TTFT given as two timestamps, a prompt
    given in parts as Anthropic's usage gives it). ``minus`` is one value (a path, or a
    list of paths of which the first present counts), and without it the field is left
    out; ``plus`` is a list of terms (each a path, or a list of alternative paths) that are
    added, an absent term adding nothing. ``scale`` applies to the result.
    """

    def __init__(self, spec: Mapping[str, Any], source: str = "mapping") -> None:
        self.rules: list[
            tuple[str, list[list[str]], float, list[list[str]], list[list[list[str]]]]
        ] = []
        for field, rule in spec.items():
            if field not in FIELDS:
                raise MappingError(
                    f"{source}: {field}", f"unknown field (known: {', '.join(FIELDS)})"
                )
            scale, minus, plus = 1.0, [], []
            if isinstance(rule, Mapping):
                unknown = set(rule) - {"path", "scale", "minus", "plus"}
                if unknown or "path" not in rule:
                    raise MappingError(
                        f"{source}: {field}",
                        "expected a path, a list of paths, or {path, scale, minus, plus}",
                    )
                scale_raw = rule.get("scale", 1.0)
                if isinstance(scale_raw, bool) or not isinstance(scale_raw, (int, float)):
                    raise MappingError(f"{source}: {field}.scale", "expected a number")
                scale = float(scale_raw)
                minus = self._paths(rule.get("minus", []), f"{source}: {field}.minus")
                terms = rule.get("plus", [])
                if isinstance(terms, str):
                    terms = [terms]
                if not isinstance(terms, list):
                    raise MappingError(f"{source}: {field}.plus", "expected a list of paths to add")
                plus = [self._paths(term, f"{source}: {field}.plus") for term in terms]
                rule = rule["path"]
            self.rules.append((field, self._paths(rule, f"{source}: {field}"), scale, minus, plus))
        mapped = {rule[0] for rule in self.rules}
        for required in ("caller", "prompt_tokens"):
            if required not in mapped:
                raise MappingError(source, f"the mapping must give a path for {required}")

    @staticmethod
    def _paths(rule: Any, where: str) -> list[list[str]]:
        if isinstance(rule, str):
            rule = [rule]
        if not isinstance(rule, list) or not all(isinstance(p, str) and p for p in rule):
            raise MappingError(where, "expected a dotted path or a list of them")
        return [path.split(".") for path in rule]

    def __call__(self, obj: Any) -> UsageEvent:
        record = _object(obj)
        native_form: dict[str, Any] = {}
        for field, paths, scale, minus, plus in self.rules:
            value = _first(record, paths)
            if value is None:
                continue
            for term in plus:
                addend = _first(record, term)
                if addend is not None:
                    value = _operand(value, field) + _operand(addend, field)
            if minus:
                other = _first(record, minus)
                if other is None:
                    continue
                value = _operand(value, field) - _operand(other, field)
            if scale != 1.0:
                value = _operand(value, field) * scale
                if not math.isfinite(value):
                    raise InvalidEvent("not_finite", f"{field} must be a finite number")
                if field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
                    value = round(value)
            native_form[field] = value
        return validate(native_form)


# Arithmetic takes numbers up to this magnitude: past it a token count or a time means
# nothing, and a JSON integer can be too large for any float.
MAX_OPERAND = 1e15


def _operand(value: Any, field: str) -> float:
    if not _is_number(value):
        if isinstance(value, float):
            raise InvalidEvent("not_finite", f"{field} must be a finite number")
        raise InvalidEvent("not_a_number", f"{field} must be computed from numbers")
    if not -MAX_OPERAND <= value <= MAX_OPERAND:
        raise InvalidEvent("too_large", f"{field} is out of range")
    return float(value)


def _first(record: Mapping[str, Any], paths: list[list[str]]) -> Any:
    for path in paths:
        value = get_path(record, path)
        if value is not None:
            return value
    return None


def load_mapping(path: str) -> MappingFormat:
    """Read the --usage.mapping.file; problems are configuration errors (exit 2)."""
    where = "--usage.mapping.file"
    try:
        with open(path, encoding="utf-8") as handle:
            spec = yaml.safe_load(handle)
    except OSError as err:
        raise MappingError(where, f"cannot read {path}: {err.strerror}") from None
    except yaml.YAMLError:
        raise MappingError(where, f"{path} is not valid YAML") from None
    if not isinstance(spec, Mapping):
        raise MappingError(where, f"{path} must map UsageEvent fields to dotted paths")
    return MappingFormat(spec, source=path)


# ---- registry --------------------------------------------------------------------------


def build_converters(
    litellm_caller_fields: Sequence[str], mapping: MappingFormat | None = None
) -> dict[str, Converter]:
    """Every format usable with these settings (``mapping`` only with a mapping)."""
    converters: dict[str, Converter] = {
        "native": native,
        "litellm": LiteLLMFormat(litellm_caller_fields),
        "openai": OpenAIFormat(),
    }
    if mapping is not None:
        converters["mapping"] = mapping
    return converters
