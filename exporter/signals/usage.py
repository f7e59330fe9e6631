"""Per-caller usage state: the counters and histograms behind the per-caller series.

Readers hand in validated ``UsageEvent``s (``record``) or report what they could not use
(``reject``); the collector in ``exporter.metrics.usage`` renders what is here. Nothing here
does I/O; the only clock read is the injected ``clock``, for the "last event" gauge.

Memory is bounded whatever the senders do: caller and model label values are capped
(``LabelCap``), the conversations (whose previous turn the classifier consults) are an LRU of
``--signals.conversations-max`` entries, and rejection reasons are a closed set per reader.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import urlsplit

from exporter.signals.callers import (
    DEFAULT_CALLERS,
    DEFAULT_DETAILED,
    DEFAULT_MAX_SERIES,
    DEFAULT_MODEL_PATTERN,
    DEFAULT_NAME_PATTERN,
    DEFAULT_TARGETS,
    OTHER,
    LabelCap,
    NamePolicy,
    RankedSet,
)
from exporter.signals.classify import (
    CACHING_OFF,
    CAUSES,
    COLD,
    ERROR,
    EVICTED,
    GRANULE,
    STATES,
    WARM,
    classify,
    miss,
)
from exporter.signals.engine import EngineState
from exporter.signals.foresight import ConversationTracker, ForesightSettings
from exporter.signals.granularity import GranularityLearner
from exporter.signals.history import CALLER_FIELDS, DEFAULT_WINDOWS, FIELD, History, Windows
from exporter.signals.kvpool import granule
from exporter.signals.order import DEFAULT_WINDOW_SECONDS, OrderTracker
from exporter.values import (
    MAX_MODEL_CHARS,
    PREEMPTIONS,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    PROMPT_TOKENS,
    PROMPT_TOKENS_CACHED,
    REQUEST_PREFILL_TIME,
    CacheConfig,
    PromptPrint,
    RecentKeys,
    UsageEvent,
    status_is_error,
)

_T = TypeVar("_T")
# Who measured a TTFT or a queue wait: vLLM itself (its per-request metrics) or the proxy in
# front of it. The ``source`` label of both histograms: the two never share a series.
ENGINE, PROXY = "engine", "proxy"
TIMING_SOURCES = (ENGINE, PROXY)
# Engine-side time to first token: 50 ms (a warm short turn) to 10 min (a cold 180k prompt
# on one consumer card read at ~300 tokens/s).
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Waits before the prompt is read (the proxy's admission gate, vLLM's scheduler queue):
# mostly zero, minutes when a long request holds the card.
QUEUE_BUCKETS = (
    0.005,
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
# Completion tokens used by requests that declared a max_tokens: a short tool call (tens) to
# a long answer (a full 131k window); ~1.5x steps where callers' medians and p99s land.
COMPLETION_BUCKETS = (
    64.0,
    128.0,
    256.0,
    512.0,
    768.0,
    1024.0,
    1536.0,
    2048.0,
    4096.0,
    8192.0,
    12288.0,
    16384.0,
    32768.0,
    65536.0,
    131072.0,
)
# Distinct model label values; models are named by the operator, so this is only a guard.
MAX_MODELS = 32
OVERFLOW_PAIR = (OTHER, OTHER)
# Why POST /v1/usage refuses a request as a whole (its reply's "error").
INGEST_REFUSALS = (
    "unauthorized",
    "body_too_large",
    "bad_body",
    "bad_format",
    "overloaded",
    "abandoned",
    "body_too_slow",
    "bad_content_encoding",
    "unsupported_content_encoding",
    "duplicate",
    "in_progress",
    "bad_idempotency_key",
)
# Event ids (per caller) remembered to count a retried event once, and for how long at least
# (``RecentKeys``; --usage.dedup.max-ids, --usage.dedup.window). Each is kept as the 64-bit
# hash of (caller, id): about 90 bytes, 9 MB at the cap. POST /v1/usage's Idempotency-Keys
# are a tenth as many (a batch holds many events).
DEFAULT_MAX_IDS = 100_000
DEFAULT_ID_WINDOW_SECONDS = 600.0
BATCH_KEYS_PER_ID = 10
# Why an event's timings were left out while the event itself counted (its tokens, its
# state): ``queue_exceeds_ttft``, a proxy admission wait longer than the TTFT it is part of
# by more than TIMING_SLACK_SECONDS (one of the two is wrong, and which cannot be told).
TIMING_DROP_REASONS = ("queue_exceeds_ttft",)
# Two readings of one proxy's clocks, rounded to the millisecond each, can put the wait a
# few ms past the TTFT of a turn whose engine part is too short to measure: up to this much
# it counts as such a turn (TTFT 0), beyond it as inconsistent.
TIMING_SLACK_SECONDS = 0.01
# Raw (caller, model) pairs memoized to their series (cleared when full).
PAIR_MEMO_MAX = 10_000
# Distinct (reader, reason) pairs counted; reasons come from code, this guards the tap's.
MAX_REJECT_KEYS = 256
# What the series budget (--callers.max-series) charges, as each series appears. Every
# (caller, model) pair has the requests counter per state and three token counters: what its
# hit ratio and warm share are computed from (SERIES_PER_CALLER, 9). The costly families come
# on top only for a detailed caller (--callers.allow, and the --callers.detailed of smallest
# rank), each when its first observation arrives: per timing source a TTFT histogram per
# timed state (errors are not timed) and a queue-wait histogram; the completion-tokens-used
# histogram with the declared-completion-tokens counter; the four prompt-order counters (tap
# only); the missed prompt tokens and requests by cause (MISS_SERIES, with the pair's first
# successful event). The other callers' observations of those go to caller="__other__" of
# their model. SERIES_PER_PAIR is a detailed pair's worst case.
TIMED_STATES = tuple(state for state in STATES if state != ERROR)
SERIES_PER_CALLER = len(STATES) + 3
TTFT_SERIES = len(TTFT_BUCKETS) + 3
QUEUE_SERIES = len(QUEUE_BUCKETS) + 3
COMPLETION_SERIES = len(COMPLETION_BUCKETS) + 3 + 1
ORDER_SERIES = 4
MISS_SERIES = 2 * len(CAUSES)
SERIES_PER_PAIR = (
    SERIES_PER_CALLER
    + len(TIMING_SOURCES) * (len(TIMED_STATES) * TTFT_SERIES + QUEUE_SERIES)
    + COMPLETION_SERIES
    + ORDER_SERIES
    + MISS_SERIES
)
# Per (caller, model) and vLLM target, the two counters of the hit ratio (prompt and cached
# tokens): charged to the series budget as each target of a pair appears.
TARGET_SERIES = 2
# A target label made of a backend name: at most this long, else __other__ (a URL's label is
# its origin and METRICS_PATH, or the engine target's own label).
MAX_TARGET_CHARS = 128
METRICS_PATH = "/metrics"
# Backends memoized to their target label (cleared when full).
BACKEND_MEMO_MAX = 4096
DEFAULT_PORTS = {"http": 80, "https": 443}
# An evicted caller's series are still shown this long (two scrapes at a one-minute
# interval), with their last counts, before they go: nothing counted is lost to Prometheus.
RETIRE_SECONDS = 120.0
# The status page's history keeps the detailed callers' pairs (and __other__'s) on up to
# this many models each (signals/history.py: about 38 KB a pair).
HISTORY_MODELS = 3

# Where each source's TTFT starts in a row of ``caller_totals`` (warm sum, count, cold sum,
# count; a row has no time field).
_ENGINE_TTFT = FIELD["ttft_engine_warm_sum"] - 1
_PROXY_TTFT = FIELD["ttft_proxy_warm_sum"] - 1
_EVICTED = FIELD["evicted_tokens"] - 1

SOURCE_CONFIGURED = "configured"
SOURCE_LEARNED = "learned"
SOURCE_BLOCK_SIZE = "block_size"
SOURCE_NONE = "none"


class Histogram:
    """Per-bucket (non-cumulative) counts plus the sum; the collector accumulates."""

    __slots__ = ("bounds", "counts", "total", "shown_from")

    def __init__(self, bounds: tuple[float, ...], shown_from: float = 0.0) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot: above the largest bound (+Inf)
        self.total = 0.0
        self.shown_from = shown_from  # before this time it is exposed at zero

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value


class Series:
    """Everything counted for one (caller, model) label pair."""

    __slots__ = (
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "unreported_prompt_tokens",
        "ttft",
        "queue",
        "engine_ttft",
        "engine_queue",
        "reported_cached",
        "shown_from",
        "completion",
        "declared_completion_tokens",
        "completion_largest",
        "declared_largest",
        "first_seen",
        "followups",
        "followups_cold",
        "order",
        "miss",
        "charged",
        "fallback",
        "key",
        "targets",
    )

    def __init__(
        self, shown_from: float = 0.0, first_seen: float = 0.0, fallback: str | None = None
    ) -> None:
        self.requests = dict.fromkeys(STATES, 0)
        self.prompt_tokens = 0  # only events that reported cached tokens
        self.cached_tokens = 0
        self.unreported_prompt_tokens = 0
        # Proxy-measured (the proxy's TTFT minus its admission wait; that wait), and
        # engine-measured (vLLM's per-request metrics): by state, created on first use.
        self.ttft: dict[str, Histogram] = {}
        self.queue: Histogram | None = None
        self.engine_ttft: dict[str, Histogram] = {}
        self.engine_queue: Histogram | None = None
        self.reported_cached = False  # has an event of this pair ever carried cached_tokens
        # Before this time the pair is exposed with every counter at zero (see UsageState).
        self.shown_from = shown_from
        # foresight: completion tokens used by requests that declared max_tokens, and the sum
        # of what they declared (created with the first such request).
        self.completion: Histogram | None = None
        self.declared_completion_tokens = 0
        # the most completion tokens one such request used, and the largest max_tokens one
        # declared (for the status page, never exposed): no quantile it shows exceeds them
        self.completion_largest = 0
        self.declared_largest = 0
        # For the status page (never exposed): when the pair first sent anything, and its
        # follow-up turns (a conversation's later turns, which should find the earlier one
        # cached), and how many of those came back cold (the cache lost the conversation).
        self.first_seen = first_seen
        self.followups = 0
        self.followups_cold = 0
        # prompt order: created with the pair's first request compared with a recent one
        self.order: OrderCounts | None = None
        # why its prompt tokens missed the cache: created with its first successful event
        self.miss: MissCounts | None = None
        # Series of the budget this pair holds (SERIES_PER_CALLER, then its histograms).
        self.charged = 0
        # Where the costly families' observations go when the budget has no room for its
        # own: caller="__other__" of this model label (None for that pair itself).
        self.fallback = fallback
        self.key: tuple[str, str] | None = None  # its (caller, model) labels
        # target label -> the pair's prompt and cached tokens served by that vLLM (events
        # with a backend only), each entry charged TARGET_SERIES
        self.targets: dict[str, TargetCounts] = {}


class TargetCounts:
    """One (caller, model) pair's hit-ratio counters on one vLLM target: the prompt tokens of
    its events that reported cached tokens, and those cached tokens."""

    __slots__ = ("prompt_tokens", "cached_tokens", "shown_from")

    def __init__(self, shown_from: float) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.shown_from = shown_from  # before this time it is exposed at zero


class OrderCounts:
    """One pair's prompt-order counters (signals/order.py), in bytes of the prompt as sent."""

    __slots__ = (
        "compared",
        "variable_top",
        "shared_bytes",
        "first_difference_bytes",
        "last_variable_top",
        "shown_from",
    )

    def __init__(self, shown_from: float) -> None:
        self.compared = 0  # requests compared with a recent one of the pair
        self.variable_top = 0  # of those, sharing most of their text but not its beginning
        self.shared_bytes = 0  # summed over the variable_top ones
        self.first_difference_bytes = 0  # idem
        self.last_variable_top: float | None = None  # when the latest one was seen
        self.shown_from = shown_from


class MissCounts:
    """One pair's prompt tokens not served from the cache, and its successful requests, by
    cause (``classify.miss``): every cause exposed from the pair's first successful event."""

    __slots__ = ("tokens", "requests", "shown_from")

    def __init__(self, shown_from: float) -> None:
        self.tokens = dict.fromkeys(CAUSES, 0)
        self.requests = dict.fromkeys(CAUSES, 0)
        self.shown_from = shown_from  # before this time it is exposed at zero


@dataclass(frozen=True)
class UsageSettings:
    """How per-caller usage is labelled and classified (the callers.* and signals.* flags)."""

    callers_max: int = DEFAULT_CALLERS
    # Callers (by rank, besides callers_allow) whose costly families are their own.
    callers_detailed: int = DEFAULT_DETAILED
    callers_allow: Sequence[str] = ()
    callers_alias: Mapping[str, str] = field(default_factory=dict)
    granularity: int = 0  # 0: learn it, else vLLM's block size
    warm_tail_granules: float = 2.0
    missing_cached_as_zero: bool = True
    # Readers whose event counter exists (at 0) before their first event, so an alert can
    # tell "never sent anything" from "not configured".
    readers: Sequence[str] = ("http",)
    # Most per-caller series (each charged as it appears); events of pairs beyond it are
    # counted under caller "__other__" (and model "__other__").
    max_series: int = DEFAULT_MAX_SERIES
    # Most distinct target labels of the per-target counters (the engine targets read
    # included); later backends are counted under target "__other__".
    targets_max: int = DEFAULT_TARGETS
    # Names that may be labels as they are; anything else becomes its hash (callers.py).
    name_pattern: str = DEFAULT_NAME_PATTERN
    model_pattern: str = DEFAULT_MODEL_PATTERN
    keep_emails: bool = False
    # A new series is exposed at zero for this long before its counts show, so that every
    # Prometheus scraping it (an HA pair too) sees it start from zero and rate() counts its
    # first increments. At least the longest scrape interval; 0 shows counts at once.
    new_series_hold: float = 0.0
    # Live conversations and the admission budget (signals/foresight.py).
    foresight: ForesightSettings = field(default_factory=ForesightSettings)
    # Requests compared for prompt order are those within this many seconds (signals/order.py).
    prompt_order_window: float = DEFAULT_WINDOW_SECONDS
    # Event ids and Idempotency-Keys remembered, and for how long at least (RecentKeys).
    dedup_max_ids: int = DEFAULT_MAX_IDS
    dedup_window: float = DEFAULT_ID_WINDOW_SECONDS
    # The alerts' short, long and baseline windows, which the status page reads its history
    # over (the monitoring config's).
    windows: Windows = DEFAULT_WINDOWS


class UsageState:
    def __init__(
        self,
        settings: UsageSettings,
        engine: EngineState | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self._clock = clock
        self.callers = LabelCap(
            settings.callers_max,
            settings.callers_allow,
            dict(settings.callers_alias),
            policy=NamePolicy(settings.name_pattern, settings.keep_emails),
            ranked=True,
            on_evict=self._forget_caller,
        )
        # The callers whose costly families are their own: the allowed ones and, of the
        # others, the callers_detailed of smallest rank (callers.RankedSet).
        self.detailed = RankedSet(settings.callers_detailed)
        self.detailed_allow = frozenset(self.callers.allow)
        self.models = LabelCap(
            MAX_MODELS,
            policy=NamePolicy(
                settings.model_pattern, max_chars=MAX_MODEL_CHARS, what="--callers.model-pattern"
            ),
        )
        self.learner = GranularityLearner()
        self.configured_granularity = settings.granularity
        self.warm_tail_granules = settings.warm_tail_granules
        self.missing_cached_as_zero = settings.missing_cached_as_zero
        self.series: dict[tuple[str, str], Series] = {}
        self.events: dict[str, int] = {}
        self.last_event_time: dict[str, float] = {}
        self.rejected: dict[tuple[str, str], int] = {}
        # Whole requests refused, by reason: every reason exists at 0 from the start.
        self.ingest_requests_rejected: dict[str, int] = dict.fromkeys(INGEST_REFUSALS, 0)
        self._model_names: dict[str, str] = {}  # model label -> a raw name, for block size
        # raw (caller, model) -> (its series, the series its costly families go to (None:
        # __other__ of the model, created when first needed), model label, overflowed,
        # folded)
        self._pairs: dict[tuple[str, str], tuple[Series, Series | None, str, bool, bool]] = {}
        # The series budget and what the pairs hold of it (Series.charged, summed); the
        # __other__ pairs (one per model, one for the overflowing models) always have room.
        self.max_series = settings.max_series
        self.exposed = 0
        # The pairs with any costly family (a detailed caller's, __other__'s): what the
        # completion and prompt-order collectors walk, a few hundred of the many thousand.
        self.costly: dict[tuple[str, str], Series] = {}
        self.series_folded = 0  # events counted under __other__ because of the budget
        # Evicted callers' series (whole: True) or costly families (False) still shown, until
        # when (``_retire``); at most the evictions of RETIRE_SECONDS.
        self._retiring: dict[tuple[str, str], tuple[float, bool]] = {}
        self._next_retire = math.inf
        self.retired = 0  # costly families let go so far (UsageCollector's kept lines)
        self.new_series_hold = settings.new_series_hold
        self.conversations = ConversationTracker(settings.foresight)
        self.order = OrderTracker(settings.prompt_order_window)
        # The event the tap's prompt-order step last found variable-top (``record_prompt``,
        # which runs just before the event is recorded): its miss cause is ``order``.
        self._variable_top: UsageEvent | None = None
        # The alerts' windows, for the status page (signals/history.py): a timeline per pair
        # of a detailed caller or __other__, on up to HISTORY_MODELS models each.
        self.history = History(
            (min(settings.callers_detailed, settings.callers_max) + len(self.detailed_allow) + 1)
            * HISTORY_MODELS,
            settings.windows,
        )
        # (reader, reason) -> time from which its rejection counter shows (as for series).
        self.rejected_shown_from: dict[tuple[str, str], float] = {}
        # Retried copies: the (caller, id) of events counted lately, and the Idempotency-Keys
        # of POST /v1/usage batches (the ingest's, which it keeps here to be exported).
        self.event_ids = RecentKeys(settings.dedup_max_ids, settings.dedup_window)
        self.batch_keys = RecentKeys(
            max(2, settings.dedup_max_ids // BATCH_KEYS_PER_ID), settings.dedup_window
        )
        # (reader, reason) -> events whose timings were left out (TIMING_DROP_REASONS).
        self.timings_dropped: dict[tuple[str, str], int] = {}
        # Per-target counters: the target labels admitted (the engine targets this exporter
        # reads first, by origin, so that a caller's target joins the engine's series),
        # each backend's label once resolved, and the events counted under target __other__.
        self.targets_max = settings.targets_max
        # (origin, base path) -> the engine target's label, and origin -> it where only one
        # engine target has that origin (``target_label``).
        self._engine_labels: dict[tuple[str, str], str] = {}
        by_origin: dict[str, list[str]] = {}
        if engine is not None:
            for target in engine.targets.values():
                endpoint = url_endpoint(target.target)
                if endpoint is not None:
                    self._engine_labels.setdefault(endpoint, target.shown)
                    by_origin.setdefault(endpoint[0], []).append(target.shown)
        self._engine_origins = {o: shown[0] for o, shown in by_origin.items() if len(shown) == 1}
        self.target_labels: dict[str, None] = dict.fromkeys(self._engine_labels.values())
        self._engine_label_set = frozenset(self.target_labels)
        self._backends: dict[str, tuple[str, bool]] = {}  # backend -> (label, overflowed)
        self.targets_overflowed = 0
        for reader in settings.readers:
            self.events[reader] = 0

    # ---- readers' side ----------------------------------------------------------------

    def record(self, event: UsageEvent, reader: str) -> str:
        """Count one accepted event; return the state it was classified as ("duplicate"
        for a copy, not counted again)."""
        state = self.record_events((event,), reader)
        return "duplicate" if state is None else state  # None: a copy of a counted one

    def record_events(self, events: Sequence[UsageEvent], reader: str) -> str | None:
        """Count accepted events, each once and in their order; return the last one's state
        (``_record``)."""
        return self._record(events, reader)[0]

    def record_batch(self, events: Sequence[UsageEvent], reader: str) -> int:
        """``record_events``, returning how many of the events were retried copies, which
        were not counted again: an event whose (caller, id) was counted within the window
        (``event_ids``) is counted only as rejected, reason ``duplicate`` (so it is never
        taken for a follow-up turn of its own conversation)."""
        return self._record(events, reader)[1]

    def _record(self, events: Sequence[UsageEvent], reader: str) -> tuple[str | None, int]:
        """Count accepted events, each once and in their order: (the last one's state, how
        many were copies, ``record_batch``).

        Each event in its steps: its series, whether it failed, what it reported cached (and
        what that teaches the granularity learner), its conversation's previous turn, its
        state (``classify``), why what it did not find cached missed (``miss``: counted in
        the pair's own miss counters if detailed, else __other__'s), then the counts, the
        timings, the conversation kept with its
        latest turn and the completion budget it declared. A body's events come here
        together, so what does not depend on the event is done once (the clock read, the
        history's slot check, the reader's counters, the lookups of the steps). The events of
        one call are counted as of one clock reading: the call runs without yielding, so
        nothing can observe the state between two of them. Order still matters within the
        call (a session's previous prompt, the granularity learner), and is kept.
        """
        if not events:
            return None, 0
        now = self._clock()
        if self.history.next_due <= now < math.inf:  # a slot boundary passed: keep the
            self.sample_history(now)  # totals at it (never for a clock gone wrong)
        if self._next_retire <= now:
            self._retire(now)
        pairs_get = self._pairs.get
        resolve_pair = self._pair
        reported = self._reported
        learned_get = self.learner.learned_by_model.get
        configured = self.configured_granularity
        warm_tail = self.warm_tail_granules
        conversations_pop = self.conversations.by_key.pop
        recall = self.conversations.recall
        keep = self.conversations.keep
        check_history = self.conversations.check_history
        observe = self._observe
        seen = self.event_ids.seen
        backends_get = self._backends.get
        engine_labels = self._engine_label_set
        other = self._other
        caching_off = self._caching_off
        caching_off_by_model: dict[str, bool] = {}
        flagged = self._variable_top  # the tap's last request, if its prompt order was
        if flagged is not None:  # variable-top: consumed by this call (record_prompt)
            self._variable_top = None
        duplicates = 0
        state = ERROR
        for event in events:
            caller, model_name = event.caller, event.model
            event_id = event.id
            if event_id is not None and seen(hash((caller, event_id)), now):
                duplicates += 1
                continue
            pair = pairs_get((caller, model_name))
            if pair is None:
                pair = resolve_pair(caller, model_name)
            series, detail, model, overflowed, folded = pair
            if overflowed:
                self.callers.overflowed += 1
            if folded:
                self.series_folded += 1
            status = event.status
            if (
                status is not None
                and (type(status) is not int or not 200 <= status < 300)
                and status_is_error(status)
            ):
                series.requests[ERROR] += 1
                state = ERROR
                continue
            cached = reported(event, series, model)
            key = hash((caller, model_name, event.session))  # the conversation's
            conversation = conversations_pop(key, None)
            previous = conversation.prompt_tokens if conversation is not None else None
            prompt_tokens = event.prompt_tokens
            granule = configured or learned_get(model) or self._classifying_granularity(model)
            recalled = conversation is None and recall(key, now)
            # Whether its previous turn here is its own: not without a session (one key per
            # caller), nor once the bound dropped it, nor with turns another exporter saw.
            untold = recalled or event.session is None
            if recalled:  # dropped by the bound while recent: its previous turn is lost, so
                state = classify(prompt_tokens, None, granule)  # unknown (short: still short)
            else:
                state = classify(prompt_tokens, cached, granule, previous, warm_tail)
                # turns whose earlier ones another exporter saw
                if cached is not None and check_history(conversation, model, cached, granule):
                    untold = True
            series.requests[state] += 1
            # Why what was not cached missed (classify.miss); caching off outranks the rest.
            granule_tokens, avoidable, cause = miss(
                prompt_tokens, cached, granule, previous, False, event is flagged, untold
            )
            if avoidable and cached is not None:
                off = caching_off_by_model.get(model)
                if off is None:  # read once a call: the engine does not change during it
                    off = caching_off_by_model[model] = caching_off(model)
                if off:
                    cause = CACHING_OFF
            owner = detail if detail is not None else other(model)
            counts = owner.miss
            if counts is None:
                counts = self._new_miss(owner)
            if granule_tokens:
                counts.tokens[GRANULE] += granule_tokens
            if avoidable:
                counts.tokens[cause] += avoidable
                counts.requests[cause] += 1
            else:
                counts.requests[GRANULE] += 1
            if previous is not None and previous < prompt_tokens:
                series.followups += 1
                if state == COLD:
                    series.followups_cold += 1
            backend = event.backend
            resolved = None
            if backend is not None:
                resolved = backends_get(backend) or self._resolve_backend(backend)
            if cached is None:
                series.unreported_prompt_tokens += prompt_tokens
            else:
                series.prompt_tokens += prompt_tokens
                series.cached_tokens += cached
                if resolved is not None:
                    self._count_target(series, resolved, prompt_tokens, cached)
            observe(detail, state, event, reader, model)
            # the engine target read here that served the turn: where its context now lives
            served_by = None
            if resolved is not None and resolved[0] in engine_labels:
                served_by = resolved[0]
            keep(key, conversation, event, model, now, recalled, served_by)
        if duplicates:
            self.reject(reader, "duplicate", duplicates)
        return self._counted(reader, len(events) - duplicates, now, state), duplicates

    def _count_target(
        self, series: Series, resolved: tuple[str, bool], prompt_tokens: int, cached: int
    ) -> None:
        """Count a reported event's tokens on the vLLM target that served it (its backend
        ``_resolve_backend``d: label, overflowed), in the pair's entry for that target; a new
        entry is charged TARGET_SERIES while the budget has room, else the tokens go to
        __other__'s entry (of the pair's model) for the target."""
        label, overflowed = resolved
        if overflowed:
            self.targets_overflowed += 1
        counts = series.targets.get(label)
        if counts is None:
            owner = self._room(series, TARGET_SERIES)
            counts = owner.targets.get(label)
            if counts is None:
                counts = owner.targets[label] = TargetCounts(self._shown_from())
                owner.charged += TARGET_SERIES
                self.exposed += TARGET_SERIES
        counts.prompt_tokens += prompt_tokens
        counts.cached_tokens += cached

    def target_label(self, backend: str) -> str:
        """The ``target`` label of a backend: the label of the engine target this exporter
        reads at the same endpoint (so the per-caller and the engine series join on it),
        else the URL's origin, base path and ``/metrics`` (the label the exporter would give
        that vLLM), else the name as given.

        The endpoint is the origin and the path before the OpenAI API's (``/v1...``) or
        ``/metrics``: replicas behind one address told apart by path (``/replica-3/v1``)
        stay apart. A backend whose origin only one engine target has takes that target's
        label whatever its path; a label longer than MAX_TARGET_CHARS is the origin's."""
        endpoint = url_endpoint(backend)
        if endpoint is None:
            return backend
        engine_label = self._engine_labels.get(endpoint)
        if engine_label is None:
            engine_label = self._engine_origins.get(endpoint[0])
        if engine_label is not None:
            return engine_label
        origin, base = endpoint
        label = origin + base + METRICS_PATH
        return label if len(label) <= MAX_TARGET_CHARS else origin + METRICS_PATH

    def _resolve_backend(self, backend: str) -> tuple[str, bool]:
        """(label, overflowed): ``target_label``, admitted while fewer than ``targets_max``
        labels are and it is at most MAX_TARGET_CHARS long, else __other__; memoized."""
        label = self.target_label(backend)
        admitted = self.target_labels
        overflowed = False
        if label == OTHER:  # a backend naming itself so is counted as folded there
            overflowed = True
        elif label not in admitted:
            if len(label) <= MAX_TARGET_CHARS and len(admitted) < self.targets_max:
                admitted[label] = None
            else:
                label, overflowed = OTHER, True
        if len(self._backends) >= BACKEND_MEMO_MAX:
            self._backends.clear()
        resolved = self._backends[backend] = (label, overflowed)
        return resolved

    def _counted(self, reader: str, count: int, now: float, state: str) -> str | None:
        """The reader's counters after ``count`` events counted (the last one's ``state``;
        None when there were none: a call of copies only)."""
        if not count:
            return None
        self.events[reader] = self.events.get(reader, 0) + count
        self.last_event_time[reader] = now
        return state

    def _reported(self, event: UsageEvent, series: Series, model: str) -> int | None:
        """The cached count the event is judged and counted by (None: not reported), and
        what it teaches the granularity learner.

        A request of several sequences (n > 1) reports one sequence's count, perhaps of its
        siblings' blocks: nothing of its own reuse, and nothing to learn from. A missing
        count from a pair that has reported counts before is 0 (what vLLM before 0.24
        meant), unless ``--no-signals.missing-cached-as-zero``."""
        cached = event.cached_tokens
        sequences = event.sequences
        if sequences is not None and sequences > 1:
            return None
        if cached is None:
            return 0 if self.missing_cached_as_zero and series.reported_cached else None
        series.reported_cached = True
        self.learner.observe(model, cached)
        return cached

    def _classifying_granularity(self, model: str) -> int:
        """G to classify this model's request with where neither configured nor learned:
        vLLM's block size, else a provisional one bounded by the counts seen so far."""
        granularity = self.granularity(model)[0]
        if granularity == 1:
            granularity = self.learner.provisional(model)
        return granularity

    def _observe(
        self, series: Series | None, state: str, event: UsageEvent, reader: str, model: str
    ) -> None:
        """The TTFT (vLLM's own where it sent one, else the proxy's less its admission
        wait) by state, each queue's wait, and what the turn used of the completion budget
        it declared. (``Histogram.observe``, inlined: this runs for every event.)

        A proxy wait longer than the proxy TTFT it is part of (by more than
        TIMING_SLACK_SECONDS) leaves both out, counted in ``timings_dropped``: one of them is
        wrong and which cannot be told, while the event's tokens and state are sound, so the
        event counts (refusing it would lose those for a timing).
        """
        queue = event.queue_seconds
        proxy_ttft = event.ttft_seconds
        if (
            queue is not None
            and proxy_ttft is not None
            and queue > proxy_ttft + TIMING_SLACK_SECONDS
        ):
            key = (reader, "queue_exceeds_ttft")
            self.timings_dropped[key] = self.timings_dropped.get(key, 0) + 1
            queue = proxy_ttft = None
        ttft = event.engine_ttft_seconds
        if series is None:  # not a detailed caller: its costly families are __other__'s
            if (
                ttft is None
                and proxy_ttft is None
                and queue is None
                and event.engine_queue_seconds is None
                and (event.max_tokens is None or event.completion_tokens is None)
            ):
                return
            series = self._other(model)
        if ttft is not None:
            # vLLM's own: from scheduling to the first token, no wait in it. The proxy's
            # figure of the same request is not counted a second time.
            hist = series.engine_ttft.get(state) or self._new_ttft(series, ENGINE, state)
        else:
            ttft = proxy_ttft
            if ttft is None:
                hist = None
            else:
                if queue is not None:
                    # Within TIMING_SLACK_SECONDS a wait longer than the TTFT means the
                    # engine part was too short to measure, not negative.
                    ttft = ttft - queue if ttft > queue else 0.0
                hist = series.ttft.get(state) or self._new_ttft(series, PROXY, state)
        if hist is not None and ttft is not None:
            hist.counts[bisect_left(hist.bounds, ttft)] += 1
            hist.total += ttft
        if queue is not None:
            hist = series.queue or self._new_queue(series, PROXY)
            hist.counts[bisect_left(hist.bounds, queue)] += 1
            hist.total += queue
        engine_queue = event.engine_queue_seconds
        if engine_queue is not None:
            # A second queue, after the proxy's: a request can wait in both.
            hist = series.engine_queue or self._new_queue(series, ENGINE)
            hist.counts[bisect_left(hist.bounds, engine_queue)] += 1
            hist.total += engine_queue
        completion = event.completion_tokens
        if event.max_tokens is not None and completion is not None:
            if series.completion is None:
                series = self._room(series, COMPLETION_SERIES)
                if series.completion is None:
                    series.completion = Histogram(COMPLETION_BUCKETS, self._shown_from())
                    self._charge(series, COMPLETION_SERIES)
            series.completion.observe(completion)
            series.declared_completion_tokens += event.max_tokens
            if completion > series.completion_largest:
                series.completion_largest = completion
            if event.max_tokens > series.declared_largest:
                series.declared_largest = event.max_tokens

    def _room(self, series: Series, cost: int) -> Series:
        """The series a new histogram (``cost`` series) of ``series`` is created in: itself
        while the budget has room; else its fallback (__other__ of its model, which always
        has room), whose histogram may already exist. Whoever creates it ``_charge``s."""
        fallback = series.fallback
        if fallback is not None and self.exposed + cost > self.max_series:
            self.series_folded += 1
            return self._other(fallback)
        return series

    def _charge(self, series: Series, cost: int) -> None:
        series.charged += cost
        self.exposed += cost
        if series.key is not None:
            self.costly[series.key] = series

    def _new_ttft(self, series: Series, source: str, state: str) -> Histogram:
        owner = self._room(series, TTFT_SERIES)
        by_state = owner.engine_ttft if source == ENGINE else owner.ttft
        hist = by_state.get(state)
        if hist is None:
            hist = by_state[state] = Histogram(TTFT_BUCKETS, self._shown_from())
            self._charge(owner, TTFT_SERIES)
        return hist

    def _new_queue(self, series: Series, source: str) -> Histogram:
        owner = self._room(series, QUEUE_SERIES)
        hist = owner.engine_queue if source == ENGINE else owner.queue
        if hist is None:
            hist = Histogram(QUEUE_BUCKETS, self._shown_from())
            self._charge(owner, QUEUE_SERIES)
            if source == ENGINE:
                owner.engine_queue = hist
            else:
                owner.queue = hist
        return hist

    def _new_miss(self, series: Series) -> MissCounts:
        """The pair's miss counters, created with its first successful event (every cause
        at 0 from then on, so that rate() reads 0, not "no data"): its own while the budget
        has room, else __other__'s of its model."""
        owner = self._room(series, MISS_SERIES)
        counts = owner.miss
        if counts is None:
            counts = owner.miss = MissCounts(self._shown_from())
            self._charge(owner, MISS_SERIES)
        return counts

    def _caching_off(self, model_label: str) -> bool:
        """Whether the engine serving this model reports prefix caching disabled
        (vllm:cache_config_info enable_prefix_caching), matched as ``_engine_config``
        matches. Read only for a request that missed something avoidable."""
        enabled = self._engine_config(
            self._model_names.get(model_label, model_label),
            lambda config: config.enable_prefix_caching,
        )
        return enabled is False

    def record_prompt(self, event: UsageEvent, prompt: PromptPrint) -> None:
        """A successful call's prompt order: its prompt's fingerprint (the tap's), compared
        with the pair's recent ones. The tap hands it just before ``record``ing the call, so
        that a variable-top request's avoidable miss is counted as ``order`` (the counters of
        prompt order are the same either way)."""
        pair = self._pairs.get((event.caller, event.model))
        if pair is None:
            pair = self._pair(event.caller, event.model)
        variable_top = self._order(event, prompt, pair[0], pair[1], pair[2], self._clock())
        self._variable_top = event if variable_top else None

    def _order(
        self,
        event: UsageEvent,
        prompt: PromptPrint,
        series: Series,
        detail: Series | None,
        model: str,
        now: float,
    ) -> bool:
        """Compare the request's prompt with the pair's recent ones (the tap's prints), and
        count what was found in ``detail`` (the pair's own counters, or __other__'s): whether
        it shares most of its text with a recent one but not its beginning."""
        when = event.time if event.time is not None else now
        found = self.order.observe(series, prompt, when)  # one key per label pair
        if found is None:
            return False
        if detail is None:
            detail = self._other(model)
        counts = detail.order
        if counts is None:
            detail = self._room(detail, ORDER_SERIES)
            counts = detail.order
            if counts is None:
                counts = detail.order = OrderCounts(self._shown_from())
                self._charge(detail, ORDER_SERIES)
        counts.compared += 1
        if found.variable_top:
            counts.variable_top += 1
            counts.shared_bytes += found.shared_bytes
            counts.first_difference_bytes += found.first_difference_bytes
            counts.last_variable_top = when
            return True
        return False

    def _pair(self, caller: str, model_name: str) -> tuple[Series, Series | None, str, bool, bool]:
        """Resolve a raw (caller, model) to its series and the series its costly families go
        to, through the label caps and the budget, and memoize.

        The memo is bounded like the caps' own, and cleared when a caller is evicted from
        either ranked set; an overflowed caller is memoized as such so that each of its
        events is still counted in ``callers_overflowed``.
        """
        before = self.callers.overflowed
        caller_label = self.callers.label(caller)
        overflowed = self.callers.overflowed != before
        self.callers.overflowed = before  # record() counts it, for memo hits and misses alike
        model = self.models.label(model_name)
        key, folded = self._within_budget((caller_label, model))
        caller_label, model = key
        series = self.series.get(key)
        if series is None:
            series = self._new_series(key)
            self._model_names.setdefault(model, model_name)
        detail = series if self._is_detailed(caller_label) else None
        if len(self._pairs) >= PAIR_MEMO_MAX:
            self._pairs.clear()
        pair = self._pairs[(caller, model_name)] = (series, detail, model, overflowed, folded)
        return pair

    def _new_series(self, key: tuple[str, str]) -> Series:
        fallback = None if key[0] == OTHER else key[1]
        series = self.series[key] = Series(self._shown_from(), self._clock(), fallback)
        series.key = key
        series.charged = SERIES_PER_CALLER
        self.exposed += SERIES_PER_CALLER
        return series

    def _other(self, model: str) -> Series:
        """The (__other__, model) series, created on first use: it has room whatever the
        budget (one per model label, MAX_MODELS + 1 in all)."""
        series = self.series.get((OTHER, model))
        return series if series is not None else self._new_series((OTHER, model))

    def _is_detailed(self, caller: str) -> bool:
        """Whether the caller's costly families are its own: allowed, __other__, or among
        the detailed callers (offered here, which may evict one: ``_undetail``)."""
        if caller == OTHER or caller in self.detailed_allow:
            return True
        admitted, evicted = self.detailed.offer(caller)
        if evicted is not None:
            self._undetail(evicted)
        return admitted

    def _within_budget(self, key: tuple[str, str]) -> tuple[tuple[str, str], bool]:
        """The pair a new (caller, model) is counted under: itself while the series budget
        has room for its SERIES_PER_CALLER series, else (__other__, model)."""
        if key in self.series or key[0] == OTHER:
            return key, False
        if self.exposed + SERIES_PER_CALLER <= self.max_series:
            return key, False
        return (OTHER, key[1]), True

    def _undetail(self, caller: str) -> None:
        """A caller left the detailed set: its later observations go to __other__, and its
        own histograms stay as they are until RETIRE_SECONDS have passed (so Prometheus
        scrapes what they counted last), then go (``_retire``)."""
        self._pairs.clear()
        deadline = self._clock() + RETIRE_SECONDS
        for key in self.series:
            if key[0] == caller:
                self._retiring.setdefault(key, (deadline, False))
        self._next_retire = min(self._next_retire, deadline)
        self.history.forget(lambda key: key[0] == caller)

    def _forget_caller(self, caller: str) -> None:
        """The caller cap evicted a caller (a caller of smaller rank came): its later events
        count under __other__, and its series stay as they are until RETIRE_SECONDS have
        passed (so Prometheus scrapes what they counted last), then go (``_retire``)."""
        self._pairs.clear()
        self.detailed.discard(caller)
        deadline = self._clock() + RETIRE_SECONDS
        for key in self.series:
            if key[0] == caller:
                self._retiring[key] = (deadline, True)
        self._next_retire = min(self._next_retire, deadline)
        self.history.forget(lambda key: key[0] == caller)

    def _retire(self, now: float) -> None:
        """Let the series (or only the costly families) of evicted callers go once their
        time has come; a caller let back in meanwhile keeps them."""
        due = [key for key, (deadline, _whole) in self._retiring.items() if deadline <= now]
        for key in due:
            _deadline, whole = self._retiring.pop(key)
            series = self.series.get(key)
            if series is None:
                continue
            caller = key[0]
            if whole and caller not in self.callers.admitted and caller not in self.callers.allow:
                self.exposed -= self.series.pop(key).charged
                self.costly.pop(key, None)
            elif not whole and caller not in self.detailed and caller not in self.detailed_allow:
                kept = SERIES_PER_CALLER + TARGET_SERIES * len(series.targets)
                self.exposed -= series.charged - kept
                series.charged = kept
                series.ttft, series.engine_ttft = {}, {}
                series.queue = series.engine_queue = series.completion = None
                series.declared_completion_tokens = 0
                series.order = None
                series.miss = None
                self.costly.pop(key, None)
                self.retired += 1  # the collector's kept lines of it are stale
        self._next_retire = min(
            (deadline for deadline, _whole in self._retiring.values()), default=math.inf
        )

    def reject(self, reader: str, reason: str, count: int = 1) -> None:
        """Count events a reader could not use (one by default), by a short machine
        reason."""
        key = (reader, reason)
        if key not in self.rejected:
            if len(self.rejected) >= MAX_REJECT_KEYS:
                key = (reader, "other")
            if key not in self.rejected:
                self.rejected_shown_from[key] = self._shown_from()
        self.rejected[key] = self.rejected.get(key, 0) + count

    # ---- the last hour, for the status page ------------------------------------------------

    def pair_totals(self) -> dict[tuple[str, str], list[float]]:
        """Cumulative totals per (caller, model) pair, without the time, in
        ``history.CALLER_FIELDS`` order: what the status page shows and the history keeps."""
        totals: dict[tuple[str, str], list[float]] = {}
        width = len(CALLER_FIELDS) - 1
        for pair, series in self.tracked_series():
            row = totals[pair] = [0.0] * width
            requests = series.requests
            row[0] = series.prompt_tokens
            row[1] = series.cached_tokens
            row[2] = series.unreported_prompt_tokens
            for index, state in enumerate(STATES, start=3):
                row[index] = requests[state]
            row[9] = series.followups
            row[10] = series.followups_cold
            for offset, timed in ((_ENGINE_TTFT, series.engine_ttft), (_PROXY_TTFT, series.ttft)):
                for at, state in ((offset, WARM), (offset + 2, COLD)):
                    hist = timed.get(state)
                    if hist is not None:
                        row[at] += hist.total
                        row[at + 1] += sum(hist.counts)
            if series.miss is not None:
                row[_EVICTED] = series.miss.tokens[EVICTED]
        return totals

    def caller_totals(self) -> dict[str, list[float]]:
        """``pair_totals`` summed over each caller's models."""
        totals: dict[str, list[float]] = {}
        for (caller, _model), values in self.pair_totals().items():
            row = totals.get(caller)
            if row is None:
                totals[caller] = list(values)
            else:
                for index, value in enumerate(values):
                    row[index] += value
        return totals

    def first_seen(self) -> dict[tuple[str, str], float]:
        """When each tracked (caller, model) pair first sent anything."""
        return {pair: series.first_seen for pair, series in self.tracked_series()}

    def tracked_series(self) -> Iterator[tuple[tuple[str, str], Series]]:
        """The pairs the status page keeps a history of: those of the detailed callers
        (allowed or ranked) and of __other__ (the page answers for them; Prometheus for all)."""
        detailed, allow = self.detailed.members, self.detailed_allow
        for pair, series in self.series.items():
            caller = pair[0]
            if caller in detailed or caller in allow or caller == OTHER:
                yield pair, series

    def catch_up(self, now: float) -> None:
        """Sample the history if a slot boundary passed: call before anything changes the
        totals (an engine read; ``record`` does it itself) and before reading the history."""
        if self.history.due(now):
            self.sample_history(now)

    def sample_history(self, now: float) -> None:
        """Keep the totals as they stand, as those at the last slot boundary (the caller
        makes sure nothing changed since it: see signals/history.py)."""
        self.history.record(
            now, self.pair_totals(), self.target_totals(), self.first_seen(), self.model_totals()
        )

    def target_totals(self) -> dict[str, list[float]]:
        """Per vLLM target (as shown): preemptions, prefix-cache queries and hits, summed
        over its engines, in ``history.TARGET_FIELDS`` order without the time."""
        totals: dict[str, list[float]] = {}
        if self.engine is None:
            return totals
        for target in self.engine.targets.values():
            row = totals[target.shown] = [0.0, 0.0, 0.0]
            for engine_row in target.rows:
                counters = engine_row.counters
                row[0] += counters.get(PREEMPTIONS, 0.0)
                row[1] += counters.get(PREFIX_CACHE_QUERIES, 0.0)
                row[2] += counters.get(PREFIX_CACHE_HITS, 0.0)
        return totals

    def model_totals(self) -> dict[str, list[float]]:
        """Per vLLM model_name, summed over the targets' engines serving it: the prompt
        tokens they computed (prompt tokens less prompt_tokens_cached, of the engines that
        report both) and the seconds their requests spent in prefill (the prefill-time
        histogram's sum), in ``history.MODEL_FIELDS`` order without the time: the model's
        measured prefill rate (signals/prefill.py), as the rules sum it."""
        totals: dict[str, list[float]] = {}
        if self.engine is None:
            return totals
        for target in self.engine.targets.values():
            for engine_row in target.rows:
                counters = engine_row.counters
                prompt = counters.get(PROMPT_TOKENS)
                cached = counters.get(PROMPT_TOKENS_CACHED)
                prefill = engine_row.histograms.get(REQUEST_PREFILL_TIME)
                if prefill is None and (prompt is None or cached is None):
                    continue
                row = totals.setdefault(engine_row.model_name, [0.0, 0.0])
                if prompt is not None and cached is not None:
                    row[0] += prompt - cached
                if prefill is not None:
                    row[1] += prefill.sum
        return totals

    # ---- what Prometheus may see ----------------------------------------------------------

    def _shown_from(self) -> float:
        return self._clock() + self.new_series_hold if self.new_series_hold else 0.0

    def now(self) -> float:
        """The injected clock, for the collector deciding which series still show zero."""
        return self._clock()

    def reject_request(self, reason: str) -> None:
        """Count one POST /v1/usage refused as a whole (unauthorized, too large, ...)."""
        self.ingest_requests_rejected[reason] = self.ingest_requests_rejected.get(reason, 0) + 1

    # ---- granularity ------------------------------------------------------------------

    def granularity(self, model_label: str) -> tuple[int, str]:
        """(G, source) for a model: configured, else learned, else vLLM's block size, else 1."""
        if self.configured_granularity:
            return self.configured_granularity, SOURCE_CONFIGURED
        learned = self.learner.learned(model_label)
        if learned:
            return learned, SOURCE_LEARNED
        block = self._engine_block_size(self._model_names.get(model_label, model_label))
        if block:
            return block, SOURCE_BLOCK_SIZE
        return 1, SOURCE_NONE

    def _engine_block_size(self, model: str) -> int | None:
        """The granule of the engine serving ``model`` (``kvpool.granule``: the hit alignment
        vLLM reports, else its block size; on a hybrid model the block size), matched as
        ``_engine_config`` matches."""
        return self._engine_config(model, _positive_granule)

    def _engine_config(self, model: str, read: Callable[[CacheConfig], _T | None]) -> _T | None:
        """What ``read`` finds in the cache config of the engine serving ``model`` (None:
        nothing there). Matched on vLLM's model_name; when the engines serve a single
        model, it is used whatever the proxy calls it (a LiteLLM alias, say)."""
        if self.engine is None:
            return None
        fallback: _T | None = None
        served: set[str] = set()
        for target in self.engine.targets.values():
            for row in target.rows:
                config = row.cache_config
                if config is None:
                    continue
                found = read(config)
                if found is None:
                    continue
                if row.model_name == model:
                    return found
                if row.model_name:
                    served.add(row.model_name)
                fallback = found
        return fallback if len(served) <= 1 else None

    def granularities(self) -> list[tuple[str, int, str]]:
        """(model label, G, source) for every model seen, where G is known."""
        out = []
        for model in sorted({model for _, model in self.series}):
            value, source = self.granularity(model)
            if source != SOURCE_NONE:
                out.append((model, value, source))
        return out

    @property
    def callers_overflowed(self) -> int:
        return self.callers.overflowed


def _positive_granule(config: CacheConfig) -> int | None:
    unit = granule(config)
    return unit if unit and unit > 0 else None


def url_endpoint(url: str) -> tuple[str, str] | None:
    """(``url_origin``, base path) of a vLLM URL: the path up to the OpenAI API's (``/v1``,
    ``/v1/chat/completions``) or ``/metrics``, without a trailing slash; query and fragment
    dropped. ``http://h:8000``, ``http://h:8000/v1`` and ``http://h:8000/metrics`` are one
    endpoint, ``http://h/replica-3/v1`` another than ``http://h/replica-4``. None for a text
    that is no URL with a host."""
    origin = url_origin(url)
    if origin is None:
        return None
    path = urlsplit(url.strip()).path.rstrip("/")
    cut = path.find("/v1/")
    if cut >= 0:
        path = path[:cut]
    elif path.endswith("/v1"):
        path = path[:-3]
    elif path.endswith(METRICS_PATH):
        path = path[: -len(METRICS_PATH)]
    return origin, path.rstrip("/")


def url_origin(url: str) -> str | None:
    """``scheme://host[:port]`` of a URL, as the exporter labels a vLLM target
    (``config.metrics_url``): scheme and host lower-cased, the scheme's default port dropped;
    no credentials, path, query or fragment. None for a text that is no URL with a host."""
    if "://" not in url:
        return None
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:  # a port out of range, a bracket unclosed
        return None
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if not scheme or not host:
        return None
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port is None or port == DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    return f"{scheme}://{netloc}"
