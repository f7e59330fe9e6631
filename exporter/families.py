"""Every series the exporter serves, defined once: name, type, labels, HELP, unit.

The collectors (``exporter/metrics/``, ``exporter/limits.py``, ``exporter/web/metrics.py``)
build their families from these entries, the rule and dashboard generators
(``exporter/monitoring/``) name series through them, and docs/metrics.md has one row per
entry (``tests/test_families.py`` checks both directions, and that every series a rule, alert
or panel reads is one of these, a recorded series, or one Prometheus or client_python adds).

A name is the family's name as client_python writes it: counters without ``_total``
(``Family.total`` adds it), histograms without ``_bucket``/``_count``/``_sum``. ``unit`` is
the OpenMetrics ``# UNIT``; no family declares one today (adding one changes the
OpenMetrics body). Per-caller families also name the ``Series`` attribute they count
(``field``): the per-caller collector renders every ``PER_CALLER_COUNTERS`` entry from it, so
a new per-caller counter is this table, its recording step in ``exporter/signals/usage.py``
and its docs row.

Public contract: later work may add entries, never rename these.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from exporter import values

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"
TYPES = (COUNTER, GAUGE, HISTOGRAM)

# The labels most families share: a vLLM engine row, and a (caller, model) pair.
ROW = ("target", "model_name", "engine")
CALLER = ("caller", "model")


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    labels: tuple[str, ...]
    help: str
    unit: str = ""
    field: str = ""  # per-caller counters: the exporter.signals.usage.Series attribute

    @property
    def total(self) -> str:
        """A counter's sample name (``<name>_total``)."""
        assert self.type == COUNTER, self.name
        return self.name + "_total"

    @property
    def series(self) -> str:
        """The sample name a selector reads: ``_total`` for a counter, the name for a gauge."""
        return self.total if self.type == COUNTER else self.name

    @property
    def bucket(self) -> str:
        assert self.type == HISTOGRAM, self.name
        return self.name + "_bucket"

    @property
    def count(self) -> str:
        assert self.type == HISTOGRAM, self.name
        return self.name + "_count"

    @property
    def sum(self) -> str:
        assert self.type == HISTOGRAM, self.name
        return self.name + "_sum"

    def sample_names(self) -> tuple[str, ...]:
        """Every sample name the family serves."""
        if self.type == HISTOGRAM:
            return (self.bucket, self.count, self.sum)
        return (self.series,)


def counter(family: Family, help_text: str = "") -> CounterMetricFamily:
    """An empty family to add samples to (``help_text``: when the HELP is a template)."""
    assert family.type == COUNTER, family.name
    return CounterMetricFamily(
        family.name, help_text or family.help, labels=list(family.labels), unit=family.unit
    )


def gauge(family: Family, help_text: str = "") -> GaugeMetricFamily:
    assert family.type == GAUGE, family.name
    return GaugeMetricFamily(
        family.name, help_text or family.help, labels=list(family.labels), unit=family.unit
    )


def histogram(family: Family) -> HistogramMetricFamily:
    assert family.type == HISTOGRAM, family.name
    return HistogramMetricFamily(
        family.name, family.help, labels=list(family.labels), unit=family.unit
    )


# --- the exporter itself (exporter/metrics/self.py)
EXPORTER_BUILD_INFO = Family(
    "vllm_cache_exporter_build_info",
    GAUGE,
    ("version",),
    "A metric with a constant '1' value labelled by the exporter's version.",
)

# --- read from vLLM (exporter/metrics/engine.py)
ENGINE_UP = Family(
    "vllm_cache_engine_up",
    GAUGE,
    ("target",),
    "1 if the last read of this vLLM's /metrics succeeded, else 0.",
)
ENGINE_SCRAPE_DURATION_SECONDS = Family(
    "vllm_cache_engine_scrape_duration_seconds",
    GAUGE,
    ("target",),
    "Seconds the last read of this vLLM's /metrics took, failed or not.",
)
ENGINE_SCRAPE_ERRORS = Family(
    "vllm_cache_engine_scrape_errors",
    COUNTER,
    ("target", "reason"),
    "Failed reads of a vLLM /metrics, by reason (connect, timeout, http_status, truncated, "
    "body_too_large, parse, http_error, internal).",
)
ENGINE_RESTARTS = Family(
    "vllm_cache_engine_restarts",
    COUNTER,
    ("target",),
    "vLLM restarts the exporter saw (a newer _created time, or, without one, counters of two "
    "families falling, or of the only one that moved).",
)
ENGINE_INVALID_SAMPLES = Family(
    "vllm_cache_engine_invalid_samples",
    COUNTER,
    ("target", "reason"),
    "vLLM samples dropped, by reason: an impossible value (not_finite, negative, above_one, "
    "too_large: above 2^53, bad_histogram), or a reading not believed (implausible_increase, "
    "fell_without_restart, created_went_back).",
)
ENGINE_SAMPLES_FOLDED = Family(
    "vllm_cache_engine_samples_folded",
    COUNTER,
    ("target", "reason"),
    'vLLM samples counted under model_name or engine "__other__", by reason: too_long (a '
    "label value over 128 characters; a cache_config_info value that long is shown as "
    "__other__), model_name_cap (past 4 values), engine_cap (past 32), row_cap (past 32 "
    "(model_name, engine) rows).",
)
ENGINE_METRIC_PRESENT = Family(
    "vllm_cache_engine_metric_present",
    GAUGE,
    ("target", "signal"),
    "1 if this vLLM exposes the metric behind a signal under any known name, 0 if not (then"
    " that signal's series is absent, never a made-up 0).",
)
ENGINE_PREFIX_CACHING_ENABLED = Family(
    "vllm_cache_engine_prefix_caching_enabled",
    GAUGE,
    ROW,
    "1 if vLLM runs with prefix caching on (vllm:cache_config_info enable_prefix_caching), else 0.",
)
ENGINE_CACHE_CONFIG_INFO = Family(
    "vllm_cache_engine_cache_config_info",
    GAUGE,
    (*ROW, *values.CACHE_CONFIG_KEYS),
    "vLLM's cache configuration (allow-listed labels of vllm:cache_config_info; 'None' "
    "where vLLM reports none, absent keys empty). Always 1.",
)
ENGINE_BLOCK_SIZE_TOKENS = Family(
    "vllm_cache_engine_block_size_tokens",
    GAUGE,
    ROW,
    "vLLM's KV-cache block size in tokens (vllm:cache_config_info block_size).",
)
ENGINE_KV_POOL_TOKENS = Family(
    "vllm_cache_engine_kv_pool_tokens",
    GAUGE,
    ROW,
    "Tokens the KV-cache pool holds (kv_cache_size_tokens, else num_gpu_blocks x "
    "block_size, from vllm:cache_config_info).",
)
ENGINE_KV_USAGE_RATIO = Family(
    "vllm_cache_engine_kv_usage_ratio",
    GAUGE,
    ROW,
    "Fraction of the KV-cache pool in use, 0 to 1 (vllm:kv_cache_usage_perc, "
    "vllm:gpu_cache_usage_perc before 0.9.2).",
)
ENGINE_KV_USED_TOKENS = Family(
    "vllm_cache_engine_kv_used_tokens",
    GAUGE,
    ROW,
    "Tokens of the KV-cache pool in use: kv_usage_ratio x kv_pool_tokens.",
)
ENGINE_REQUESTS_RUNNING = Family(
    "vllm_cache_engine_requests_running",
    GAUGE,
    ROW,
    "Requests in vLLM's running batch (vllm:num_requests_running).",
)
ENGINE_REQUESTS_WAITING = Family(
    "vllm_cache_engine_requests_waiting",
    GAUGE,
    ROW,
    "Requests waiting in vLLM (vllm:num_requests_waiting).",
)
ENGINE_PREFIX_CACHE_QUERIES_TOKENS = Family(
    "vllm_cache_engine_prefix_cache_queries_tokens",
    COUNTER,
    ROW,
    "Prompt tokens vLLM looked up in its local prefix cache "
    "(vllm:prefix_cache_queries_total, vllm:gpu_prefix_cache_queries_total before 0.9.2), "
    "carried across vLLM restarts.",
)
ENGINE_PREFIX_CACHE_HITS_TOKENS = Family(
    "vllm_cache_engine_prefix_cache_hits_tokens",
    COUNTER,
    ROW,
    "Prompt tokens vLLM found in its local prefix cache (vllm:prefix_cache_hits_total, "
    "vllm:gpu_prefix_cache_hits_total before 0.9.2), carried across vLLM restarts.",
)
ENGINE_PREEMPTIONS = Family(
    "vllm_cache_engine_preemptions",
    COUNTER,
    ROW,
    "Preemption events in vLLM (vllm:num_preemptions_total), carried across vLLM restarts.",
)
ENGINE_PROMPT_TOKENS = Family(
    "vllm_cache_engine_prompt_tokens",
    COUNTER,
    ROW,
    "Prompt tokens whose prefill completed, cached ones included (vllm:prompt_tokens_total).",
)
ENGINE_PROMPT_TOKENS_CACHED = Family(
    "vllm_cache_engine_prompt_tokens_cached",
    COUNTER,
    ROW,
    "Prompt tokens served from a cache, local or external (vllm:prompt_tokens_cached_total,"
    " else the cache sources of vllm:prompt_tokens_by_source_total; vLLM >= 0.16).",
)
ENGINE_EXTERNAL_PREFIX_CACHE_QUERIES_TOKENS = Family(
    "vllm_cache_engine_external_prefix_cache_queries_tokens",
    COUNTER,
    ROW,
    "Prompt tokens vLLM looked up in a KV connector's cache (LMCache, offloading, P/D) "
    "after the local prefix cache (vllm:external_prefix_cache_queries_total; vLLM >= "
    "0.11.1), carried across vLLM restarts.",
)
ENGINE_EXTERNAL_PREFIX_CACHE_HITS_TOKENS = Family(
    "vllm_cache_engine_external_prefix_cache_hits_tokens",
    COUNTER,
    ROW,
    "Prompt tokens a KV connector supplied from its cache "
    "(vllm:external_prefix_cache_hits_total; vLLM >= 0.11.1), carried across vLLM restarts.",
)
ENGINE_PROMPT_TOKENS_BY_SOURCE = Family(
    "vllm_cache_engine_prompt_tokens_by_source",
    COUNTER,
    (*ROW, "source"),
    "Prompt tokens whose prefill completed, by where their KV came from: source is "
    "local_compute, local_cache_hit, external_kv_transfer or other "
    "(vllm:prompt_tokens_by_source_total; vLLM >= 0.16), carried across vLLM restarts.",
)
ENGINE_PROMPT_TOKENS_CACHED_BY_SOURCE = Family(
    "vllm_cache_engine_prompt_tokens_cached_by_source",
    COUNTER,
    (*ROW, "source"),
    "Cached prompt tokens by the cache tier that held them, counted at admission: source is"
    " device, host, p2p, disk, external_unspecified or other "
    "(vllm:prompt_tokens_cached_by_source_total; vLLM >= 0.32), carried across vLLM "
    "restarts.",
)
ENGINE_REQUESTS_WAITING_BY_REASON = Family(
    "vllm_cache_engine_requests_waiting_by_reason",
    GAUGE,
    (*ROW, "reason"),
    "Requests waiting in vLLM by reason: capacity (for KV or batch room), deferred (LoRA "
    "budget, KV transfer, blocked), other (vllm:num_requests_waiting_by_reason; vLLM >= "
    "0.20).",
)
ENGINE_KV_BLOCK_LIFETIME_SECONDS = Family(
    "vllm_cache_engine_kv_block_lifetime_seconds",
    HISTOGRAM,
    ROW,
    "Sampled KV blocks' time from allocation to eviction (vllm:kv_block_lifetime_seconds; "
    "vLLM started with --kv-cache-metrics), carried across vLLM restarts.",
)
ENGINE_KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS = Family(
    "vllm_cache_engine_kv_block_idle_before_evict_seconds",
    HISTOGRAM,
    ROW,
    "Sampled KV blocks' time since their last use when evicted "
    "(vllm:kv_block_idle_before_evict_seconds; vLLM started with --kv-cache-metrics), "
    "carried across vLLM restarts.",
)
ENGINE_KV_BLOCK_REUSE_GAP_SECONDS = Family(
    "vllm_cache_engine_kv_block_reuse_gap_seconds",
    HISTOGRAM,
    ROW,
    "Gaps between consecutive prefix-cache hits on a sampled KV block, observed when it is "
    "evicted, its last 3 gaps at most (vllm:kv_block_reuse_gap_seconds; vLLM started with "
    "--kv-cache-metrics), carried across vLLM restarts.",
)
ENGINE_REQUEST_QUEUE_TIME_SECONDS = Family(
    "vllm_cache_engine_request_queue_time_seconds",
    HISTOGRAM,
    ROW,
    "Finished requests' time waiting in vLLM's queue before first scheduled "
    "(vllm:request_queue_time_seconds), carried across vLLM restarts.",
)
ENGINE_REQUEST_PREFILL_TIME_SECONDS = Family(
    "vllm_cache_engine_request_prefill_time_seconds",
    HISTOGRAM,
    ROW,
    "Finished requests' time from first scheduled to first token, preemptions included "
    "(vllm:request_prefill_time_seconds), carried across vLLM restarts.",
)
ENGINE_REQUEST_DECODE_TIME_SECONDS = Family(
    "vllm_cache_engine_request_decode_time_seconds",
    HISTOGRAM,
    ROW,
    "Finished requests' time from first to last token (vllm:request_decode_time_seconds), "
    "carried across vLLM restarts.",
)
ENGINE_INTER_TOKEN_LATENCY_SECONDS = Family(
    "vllm_cache_engine_inter_token_latency_seconds",
    HISTOGRAM,
    ROW,
    "Time between successive output tokens (vllm:inter_token_latency_seconds, "
    "vllm:time_per_output_token_seconds before 0.10.2), carried across vLLM restarts.",
)

# --- per caller, from the usage events (exporter/metrics/usage.py)
REQUESTS = Family(
    "vllm_cache_requests",
    COUNTER,
    (*CALLER, "state"),
    "Requests reported by the proxy, by cache outcome: warm (as full a hit as the prompt "
    "allows), partial, cold (nothing reused where something could be), short (too short to "
    "hold one cache granule; never a failure), unknown (cached tokens not reported), error "
    "(non-2xx; counted nowhere else).",
)
PROMPT_TOKENS = Family(
    "vllm_cache_prompt_tokens",
    COUNTER,
    CALLER,
    "Prompt tokens of successful requests that reported cached tokens (the denominator of "
    "the per-caller hit ratio).",
    field="prompt_tokens",
)
CACHED_TOKENS = Family(
    "vllm_cache_cached_tokens",
    COUNTER,
    CALLER,
    "Prompt tokens served from vLLM's prefix cache, per the responses' "
    "usage.prompt_tokens_details.cached_tokens.",
    field="cached_tokens",
)
UNREPORTED_PROMPT_TOKENS = Family(
    "vllm_cache_unreported_prompt_tokens",
    COUNTER,
    CALLER,
    "Prompt tokens of successful requests whose cached tokens were not reported (vLLM "
    "without --enable-prompt-tokens-details); not in the hit ratio.",
    field="unreported_prompt_tokens",
)
MISSED_PROMPT_TOKENS = Family(
    "vllm_cache_missed_prompt_tokens",
    COUNTER,
    (*CALLER, "cause"),
    "Prompt tokens not served from the prefix cache, by why (cause: new, evicted, order, "
    "granule, caching_off, unreported, unknown). Summed over causes: prompt tokens - cached "
    "tokens + unreported prompt tokens.",
)
TTFT_SECONDS = Family(
    "vllm_cache_ttft_seconds",
    HISTOGRAM,
    (*CALLER, "state", "source"),
    "Time to first token without the waits in front of it, by cache outcome and by who "
    "measured it: source=engine is vLLM's own (scheduled to first token, "
    "--enable-per-request-metrics), source=proxy the proxy's TTFT minus its admission wait "
    "when known (vLLM's own queue still in it). One per request.",
)
QUEUE_WAIT_SECONDS = Family(
    "vllm_cache_queue_wait_seconds",
    HISTOGRAM,
    (*CALLER, "source"),
    "Time waited before vLLM read the prompt: source=proxy is the proxy's admission gate, "
    "source=engine vLLM's own scheduler queue. Two queues one after the other, never to be "
    "summed.",
)
GRANULARITY_TOKENS = Family(
    "vllm_cache_granularity_tokens",
    GAUGE,
    ("model", "source"),
    "Cache granularity in tokens used to classify this model's requests, and where it came "
    "from: configured (--signals.granularity), learned (gcd of reported cached counts), "
    "block_size (vLLM's prefix_match_unit or block_size).",
)
USAGE_EVENTS = Family(
    "vllm_cache_usage_events",
    COUNTER,
    ("reader",),
    "Usage events accepted (and counted in vllm_cache_requests_total), by reader.",
)
USAGE_EVENTS_REJECTED = Family(
    "vllm_cache_usage_events_rejected",
    COUNTER,
    ("reader", "reason"),
    "Usage events a reader could not use, by reader and reason (see docs/metrics.md).",
)
USAGE_LAST_EVENT_TIMESTAMP_SECONDS = Family(
    "vllm_cache_usage_last_event_timestamp_seconds",
    GAUGE,
    ("reader",),
    "Unix time the exporter last accepted an event from this reader.",
)
USAGE_INGEST_REQUESTS_REJECTED = Family(
    "vllm_cache_usage_ingest_requests_rejected",
    COUNTER,
    ("reason",),
    "POST /v1/usage requests refused as a whole (unauthorized, body_too_large, bad_body, "
    "bad_format); their events are not counted anywhere else.",
)
CALLERS_OVERFLOWED = Family(
    "vllm_cache_callers_overflowed",
    COUNTER,
    (),
    'Events counted under caller="__other__" because the caller cap (--callers.max) was reached.',
)
CALLERS_FOLDED = Family(
    "vllm_cache_callers_folded",
    COUNTER,
    (),
    'Events counted under caller="__other__" because their (caller, model) pair, or a new '
    "histogram or per-target entry of it, would have gone over the series budget "
    "(--callers.max-series).",
)
# Per (caller, model) and vLLM target: the hit ratio on each replica. ``target`` is the
# engine series' own label where the exporter reads that vLLM, so a rule can join them.
TARGET_PROMPT_TOKENS = Family(
    "vllm_cache_target_prompt_tokens",
    COUNTER,
    (*CALLER, "target"),
    "Prompt tokens of successful requests that reported cached tokens, by the vLLM target "
    "(replica) that served them, for events that name it (the tap's upstream, LiteLLM's "
    "api_base, a backend field). Summed over target: the caller's share of "
    "vllm_cache_prompt_tokens_total that named one.",
)
TARGET_CACHED_TOKENS = Family(
    "vllm_cache_target_cached_tokens",
    COUNTER,
    (*CALLER, "target"),
    "Prompt tokens served from vLLM's prefix cache, by the vLLM target (replica) that served "
    "them: over vllm_cache_target_prompt_tokens_total, the caller's hit ratio on that replica.",
)
TARGETS_OVERFLOWED = Family(
    "vllm_cache_targets_overflowed",
    COUNTER,
    (),
    'Events counted under target="__other__": past --callers.targets-max distinct targets, '
    "or a backend name over 128 characters.",
)

# --- foresight (exporter/metrics/foresight.py)
CONVERSATIONS_ACTIVE = Family(
    "vllm_cache_conversations_active",
    GAUGE,
    ("model",),
    "Conversations (sessions, else caller and model) with a successful turn within the idle"
    " window (--signals.conversation-idle), counted from their first follow-up turn and"
    " until a restart of their vLLM ends them.",
)
CONVERSATIONS_DEMAND_TOKENS = Family(
    "vllm_cache_conversations_demand_tokens",
    GAUGE,
    ("model",),
    "KV-pool tokens the active conversations need to stay cached: each one's latest context"
    " (prompt + completion of its last turn) in whole KV blocks, plus on a hybrid model one"
    " copy of its recurrent state and one for the turn being computed, in the terms of the "
    "pool of the vLLM serving the model (vllm:cache_config_info).",
)
ENGINE_CONVERSATIONS_ACTIVE = Family(
    "vllm_cache_engine_conversations_active",
    GAUGE,
    ("target", "model_name"),
    "vllm_cache_conversations_active, attributed to the one vLLM whose pool they use (see "
    "docs/metrics.md, Foresight).",
)
ENGINE_CONVERSATIONS_DEMAND_TOKENS = Family(
    "vllm_cache_engine_conversations_demand_tokens",
    GAUGE,
    ("target", "model_name"),
    "vllm_cache_conversations_demand_tokens, attributed to the one vLLM whose pool they "
    "use; compare with vllm_cache_engine_kv_pool_tokens.",
)
CONVERSATIONS_DROPPED = Family(
    "vllm_cache_conversations_dropped",
    COUNTER,
    (),
    "Conversations forgotten while still active because more than "
    "--signals.conversations-max were tracked: demand is then a lower bound.",
)
DROPPED_CONVERSATION_TURNS = Family(
    "vllm_cache_dropped_conversation_turns",
    COUNTER,
    (),
    "Turns of conversations that --signals.conversations-max had dropped while they were "
    "recent: their previous turn is no longer known, so they are classified unknown (short "
    "when their own prompt holds no granule); their tokens count as any turn's.",
)
CONVERSATION_TURNS = Family(
    "vllm_cache_conversation_turns",
    COUNTER,
    ("model",),
    "Successful requests with a reported cached count, each held against the exporter's "
    "memory of its conversation (the denominator of vllm_cache_unseen_history_requests_total).",
)
UNSEEN_HISTORY_REQUESTS = Family(
    "vllm_cache_unseen_history_requests",
    COUNTER,
    ("model",),
    "Requests with more tokens cached than the exporter's memory of their conversation "
    "explains by more than a granule (its last context; for a conversation it never saw, the "
    "largest context of any conversation on the model): earlier turns went to another "
    "exporter (a split that is not sticky by session), or a caller interleaves conversations "
    "without a session id. Either way those turns are misread.",
)
CONVERSATION_IDLE_WINDOW_SECONDS = Family(
    "vllm_cache_conversation_idle_window_seconds",
    GAUGE,
    (),
    "How long after its last turn a conversation still counts as active "
    "(--signals.conversation-idle).",
)
ENGINE_KV_POOL_MIN_TOKENS = Family(
    "vllm_cache_engine_kv_pool_min_tokens",
    GAUGE,
    ROW,
    "Smallest KV-cache pool this engine reported since the exporter started, across vLLM "
    "restarts (the pool moves from boot to boot).",
)
ENGINE_ADMISSION_BUDGET_TOKENS = Family(
    "vllm_cache_engine_admission_budget_tokens",
    GAUGE,
    ROW,
    "Tokens a token-gating proxy in front of this engine may admit at once: the smallest "
    "pool seen less --signals.admission-headroom.",
)
COMPLETION_USED_TOKENS = Family(
    "vllm_cache_completion_used_tokens",
    HISTOGRAM,
    CALLER,
    "Completion tokens generated by successful requests that declared a max_tokens (what "
    "they used of the completion budget they declared).",
)
COMPLETION_DECLARED_TOKENS = Family(
    "vllm_cache_completion_declared_tokens",
    COUNTER,
    CALLER,
    "Completion tokens those same requests declared (their max_tokens, summed): over the "
    "histogram's _count, the mean declared budget.",
)
PROMPT_ORDER_COMPARED = Family(
    "vllm_cache_prompt_order_compared",
    COUNTER,
    CALLER,
    "Requests whose prompt the tap compared with a recent one of the same caller and model "
    "(within --signals.prompt-order-window; fingerprints, never text).",
)
PROMPT_ORDER_VARIABLE_TOP = Family(
    "vllm_cache_prompt_order_variable_top",
    COUNTER,
    CALLER,
    "Of those, requests that share most of their text with a recent one but not its "
    "beginning: something variable sits at the top of the prompt, so the prefix cache "
    "cannot reuse the shared text.",
)
PROMPT_ORDER_SHARED_BYTES = Family(
    "vllm_cache_prompt_order_shared_bytes",
    COUNTER,
    CALLER,
    "Bytes of prompt (as sent, about characters) those requests share with the recent one, "
    "summed: over variable_top, the mean shared length.",
)
PROMPT_ORDER_FIRST_DIFFERENCE_BYTES = Family(
    "vllm_cache_prompt_order_first_difference_bytes",
    COUNTER,
    CALLER,
    "Bytes into the prompt within which those requests first differ from the recent one, "
    "summed: over variable_top, where the variable part sits.",
)
PROMPT_ORDER_WINDOW_SECONDS = Family(
    "vllm_cache_prompt_order_window_seconds",
    GAUGE,
    (),
    "How close in time two requests of a caller and model must be to be compared for prompt"
    " order (--signals.prompt-order-window).",
)

# --- the process' bounds (exporter/limits.py)
EXPORTER_CONNECTIONS = Family(
    "vllm_cache_exporter_connections",
    GAUGE,
    ("listener",),
    "Client connections open on a listener (web: /metrics and /v1/usage; tap).",
)
EXPORTER_CONNECTIONS_MAX = Family(
    "vllm_cache_exporter_connections_max",
    GAUGE,
    ("listener",),
    "The most client connections a listener serves at once (--web.max-connections, "
    "--tap.max-connections, kept below the file-descriptor limit).",
)
EXPORTER_CONNECTIONS_EVICTED = Family(
    "vllm_cache_exporter_connections_evicted",
    COUNTER,
    ("listener",),
    "Oldest connections closed (after their current request) to make room for a new one at "
    "the cap.",
)
EXPORTER_CONNECTIONS_REFUSED = Family(
    "vllm_cache_exporter_connections_refused",
    COUNTER,
    ("listener",),
    "Connections answered 503 and closed because the listener was past its cap and the "
    "slack for closes in progress.",
)
EXPORTER_FDS_RESERVED = Family(
    "vllm_cache_exporter_fds_reserved",
    GAUGE,
    ("use",),
    "File descriptors the budget sets aside for each use: a listener's connections (a tap "
    "connection counts two: its socket to vLLM), followed usage files, the rest of the "
    "process; together the soft RLIMIT_NOFILE.",
)
EXPORTER_FDS_REFUSED = Family(
    "vllm_cache_exporter_fds_refused",
    COUNTER,
    ("use",),
    "Descriptors a use asked for beyond its share (files: a followed file's open put off to"
    " the next poll).",
)
EXPORTER_LOG_MESSAGES_SUPPRESSED = Family(
    "vllm_cache_exporter_log_messages_suppressed",
    COUNTER,
    (),
    # A template: exporter/limits.py fills in its LOG_BURST and LOG_WINDOW_SECONDS.
    "Log messages not written because the same message was logged more than {burst} times "
    "in {window:g} s.",
)

# --- /metrics answers (exporter/limits.py)
EXPORTER_SCRAPES_CUT = Family(
    "vllm_cache_exporter_scrapes_cut",
    COUNTER,
    (),
    "Scrapes whose reader had not taken the whole /metrics body 30 s after it was ready; "
    "the connection was closed.",
)

# --- web config and TLS (exporter/web/metrics.py)
EXPORTER_WEB_CONFIG_RELOADS = Family(
    "vllm_cache_exporter_web_config_reloads",
    COUNTER,
    ("listener", "result"),
    "Re-reads of the web config file (on a change or SIGHUP) by result; a failure keeps the"
    " previous configuration.",
)
EXPORTER_WEB_CONFIG_LAST_RELOAD_SUCCESS_TIMESTAMP_SECONDS = Family(
    "vllm_cache_exporter_web_config_last_reload_success_timestamp_seconds",
    GAUGE,
    ("listener",),
    "Unix time the listener's web config was last loaded (at start or by a reload).",
)
EXPORTER_TLS_CERTIFICATE_NOT_AFTER_TIMESTAMP_SECONDS = Family(
    "vllm_cache_exporter_tls_certificate_not_after_timestamp_seconds",
    GAUGE,
    ("listener",),
    "Unix time the TLS certificate the listener serves expires (the earliest notAfter of "
    "the chain in its certificate file); it is served even once expired.",
)

# Every family above, in the order the exporter serves them.
USAGE_FILES_OPEN_MAX = Family(
    "vllm_cache_usage_files_open_max",
    GAUGE,
    (),
    "The most followed files held open at once (--usage.file.max-open, kept within the "
    "followed files' share of the descriptors).",
)
USAGE_FILE_REOPENS = Family(
    "vllm_cache_usage_file_reopens",
    COUNTER,
    (),
    "Followed files opened again after being closed to stay within the open cap.",
)

USAGE_FILES = Family(
    "vllm_cache_usage_files",
    GAUGE,
    ("state",),
    "Files matching --usage.file: open (holding a descriptor), closed (followed, reopened "
    "when they change), not_followed (past the most followed at once).",
)
USAGE_FILE_LOST_BYTES = Family(
    "vllm_cache_usage_file_lost_bytes",
    COUNTER,
    ("reason",),
    "Bytes of followed files that were never read, by reason (docs/metrics.md).",
)
USAGE_TIMINGS_DROPPED = Family(
    "vllm_cache_usage_timings_dropped",
    COUNTER,
    ("reader", "reason"),
    "Counted events whose proxy TTFT and queue wait were left out as inconsistent "
    "(queue_exceeds_ttft: the wait, part of the TTFT, was longer than it).",
)
USAGE_IDS_REMEMBERED = Family(
    "vllm_cache_usage_ids_remembered",
    GAUGE,
    ("kind",),
    "Event ids (per caller) and POST /v1/usage Idempotency-Keys remembered to count a "
    "retried copy once (--usage.dedup.max-ids, --usage.dedup.window).",
)
USAGE_IDS_FORGOTTEN_EARLY = Family(
    "vllm_cache_usage_ids_forgotten_early",
    COUNTER,
    ("kind",),
    "Event ids and Idempotency-Keys forgotten before --usage.dedup.window because the cap "
    "(--usage.dedup.max-ids) was reached: a copy of one is counted again.",
)

FAMILIES: tuple[Family, ...] = tuple(
    value for value in list(globals().values()) if isinstance(value, Family)
)
BY_NAME: dict[str, Family] = {family.name: family for family in FAMILIES}
assert len(BY_NAME) == len(FAMILIES), "a family name is defined twice"

# The per-caller counters without a state label, in exposition order (between the requests
# and the histograms): each one is rendered from its ``field`` of every (caller, model) series.
PER_CALLER_COUNTERS = tuple(family for family in FAMILIES if family.field)

# What client_python's standard collectors serve beside these (process, platform), as every
# client_python exporter does (exporter/metrics/__init__.py registers them).
CLIENT_PYTHON = (
    "process_start_time_seconds",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "python_info",
)
