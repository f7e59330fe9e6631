"""Converters from what proxies already emit to ``UsageEvent``, one per ``--usage.*.format``.

- ``native``: the UsageEvent keys themselves (``event.validate``).
- ``litellm``: LiteLLM's StandardLoggingPayload, as its ``generic_api`` callback posts it.
- ``openai``: a record holding a raw OpenAI-compatible response body (or its streamed final
  usage chunk, or the SSE text) plus the caller and timings the proxy measured.
- ``mapping``: any JSON, with a YAML file of dotted paths per UsageEvent field.

Every converter builds the native form and hands it to ``validate``, so the same limits and
rejection reasons apply whatever the format.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import yaml

from exporter.config import Config, ConfigError
from exporter.usage.event import FIELDS, InvalidEvent, UsageEvent, status_is_error, validate

Converter = Callable[[Any], UsageEvent]

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


def usage_numbers(usage: Any) -> dict[str, Any]:
    """prompt/cached/completion tokens from any OpenAI-compatible usage object.

    Chat and completions: ``prompt_tokens``, ``prompt_tokens_details.cached_tokens``;
    Responses API: ``input_tokens``, ``input_tokens_details.cached_tokens``; Anthropic
    messages: ``input_tokens`` excludes both cache fields, so the prompt is their sum. An
    absent or null ``cached_tokens`` stays None: it was not reported, it is not 0.
    """
    if not isinstance(usage, Mapping):
        return {}
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
        read = usage.get("cache_read_input_tokens")
        created = usage.get("cache_creation_input_tokens")
        prompt = usage.get("input_tokens")
        if all(type(v) is int for v in (read or 0, created or 0, prompt)):
            prompt = prompt + (read or 0) + (created or 0)
        return {"prompt_tokens": prompt, "cached_tokens": read,
                "completion_tokens": usage.get("output_tokens")}
    if "input_tokens" in usage and "prompt_tokens" not in usage:
        details = usage.get("input_tokens_details")
        return {"prompt_tokens": usage.get("input_tokens"),
                "cached_tokens": details.get("cached_tokens")
                if isinstance(details, Mapping) else None,
                "completion_tokens": usage.get("output_tokens")}
    details = usage.get("prompt_tokens_details")
    return {"prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens")
            if isinstance(details, Mapping) else None,
            "completion_tokens": usage.get("completion_tokens")}


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
    - TTFT: ``completionStartTime - startTime``, for streamed requests only: LiteLLM sets
      ``completionStartTime`` to ``endTime`` when the response was not streamed, and its own
      TTFT metric is streaming-only for the same reason. A non-streamed response keeps
      vLLM's own ``metrics`` object (``--enable-per-request-metrics``), whose
      ``time_to_first_token_ms`` is engine-side; LiteLLM drops it from streams.
    - session: the first non-empty of ``SESSION_FIELDS``. ``session_id`` is filled (from the
      ``x-litellm-session-id`` header, ``metadata.session_id`` or ``litellm_session_id``)
      only under ``request_correlation_in_logs: true``; without it, the header and
      ``metadata.session_id`` still reach ``metadata.requester_metadata.session_id``.
      ``trace_id`` is never read: it is a fresh id per call when the client sent none, which
      would make every call a conversation of its own.
    - status: ``status`` ("success" / "failure"); failures count as errors.
    """

    SESSION_FIELDS = (("session_id",), ("metadata", "requester_metadata", "session_id"))

    def __init__(self, caller_fields: Sequence[str]) -> None:
        self.caller_fields = [field.split(".") for field in caller_fields]

    def __call__(self, obj: Any) -> UsageEvent:
        payload = _object(obj)
        caller = _first_text(payload, self.caller_fields)
        usage_object = (get_path(payload, ("metadata", "usage_object"))
                        or get_path(payload, ("hidden_params", "usage_object"))
                        or get_path(payload, ("response", "usage")))
        numbers = usage_numbers(usage_object)
        model = payload.get("model") or payload.get("model_group")
        provider = payload.get("custom_llm_provider")
        if type(model) is str and type(provider) is str and model.startswith(provider + "/"):
            model = model[len(provider) + 1:]  # "hosted_vllm/qwen" is vLLM's "qwen"
        native_form: dict[str, Any] = {
            "caller": caller,
            "model": model,
            "prompt_tokens": payload.get("prompt_tokens", numbers.get("prompt_tokens")),
            "cached_tokens": numbers.get("cached_tokens"),
            "completion_tokens": payload.get("completion_tokens",
                                             numbers.get("completion_tokens")),
            "session": _first_text(payload, self.SESSION_FIELDS),
            "time": payload.get("startTime"),
            "status": payload.get("status"),
        }
        if native_form["prompt_tokens"] is None:
            native_form["prompt_tokens"] = numbers.get("prompt_tokens")
        native_form["ttft_seconds"] = _litellm_ttft(payload)
        return validate(native_form)


def _litellm_ttft(payload: Mapping[str, Any]) -> float | None:
    """Streamed: LiteLLM's first-chunk time; not streamed: vLLM's own per-request TTFT."""
    start, first, end = (payload.get(key) for key in
                         ("startTime", "completionStartTime", "endTime"))
    stream = payload.get("stream")
    if _is_number(start) and _is_number(first) and (
            stream is True or (stream is None and _is_number(end) and first < end)):
        return max(0.0, first - start)
    engine_ttft_ms = get_path(payload, ("response", "metrics", "time_to_first_token_ms"))
    if stream is not True and _is_number(engine_ttft_ms) and engine_ttft_ms >= 0:
        return engine_ttft_ms / 1000.0
    return None


def _first_text(payload: Mapping[str, Any], paths: Sequence[Sequence[str]]) -> Any:
    """The first present, non-empty value of ``paths`` (LiteLLM writes "" for none)."""
    for path in paths:
        value = get_path(payload, path)
        if value not in (None, ""):
            return value
    return None


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


# ---- OpenAI response record ------------------------------------------------------------


class OpenAIFormat:
    """``{"caller", "response", ...timings}`` -> UsageEvent.

    ``response`` is the response body the proxy got from vLLM: a JSON object (a whole
    response, or the final chunk of a stream, the one with ``choices: []`` and the usage),
    or its raw text (JSON, or the SSE stream, in which the last chunk with a usage wins).
    The record's own ``model``, ``ttft_seconds``, ``queue_seconds``, ``session``, ``time``
    and ``status`` keys are taken as they are. Without ``ttft_seconds``, vLLM's per-request
    ``metrics.time_to_first_token_ms`` (``--enable-per-request-metrics``) is used; it is
    already engine-side.
    """

    def __call__(self, obj: Any) -> UsageEvent:
        record = _object(obj)
        response = record.get("response")
        if isinstance(response, (str, bytes)):
            response = _parse_body(response)
        status = record.get("status")
        failed = type(status) in (int, str) and status_is_error(status)
        native_form: dict[str, Any] = {key: record[key] for key in FIELDS if key in record}
        usage = response.get("usage") if isinstance(response, Mapping) else None
        if not isinstance(usage, Mapping):
            if failed:  # a failed request has no usage; it is counted as an error
                return validate(native_form)
            raise InvalidEvent("missing_usage", "the response carries no usage object")
        for key, value in usage_numbers(usage).items():
            native_form.setdefault(key, value)
        if not native_form.get("model"):
            native_form["model"] = response.get("model")
        if "ttft_seconds" not in native_form:
            metrics = response.get("metrics")
            ttft_ms = metrics.get("time_to_first_token_ms") if isinstance(metrics,
                                                                          Mapping) else None
            if _is_number(ttft_ms):
                native_form["ttft_seconds"] = ttft_ms / 1000.0
        return validate(native_form)


def _parse_body(text: str | bytes) -> Any:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    stripped = text.lstrip()
    if stripped.startswith(("data:", "event:", ":")):
        found = None
        for line in stripped.splitlines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if not data or data == "[DONE]":
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                continue
            if isinstance(chunk, Mapping):
                if isinstance(chunk.get("usage"), Mapping):
                    found = chunk
                elif isinstance(chunk.get("response"), Mapping) and isinstance(
                        chunk["response"].get("usage"), Mapping):
                    found = chunk["response"]  # Responses API: response.completed event
        if found is None:
            raise InvalidEvent("missing_usage", "the stream has no chunk with a usage object")
        return found
    try:
        return json.loads(stripped)
    except ValueError:
        raise InvalidEvent("malformed_response", "the response text is not JSON or SSE") from None


# ---- user mapping ----------------------------------------------------------------------


class MappingFormat:
    """Any JSON record, read with a YAML mapping of UsageEvent fields to dotted paths.

    Each field maps to a path (``usage.prompt_tokens``), a list of paths (the first that is
    present wins), or ``{path: ..., scale: 0.001, minus: other.path}`` for values that need
    arithmetic (milliseconds, or a TTFT given as two timestamps).
    """

    def __init__(self, spec: Mapping[str, Any], source: str = "mapping") -> None:
        self.rules: list[tuple[str, list[list[str]], float, list[list[str]]]] = []
        for field, rule in spec.items():
            if field not in FIELDS:
                raise ConfigError(f"{source}: {field}",
                                  f"unknown field (known: {', '.join(FIELDS)})")
            scale, minus = 1.0, []
            if isinstance(rule, Mapping):
                unknown = set(rule) - {"path", "scale", "minus"}
                if unknown or "path" not in rule:
                    raise ConfigError(f"{source}: {field}",
                                      "expected a path, a list of paths, or {path, scale, "
                                      "minus}")
                scale_raw = rule.get("scale", 1.0)
                if isinstance(scale_raw, bool) or not isinstance(scale_raw, (int, float)):
                    raise ConfigError(f"{source}: {field}.scale", "expected a number")
                scale = float(scale_raw)
                minus = self._paths(rule.get("minus", []), f"{source}: {field}.minus")
                rule = rule["path"]
            self.rules.append((field, self._paths(rule, f"{source}: {field}"), scale, minus))
        mapped = {rule[0] for rule in self.rules}
        for required in ("caller", "prompt_tokens"):
            if required not in mapped:
                raise ConfigError(source, f"the mapping must give a path for {required}")

    @staticmethod
    def _paths(rule: Any, where: str) -> list[list[str]]:
        if isinstance(rule, str):
            rule = [rule]
        if not isinstance(rule, list) or not all(isinstance(p, str) and p for p in rule):
            raise ConfigError(where, "expected a dotted path or a list of them")
        return [path.split(".") for path in rule]

    def __call__(self, obj: Any) -> UsageEvent:
        record = _object(obj)
        native_form: dict[str, Any] = {}
        for field, paths, scale, minus in self.rules:
            value = _first(record, paths)
            if value is None:
                continue
            if minus:
                other = _first(record, minus)
                if other is None:
                    continue
                if not (_is_number(value) and _is_number(other)):
                    raise InvalidEvent("not_a_number", f"{field} must be computed from numbers")
                value = value - other
            if scale != 1.0:
                if not _is_number(value):
                    raise InvalidEvent("not_a_number", f"{field} must be a number")
                value = value * scale
                if field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
                    value = round(value)
            native_form[field] = value
        return validate(native_form)


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
        raise ConfigError(where, f"cannot read {path}: {err.strerror}") from None
    except yaml.YAMLError:
        raise ConfigError(where, f"{path} is not valid YAML") from None
    if not isinstance(spec, Mapping):
        raise ConfigError(where, f"{path} must map UsageEvent fields to dotted paths")
    return MappingFormat(spec, source=path)


# ---- registry --------------------------------------------------------------------------


def build_converters(config: Config) -> dict[str, Converter]:
    """Every format usable with this configuration (``mapping`` only with a mapping file)."""
    converters: dict[str, Converter] = {
        "native": native,
        "litellm": LiteLLMFormat(config.usage_litellm_caller_fields),
        "openai": OpenAIFormat(),
    }
    if config.usage_mapping_file:
        converters["mapping"] = load_mapping(config.usage_mapping_file)
    return converters
