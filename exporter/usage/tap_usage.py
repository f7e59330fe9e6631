"""What the tap reads out of vLLM's OpenAI-compatible bodies: usage, model, first content.

Three response shapes carry the numbers (see /v1 docs and docs/metrics.md):
chat and completions put them in ``usage`` (``prompt_tokens``, ``completion_tokens``,
``prompt_tokens_details.cached_tokens``, the details only with
``--enable-prompt-tokens-details``); the Responses API puts them in ``usage`` of the response
object (``input_tokens``, ``output_tokens``, ``input_tokens_details.cached_tokens``). A
missing or null ``cached_tokens`` means "not reported", never 0.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Endpoint(enum.Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"


ENDPOINTS = {endpoint.value: endpoint for endpoint in Endpoint}
# Endpoints whose stream carries usage only when asked via stream_options.include_usage.
USAGE_OPT_IN = (Endpoint.CHAT, Endpoint.COMPLETIONS)


class BadUsage(ValueError):
    """A usage object is present but its numbers are unusable (reason is a counter label)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int | None
    cached_tokens: int | None  # None: the server did not report it


def _count(value: Any, required: bool) -> int | None:
    """A token count; failures use the reasons of ``exporter.usage.event`` where they exist."""
    if value is None:
        if required:
            raise BadUsage("missing_prompt_tokens")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadUsage("not_a_number")
    if value < 0:
        raise BadUsage("negative")
    return value


def parse_usage(usage: Any) -> Usage | None:
    """Either usage shape -> Usage; None when there is no usage object at all."""
    if not isinstance(usage, dict):
        return None
    if "input_tokens" in usage or "input_tokens_details" in usage:
        prompt_key, completion_key, details_key = (
            "input_tokens", "output_tokens", "input_tokens_details")
    else:
        prompt_key, completion_key, details_key = (
            "prompt_tokens", "completion_tokens", "prompt_tokens_details")
    prompt = _count(usage.get(prompt_key), required=True)
    completion = _count(usage.get(completion_key), required=False)
    details = usage.get(details_key)
    cached = None
    if isinstance(details, dict):
        cached = _count(details.get("cached_tokens"), required=False)
    assert prompt is not None
    if cached is not None and cached > prompt:
        raise BadUsage("cached_exceeds_prompt")
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


def usage_of(obj: Any) -> tuple[Usage | None, str | None]:
    """(usage, model) of a whole response body or of one stream event's JSON."""
    if not isinstance(obj, dict):
        return None, None
    response = obj.get("response")
    if isinstance(response, dict) and "usage" in response:  # Responses API stream event
        obj = response
    model = obj.get("model")
    return parse_usage(obj.get("usage")), model if isinstance(model, str) else None


def is_usage_only_chunk(obj: Any) -> bool:
    """The final ``choices: []`` chunk that include_usage adds to a chat/completion stream."""
    return (isinstance(obj, dict) and obj.get("choices") == []
            and isinstance(obj.get("usage"), dict))


def _non_empty(value: Any) -> bool:
    return bool(value) if isinstance(value, (str, list, dict)) else False


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
            if isinstance(delta, dict) and any(
                    _non_empty(delta.get(key))
                    for key in ("content", "reasoning_content", "reasoning", "tool_calls")):
                return True
        return False
    event_type = obj.get("type")  # Responses API: response.output_text.delta etc.
    return (isinstance(event_type, str) and event_type.endswith(".delta")
            and _non_empty(obj.get("delta")))


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
