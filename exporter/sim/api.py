"""The OpenAI-compatible surface of the simulator, shared by the HTTP front and in-process use.

Request bodies are checked the way vLLM checks them (a clear 400 with vLLM's error shape for
anything unusable) and responses carry vLLM 0.32.0's usage block exactly:
``prompt_tokens_details`` only with ``--enable-prompt-tokens-details`` (else ``null``),
``created_cache_tokens`` only on chat, and in a stream the usage only in a final chunk whose
``choices`` is empty, and only when ``stream_options.include_usage`` asks for it.

With ``enable_per_request_metrics`` they carry vLLM's ``metrics`` object too, computed as
vLLM computes it (``build_per_request_timing_metrics`` in
``vllm/entrypoints/generate/base/serving.py``) from the simulated engine's timestamps:
queued (arrival), scheduled (first admission; a preempted request keeps it), first token,
last token (the finish), in scenario seconds. A whole response has every key, nulls included
(``model_dump()``); a stream's usage chunk only the non-null ones (``exclude_none``).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from exporter.sim.engine import EngineConfig, Finished, Rejected
from exporter.sim.runner import EngineRunner, Handle
from exporter.sim.tokenizer import VOCAB_SIZE, Tokenizer, reply_words

CHAT, COMPLETION = "chat", "completion"
DEFAULT_MAX_TOKENS = 256  # vLLM's default is "the rest of the context"; a sim needs less
FINGERPRINT = "vllm-0.32.0-sim"


class ApiError(Exception):
    """A request vLLM would refuse; ``body()`` is vLLM's error JSON."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": None,
                "code": self.status,
            }
        }


@dataclass(frozen=True)
class SimRequest:
    kind: str
    prompt: tuple[int, ...] | list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    # Where the simulated model ends its answer by itself (None: it writes max_tokens).
    answer_tokens: int | None = None


@dataclass(frozen=True)
class Outcome:
    """A finished request, everything a response needs."""

    request_id: str
    kind: str
    created: int
    prompt_tokens: int
    cached_tokens: int
    created_cache_tokens: int
    completion_tokens: int
    finish_reason: str
    # The engine's timestamps (scenario seconds), for vLLM's per-request metrics.
    queued_at: float
    scheduled_at: float | None
    first_token_at: float | None
    last_token_at: float


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append(part["text"])
            else:
                raise ApiError(400, f"messages[{index}].content: only text parts are supported")
        return " ".join(parts)
    raise ApiError(400, f"messages[{index}].content must be a string or a list of parts")


def _messages(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ApiError(400, f"messages[{index}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"messages[{index}].role must be a string")
        out.append((role, _content_text(message.get("content"), index)))
    return out


def _completion_prompt(
    body: Mapping[str, Any], tokenizer: Tokenizer
) -> list[int] | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if any(t < 0 or t >= VOCAB_SIZE for t in prompt):
            raise ApiError(400, f"token ids must be between 0 and {VOCAB_SIZE - 1}")
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "batched prompts are not supported by the simulator")
    raise ApiError(400, "prompt must be a string or a list of token ids")


def _int_field(body: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if type(value) is not int or value < 1:
            raise ApiError(400, f"{name} must be a positive integer")
        return value
    return None


def parse_request(kind: str, body: Any, tokenizer: Tokenizer, config: EngineConfig) -> SimRequest:
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != config.served_model_name:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    n = body.get("n")
    if n not in (None, 1):
        raise ApiError(400, "the simulator only supports n=1")
    if kind == CHAT:
        prompt: Sequence[int] = tokenizer.chat(_messages(body))
    else:
        prompt = _completion_prompt(body, tokenizer)
    max_tokens = _int_field(body, "max_completion_tokens", "max_tokens")
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, config.context_limit - len(prompt)))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise ApiError(400, "stream_options must be an object")
    if options and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    include_usage = bool(options.get("include_usage", False))
    return SimRequest(
        kind,
        prompt if isinstance(prompt, (list, tuple)) else list(prompt),
        max_tokens,
        stream,
        include_usage,
        _answer_tokens(body),
    )


def _answer_tokens(body: Mapping[str, Any]) -> int | None:
    """``vllm_xargs.answer_tokens``: how long the simulated model's answer is, when it ends
    before ``max_tokens`` (a real model stops on its own; vLLM passes ``vllm_xargs`` through
    to its sampling parameters' extra arguments, which it ignores unless a plugin reads them).
    """
    extra = body.get("vllm_xargs")
    if extra is None:
        return None
    if not isinstance(extra, Mapping):
        raise ApiError(400, "vllm_xargs must be an object")
    return _int_field(extra, "answer_tokens")


class Reply:
    """The words the simulated model answers with: one token each, derived from the prompt."""

    def __init__(self, prompt: Sequence[int], max_tokens: int, tokenizer: Tokenizer) -> None:
        tail = array("I", prompt[-64:]).tobytes()
        seed = zlib.crc32(tail) ^ len(prompt)
        self.words = reply_words(seed, max_tokens).split(" ")
        self.tokens = [token for word in self.words for token in tokenizer.encode(word)]

    def text(self, start: int, end: int) -> str:
        return "".join(" " + word for word in self.words[start:end])


@dataclass
class Running:
    """A request submitted to the engine, as the front sees it."""

    request: SimRequest
    handle: Handle
    reply: Reply
    created: int

    @property
    def request_id(self) -> str:
        return self.handle.request.request_id


class SimService:
    """Parse, submit, await: what both the HTTP front and the in-process client do."""

    def __init__(
        self, runner: EngineRunner, config: EngineConfig, tokenizer: Tokenizer | None = None
    ) -> None:
        self.runner = runner
        self.config = config
        self.tokenizer = tokenizer or Tokenizer()

    @property
    def model(self) -> str:
        return self.config.served_model_name

    def parse(self, kind: str, body: Any) -> SimRequest:
        return parse_request(kind, body, self.tokenizer, self.config)

    def start(self, request: SimRequest) -> Running:
        writes = min(request.max_tokens, request.answer_tokens or request.max_tokens)
        reply = Reply(request.prompt, writes, self.tokenizer)
        prefix = "chatcmpl" if request.kind == CHAT else "cmpl"
        handle = self.runner.submit(
            request.prompt,
            reply.tokens,
            writes,
            self.runner.new_id(prefix),
            declared_max_tokens=request.max_tokens,
        )
        return Running(request, handle, reply, int(time.time()))

    async def first_token(self, running: Running) -> bool:
        """Wait for the first token; False if the request ended without one."""
        handle = running.handle
        await asyncio.wait((handle.first_token, handle.done), return_when=asyncio.FIRST_COMPLETED)
        return handle.first_token.done()

    async def outcome(self, running: Running) -> Outcome:
        """Wait for the end; raises ApiError if the engine refused the request."""
        end = await running.handle.done
        if isinstance(end, Rejected):
            raise ApiError(400, end.message)
        assert isinstance(end, Finished)
        seq = end.seq
        return Outcome(
            seq.request_id,
            running.request.kind,
            running.created,
            seq.prompt_tokens,
            seq.hit_tokens,
            seq.new_cached_tokens,
            seq.generated_tokens,
            end.reason,
            seq.arrival,
            seq.admitted_at,
            seq.first_token_at,
            end.time,
        )

    def abort(self, running: Running) -> None:
        self.runner.abort(running.request_id)

    # ---- response bodies ---------------------------------------------------------------

    def usage(self, outcome: Outcome, stream: bool) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": outcome.prompt_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            "completion_tokens": outcome.completion_tokens,
        }
        details: dict[str, Any] | None = None
        if self.config.enable_prompt_tokens_details:
            details = {"cached_tokens": outcome.cached_tokens}
            if outcome.kind == CHAT:
                details["created_cache_tokens"] = outcome.created_cache_tokens
            elif not stream:
                details["created_cache_tokens"] = None
            if not stream:
                details["multimodal_tokens"] = None
        if details is not None or not stream:
            usage["prompt_tokens_details"] = details
        if not stream:
            usage["completion_tokens_details"] = None
        return usage

    def response(self, running: Running, outcome: Outcome) -> dict[str, Any]:
        """The non-streamed body, with every key vLLM 0.32.0 sends (nulls included), in its
        order."""
        text = running.reply.text(0, outcome.completion_tokens)
        choice: dict[str, Any]
        body: dict[str, Any] = {
            "id": outcome.request_id,
            "object": "chat.completion" if outcome.kind == CHAT else "text_completion",
            "created": outcome.created,
            "model": self.model,
        }
        if outcome.kind == CHAT:
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": outcome.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": outcome.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
        body.update(
            {
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": FINGERPRINT,
                "usage": self.usage(outcome, stream=False),
            }
        )
        if outcome.kind == CHAT:
            body.update({"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None})
        body.update(
            {
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": self.per_request_metrics(outcome),
            }
        )
        return body

    def per_request_metrics(self, outcome: Outcome) -> dict[str, Any] | None:
        """vLLM's ``metrics`` object of a whole response: None without the flag."""
        if not self.config.enable_per_request_metrics:
            return None
        return {**per_request_timings(outcome), "speculative_decoding": None}

    def chunk(
        self,
        running: Running,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
    ) -> dict[str, Any]:
        """One streamed chunk with a choice (``text`` None and role: the opening chunk)."""
        choice: dict[str, Any]
        if running.request.kind == CHAT:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""} if role else {"content": text or ""}
            )
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {
                "index": 0,
                "text": text or "",
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            obj = "text_completion"
        if finish_reason is not None:
            choice["stop_reason"] = None
        return {
            "id": running.request_id,
            "object": obj,
            "created": running.created,
            "model": self.model,
            "choices": [choice],
        }

    def usage_chunk(self, running: Running, outcome: Outcome) -> dict[str, Any]:
        obj = "chat.completion.chunk" if running.request.kind == CHAT else "text_completion"
        chunk = {
            "id": running.request_id,
            "object": obj,
            "created": running.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(outcome, stream=True),
            "system_fingerprint": FINGERPRINT,
        }
        if self.config.enable_per_request_metrics:
            timings = per_request_timings(outcome)
            chunk["metrics"] = {key: value for key, value in timings.items() if value is not None}
        return chunk


def per_request_timings(outcome: Outcome) -> dict[str, float | None]:
    """The five timings of vLLM's PerRequestMetrics, in its key order, each None where vLLM
    would lack a timestamp (vLLM tests a timestamp for > 0, meaning "set": here None)."""
    queued, scheduled = outcome.queued_at, outcome.scheduled_at
    first, last = outcome.first_token_at, outcome.last_token_at
    tokens = outcome.completion_tokens
    ttft = generation = queue = mean_itl = tokens_per_second = None
    if scheduled is not None and first is not None:
        ttft = (first - scheduled) * 1000
    if first is not None:
        generation = (last - first) * 1000
        if tokens > 1:
            mean_itl = (last - first) / (tokens - 1) * 1000
    if scheduled is not None:
        queue = (scheduled - queued) * 1000
        inference_ms = (last - scheduled) * 1000
        if inference_ms > 0:
            tokens_per_second = tokens / inference_ms * 1000
    return {
        "time_to_first_token_ms": ttft,
        "generation_time_ms": generation,
        "queue_time_ms": queue,
        "mean_itl_ms": mean_itl,
        "tokens_per_second": tokens_per_second,
    }
