"""The plain values that flow from the readers to the signals.

Readers (``engine``, ``usage``) produce them; ``signals`` consumes them; neither side imports
the other. This module imports nothing from the rest of the package and does no I/O, so both
sides can depend on it without a cycle (the rule is enforced by tests/test_architecture.py).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

# ---- engine signals ---------------------------------------------------------------------
# The exporter's names for what it reads from vLLM, independent of vLLM's own (renamed
# across releases; see exporter/engine/names.py). Each is a value of the ``signal`` label of
# vllm_cache_engine_metric_present.
PREFIX_CACHE_QUERIES = "prefix_cache_queries"
PREFIX_CACHE_HITS = "prefix_cache_hits"
PREEMPTIONS = "preemptions"
PROMPT_TOKENS = "prompt_tokens"
PROMPT_TOKENS_CACHED = "prompt_tokens_cached"
KV_CACHE_USAGE = "kv_cache_usage"
REQUESTS_RUNNING = "requests_running"
REQUESTS_WAITING = "requests_waiting"
CACHE_CONFIG_INFO = "cache_config_info"
# Where prompt tokens came from: a KV connector's cache (LMCache, offloading, P/D), the split
# of prompt tokens by source, the split of cached tokens by the tier that held them, and the
# waiting requests by why they wait.
EXTERNAL_PREFIX_CACHE_QUERIES = "external_prefix_cache_queries"
EXTERNAL_PREFIX_CACHE_HITS = "external_prefix_cache_hits"
PROMPT_TOKENS_BY_SOURCE = "prompt_tokens_by_source"
PROMPT_TOKENS_CACHED_BY_SOURCE = "prompt_tokens_cached_by_source"
REQUESTS_WAITING_BY_REASON = "requests_waiting_by_reason"
# KV residency: sampled blocks' lifetime, idle time before eviction and gaps between reuses
# (vLLM started with --kv-cache-metrics).
KV_BLOCK_LIFETIME = "kv_block_lifetime"
KV_BLOCK_IDLE_BEFORE_EVICT = "kv_block_idle_before_evict"
KV_BLOCK_REUSE_GAP = "kv_block_reuse_gap"
# Engine-side request phases: where a slow turn spent its time when the cache did hold.
REQUEST_QUEUE_TIME = "request_queue_time"
REQUEST_PREFILL_TIME = "request_prefill_time"
REQUEST_DECODE_TIME = "request_decode_time"
INTER_TOKEN_LATENCY = "inter_token_latency"

# Every engine signal, in exposition order.
ENGINE_SIGNALS = (
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    PREEMPTIONS,
    PROMPT_TOKENS,
    PROMPT_TOKENS_CACHED,
    KV_CACHE_USAGE,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    CACHE_CONFIG_INFO,
    EXTERNAL_PREFIX_CACHE_QUERIES,
    EXTERNAL_PREFIX_CACHE_HITS,
    PROMPT_TOKENS_BY_SOURCE,
    PROMPT_TOKENS_CACHED_BY_SOURCE,
    REQUESTS_WAITING_BY_REASON,
    KV_BLOCK_LIFETIME,
    KV_BLOCK_IDLE_BEFORE_EVICT,
    KV_BLOCK_REUSE_GAP,
    REQUEST_QUEUE_TIME,
    REQUEST_PREFILL_TIME,
    REQUEST_DECODE_TIME,
    INTER_TOKEN_LATENCY,
)
# Engine signals that are counters in vLLM (carried across vLLM restarts by the signals),
# split ones included (each label value is carried on its own).
COUNTER_SIGNALS = frozenset(
    {
        PREFIX_CACHE_QUERIES,
        PREFIX_CACHE_HITS,
        PREEMPTIONS,
        PROMPT_TOKENS,
        PROMPT_TOKENS_CACHED,
        EXTERNAL_PREFIX_CACHE_QUERIES,
        EXTERNAL_PREFIX_CACHE_HITS,
        PROMPT_TOKENS_BY_SOURCE,
        PROMPT_TOKENS_CACHED_BY_SOURCE,
    }
)
# Engine signals that are histograms in vLLM: their buckets, sum and count are counters too,
# carried across restarts together.
HISTOGRAM_SIGNALS = (
    KV_BLOCK_LIFETIME,
    KV_BLOCK_IDLE_BEFORE_EVICT,
    KV_BLOCK_REUSE_GAP,
    REQUEST_QUEUE_TIME,
    REQUEST_PREFILL_TIME,
    REQUEST_DECODE_TIME,
    INTER_TOKEN_LATENCY,
)


@dataclass(frozen=True)
class Split:
    """A vLLM series with one more label than (model_name, engine), whose values vLLM
    enumerates. The label's values come from outside, so only ``known`` ones get a series of
    their own; any other value vLLM sends is summed into ``OTHER_LABEL_VALUE``."""

    label: str
    known: tuple[str, ...]


OTHER_LABEL_VALUE = "other"
SPLITS = {
    PROMPT_TOKENS_BY_SOURCE: Split(
        "source", ("local_compute", "local_cache_hit", "external_kv_transfer")
    ),
    PROMPT_TOKENS_CACHED_BY_SOURCE: Split(
        "source", ("device", "host", "p2p", "disk", "external_unspecified")
    ),
    REQUESTS_WAITING_BY_REASON: Split("reason", ("capacity", "deferred")),
}

# Why a read of a vLLM's /metrics failed: the ``reason`` of its error counter, every one of
# which exists at 0 from the start so that the first failure shows in increase().
# A vLLM sample's largest believed value: 2^53, past which a float no longer holds every whole
# number (a counter's increments of 1 are lost). A vLLM counting a million tokens a second
# reaches it in 285 years; a sample above it is a lie or a bug, dropped and counted as
# invalid (``too_large``), so that no carried total can be pushed towards +Inf.
MAX_SAMPLE_VALUE = float(2**53)
# Why the parser drops a vLLM sample (the ``reason`` of
# vllm_cache_engine_invalid_samples_total; the carrier adds its own to these), and why it
# folds one into ``__other__`` (vllm_cache_engine_samples_folded_total): defined here because
# the parser (exporter/engine/) and the carrier (exporter/signals/) may not import each other.
NOT_FINITE, NEGATIVE, ABOVE_ONE, TOO_LARGE, BAD_HISTOGRAM = (
    "not_finite",
    "negative",
    "above_one",
    "too_large",
    "bad_histogram",
)
PARSE_INVALID_REASONS = (NOT_FINITE, NEGATIVE, ABOVE_ONE, TOO_LARGE, BAD_HISTOGRAM)
TOO_LONG, MODEL_NAME_CAP, ENGINE_CAP, ROW_CAP = (
    "too_long",
    "model_name_cap",
    "engine_cap",
    "row_cap",
)
FOLD_REASONS = (TOO_LONG, MODEL_NAME_CAP, ENGINE_CAP, ROW_CAP)
SCRAPE_ERROR_REASONS = (
    "connect",
    "timeout",
    "http_status",
    "truncated",
    "body_too_large",
    "parse",
    "http_error",
    "internal",
)

# The labels of vllm:cache_config_info the exporter reads (the full set changes per release).
CACHE_CONFIG_KEYS = (
    "block_size",
    "num_gpu_blocks",
    "kv_cache_size_tokens",
    "enable_prefix_caching",
    "prefix_match_unit",
    "mamba_block_size",
    "mamba_cache_mode",
    "cache_dtype",
)


@dataclass(frozen=True)
class CacheConfig:
    """The labels of ``vllm:cache_config_info`` for one engine, read by key."""

    engine: str
    fields: dict[str, str]

    def positive_float(self, key: str) -> float | None:
        """A label read as a positive finite number; None when absent, "None" or not one."""
        raw = self.fields.get(key)
        if raw is None or raw in ("None", ""):
            return None
        try:
            value = float(raw)
        except ValueError:
            return None
        return value if 0 < value < math.inf else None

    def positive(self, key: str) -> int | None:
        """A label read as a positive whole number (a float label is truncated)."""
        value = self.positive_float(key)
        return int(value) if value is not None and value >= 1 else None

    @property
    def block_size(self) -> int | None:
        return self.positive("block_size")

    @property
    def num_gpu_blocks(self) -> int | None:
        return self.positive("num_gpu_blocks")

    @property
    def kv_cache_size_tokens(self) -> int | None:
        return self.positive("kv_cache_size_tokens")

    @property
    def prefix_match_unit(self) -> int | None:
        return self.positive("prefix_match_unit")

    @property
    def enable_prefix_caching(self) -> bool | None:
        raw = self.fields.get("enable_prefix_caching")
        if raw is None:
            return None
        return raw.strip().lower() in ("true", "1")

    @property
    def pool_tokens(self) -> int | None:
        """kv_cache_size_tokens (vLLM >= 0.2x), else num_gpu_blocks x block_size."""
        if self.kv_cache_size_tokens:
            return self.kv_cache_size_tokens
        if self.num_gpu_blocks and self.block_size:
            return self.num_gpu_blocks * self.block_size
        return None


@dataclass(frozen=True)
class HistogramValue:
    """One histogram of one engine: cumulative counts per upper bound (ascending, ``inf``
    last, so the last count is the histogram's count) and the sum of the observations."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float

    @property
    def count(self) -> float:
        return self.cumulative[-1]


@dataclass
class EngineValues:
    """Values of one (model_name, engine) pair of a vLLM, keyed by engine signal name.

    ``splits`` holds the split signals (signal -> label value -> value, see ``SPLITS``),
    ``histograms`` the histogram ones. ``created`` is the ``_created`` time of a counter or
    histogram, ``split_created`` that of each label value of a split counter.
    """

    model_name: str
    engine: str
    values: dict[str, float] = field(default_factory=dict)
    created: dict[str, float] = field(default_factory=dict)
    splits: dict[str, dict[str, float]] = field(default_factory=dict)
    split_created: dict[str, dict[str, float]] = field(default_factory=dict)
    histograms: dict[str, HistogramValue] = field(default_factory=dict)


@dataclass
class EngineSnapshot:
    """One successful read of a vLLM's /metrics, in the exporter's own terms."""

    engines: dict[tuple[str, str], EngineValues]
    cache_configs: dict[str, CacheConfig]  # by engine label
    present: dict[str, bool]  # engine signal name -> exposed by this vLLM
    invalid_samples: int = 0
    lines: int = 0

    def cache_config_for(self, engine: str) -> CacheConfig | None:
        return self.cache_configs.get(engine)


# ---- per-request usage ------------------------------------------------------------------


@dataclass(frozen=True, eq=False, slots=True)
class PromptPrint:
    """A prompt's fingerprint (the tap's, ``exporter.usage.tap.fingerprint``): the keyed
    digest of each of its content-defined blocks, in order, and the byte offset where each
    block ends. Never the text, and never exported: only compared in memory with the prints
    of the same caller's recent requests. ``length`` is the whole prompt's size in bytes
    (the blocks may cover only its beginning)."""

    digests: array  # array("Q"): 64-bit digests
    ends: array  # array("I"): block end offsets, increasing
    length: int

    @property
    def covered(self) -> int:
        """Bytes the blocks cover."""
        return self.ends[-1] if self.ends else 0


# The caller label of what is folded past a cap (``exporter.signals.callers``): no caller may
# name itself so (``exporter.usage.event`` refuses it).
OVERFLOW_LABEL = "__other__"


# Status words that mean the request succeeded; any other word is an error.
OK_STATUS_WORDS = frozenset({"ok", "success", "succeeded", "successful", "2xx", "completed"})


# ---- the usage event: its one schema ------------------------------------------------------
# Every field's name, type and bounds are declared once, on ``UsageEvent``; the bounds ride
# on the types below, so msgspec checks them in C where a reader decodes straight into the
# event (the native format's common line, ``exporter.usage.event.quick_event``), and the
# validation of every other reader (``exporter.usage.event.validate``) reads the same types
# to pick each field's check and its rejection reasons.

# Absurd sizes: no prompt is this large (the longest-context models hold ~10M tokens).
MAX_TOKENS = 10_000_000
# No single request waits or computes for more than a day; larger values are unit mistakes.
MAX_SECONDS = 86_400.0
# Unix time in seconds, up to the year 5138: beyond it a number is no timestamp.
MAX_TIMESTAMP = 1e11
MAX_CALLER_CHARS = 256
MAX_MODEL_CHARS = 256
MAX_SESSION_CHARS = 256
MAX_STATUS_CHARS = 32
# An event id: a UUID is 36 characters, OpenAI's and vLLM's response ids about 40; room for a
# proxy's own prefix in front of one.
MAX_EVENT_ID_CHARS = 128
# No request asks for more sequences of one prompt than this (OpenAI caps n at 128).
MAX_SEQUENCES = 128
# The vLLM replica that served a request, as the reader names it: a base URL (the tap's
# upstream, LiteLLM's api_base) or a name. Room for a URL with a path.
MAX_BACKEND_CHARS = 256

CallerName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CALLER_CHARS)]
ModelName = Annotated[str, msgspec.Meta(max_length=MAX_MODEL_CHARS)]
SessionId = Annotated[str, msgspec.Meta(max_length=MAX_SESSION_CHARS)]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
Timestamp = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TIMESTAMP)]
# An HTTP status (100-599) or a short word; decoded as either, checked in Python.
Status = int | str
Sequences = Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQUENCES)]
EventId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_EVENT_ID_CHARS)]
BackendName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_BACKEND_CHARS)]


class UsageEvent(msgspec.Struct, frozen=True, gc=False):
    """What the proxy knows about one finished request: the one definition of the usage
    event, in the order of the native format's keys (``docs/metrics.md``).

    ``cached_tokens`` is None when the response did not report it (vLLM without
    ``--enable-prompt-tokens-details``, or < 0.24 for a cold request): never read it as 0.
    ``queue_seconds`` is the admission wait at the proxy, included in ``ttft_seconds``.
    ``status`` is an HTTP status (int) or a short word; None means success.
    ``time`` is unix seconds; None means "when it arrived".
    ``engine_ttft_seconds`` and ``engine_queue_seconds`` are vLLM's own measurements of the
    request (its per-request ``metrics``, ``--enable-per-request-metrics``): scheduled to
    first token, and queued to scheduled, inside the engine. They are kept apart from the
    proxy's figures, which include whatever waited in front of and inside vLLM.
    ``max_tokens`` is the completion budget the request declared (``max_tokens`` or
    ``max_completion_tokens``), where the reader sees the request; None when unknown. Set
    against ``completion_tokens`` it shows how far callers overstate what they use.
    ``sequences`` is how many completions of the prompt the request asked for (``n``), where
    the reader knows it; above 1, vLLM's ``cached_tokens`` is one sequence's, which may have
    found the blocks its siblings had just written, so it says nothing of the request's own
    reuse (counted as not reported, classified ``unknown``).
    ``id`` names the request (unique per caller): an event whose (caller, id) was counted
    within the last ``--usage.dedup.window`` is a retried copy, counted once
    (``UsageState.record_events``). None: no id, never taken for a copy.
    ``backend`` is the vLLM replica that served the request, as the reader knows it (the
    tap's upstream URL, LiteLLM's ``api_base``, a gateway's replica name): the per-caller
    counters are also kept per ``target`` from it, labelled as the engine series of the same
    vLLM where the exporter reads it (``UsageState.target_label``). None: not known.

    ``caller``, ``model`` and ``prompt_tokens`` have no default: a line decoded without one
    of them is not the common event, and goes to the validation that knows what it means
    (``model`` is "" when absent, ``prompt_tokens`` is 0 for a failed request and required
    otherwise).
    """

    caller: CallerName
    model: ModelName
    prompt_tokens: Tokens
    cached_tokens: Tokens | None = None
    completion_tokens: Tokens | None = None
    ttft_seconds: Seconds | None = None
    queue_seconds: Seconds | None = None
    session: SessionId | None = None
    time: Timestamp | None = None
    status: Status | None = None
    # ---- vLLM's per-request timings (engine-measured) ----
    engine_ttft_seconds: Seconds | None = None
    engine_queue_seconds: Seconds | None = None
    # ---- foresight (optional; readers fill them where their input has them) ----
    max_tokens: Tokens | None = None
    # ---- how many sequences of the prompt vLLM ran (n) ----
    sequences: Sequences | None = None
    # ---- the request's id, for retried copies (optional) ----
    id: EventId | None = None
    # ---- the vLLM replica that served it (optional) ----
    backend: BackendName | None = None


def status_is_error(status: int | str | None) -> bool:
    """None, 2xx and the words in OK_STATUS_WORDS are successes; everything else failed."""
    if status is None:
        return False
    if type(status) is int:
        return not 200 <= status < 300
    text = str(status)
    if text.isascii() and text.isdigit():
        return not 200 <= int(text) < 300
    return text.lower() not in OK_STATUS_WORDS


class RecentKeys:
    """What was seen lately (event ids, Idempotency-Keys), each with a value: at most
    ``max_keys`` keys, each remembered for at least ``seconds`` unless ``max_keys // 2`` newer
    ones came after it, and for less than twice ``seconds``.

    Two generations of at most ``max_keys // 2`` keys each: new keys go into the current one,
    which becomes the previous one when it is ``seconds`` old or full, and the previous one is
    dropped then. A generation ended by its count while the previous one was younger than
    ``seconds`` forgot that one's keys early: ``forgotten_early`` counts them (raise the cap).
    The time is the caller's (``now``), so tests and the exporter's clock drive it. With
    ``seconds`` infinite, a generation ends only when full (the keys of conversations dropped
    while recent, ``ConversationTracker.forgotten``).
    """

    __slots__ = (
        "generation_keys",
        "seconds",
        "current",
        "previous",
        "started",
        "previous_started",
        "forgotten_early",
    )

    def __init__(self, max_keys: int, seconds: float) -> None:
        self.generation_keys = max(1, max_keys // 2)
        self.seconds = seconds
        self.current: dict[object, object] = {}
        self.previous: dict[object, object] = {}
        self.started = -math.inf  # when the current generation began
        self.previous_started = -math.inf
        self.forgotten_early = 0

    def __len__(self) -> int:
        return len(self.current) + len(self.previous)

    def _turn(self, now: float) -> None:
        """Begin a new generation if the current one is ``seconds`` old (or the clock went
        back by more than that), or full."""
        seconds = self.seconds
        recent = -seconds <= now - self.started < seconds
        if recent and len(self.current) < self.generation_keys:
            return
        if recent and -seconds <= now - self.previous_started < seconds:
            self.forgotten_early += len(self.previous)
        if not -seconds <= now - self.started < 2 * seconds:
            self.current = {}  # nothing of either generation is recent any more
        self.previous, self.current = self.current, {}
        self.previous_started, self.started = self.started, now

    def get(self, key: object, now: float) -> object | None:
        """The value of ``key`` if it was put within the window, else None."""
        if not -self.seconds <= now - self.started < self.seconds:
            self._turn(now)
        value = self.current.get(key)
        return self.previous.get(key) if value is None else value

    def put(self, key: object, value: object, now: float) -> None:
        self._turn(now)
        self.current[key] = value

    def pop(self, key: object) -> None:
        self.current.pop(key, None)
        self.previous.pop(key, None)

    def seen(self, key: object, now: float) -> bool:
        """Whether ``key`` was seen within the window; remembered from now if not."""
        if not -self.seconds <= now - self.started < self.seconds:
            self._turn(now)
        if key in self.current or key in self.previous:
            return True
        if len(self.current) >= self.generation_keys:
            self._turn(now)
        self.current[key] = True
        return False
