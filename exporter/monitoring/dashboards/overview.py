"""The overview: is the prefix cache doing its job, for whom, and is the engine the limit.

Read top to bottom it follows the questions of the field reports: what share of prompt
tokens comes from the cache (engine-wide and per caller, against the baseline the collapse
alert compares to); are turns warm and how long do warm vs cold turns wait for their first
token; do the conversations fit the KV pool (tokens used vs pool, preemptions, queue); how
long blocks live and whether they are evicted before they are reused (vLLM's KV residency);
where prompt tokens came from (computed, vLLM's cache, a KV connector); where a slow turn
spent its time inside vLLM; and can the numbers be trusted (prefix caching on, vLLM metrics
present, usage flowing).
"""

from __future__ import annotations

from grafanalib import core as g

from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.dashboards.panels import (
    HIT_RATIO_THRESHOLDS,
    JOB,
    RATE,
    TOKENS,
    TOKENS_PER_SECOND,
    Filters,
    Layout,
    bargauge,
    caller_hit_ratio_stat,
    dashboard,
    query_variable,
    stat,
    table,
    target,
    timeseries,
    value_mapping,
)
from exporter.monitoring.promql import CLASSIFIED_STATES, number
from exporter.monitoring.rules import Names

FILENAME = "vllm-cache-overview.json"
TITLE = "vLLM prefix cache: overview"

HITS = "vllm_cache_engine_prefix_cache_hits_tokens_total"
QUERIES = "vllm_cache_engine_prefix_cache_queries_tokens_total"
CLASSIFIED = 'state=~"' + "|".join(CLASSIFIED_STATES) + '"'
WARM = 'state="warm"'
WARM_COLD = 'state=~"warm|cold"'
CALLER_TABLE_COLUMNS = {"caller": "Caller", "model": "Model", "Value #A": "Hit ratio",
                        "Value #B": "Warm turns", "Value #C": "Turns/s",
                        "Value #D": "Median TTFT", "Value #E": "Unreported tokens/s"}


def variables(config: MonitoringConfig) -> list[g.Template]:
    filters = Filters(config)
    # One model dropdown for both label spellings: vLLM's model_name on engine series and the
    # requested model on per-caller series (the regex takes whichever the row has).
    series = '__name__=~"vllm_cache_requests_total|vllm_cache_engine_kv_pool_tokens"'
    models = f"query_result(count by (model, model_name) ({filters.selector(series, JOB)}))"
    return [
        query_variable("job", "Job",
                       f"label_values(vllm_cache_exporter_build_info{filters.selector()}, job)"),
        query_variable("target", "vLLM",
                       f"label_values(vllm_cache_engine_up{filters.job()}, target)"),
        query_variable("model", "Model", models, regex='/model(?:_name)?="([^"]+)"/'),
        query_variable("caller", "Caller",
                       f"label_values(vllm_cache_requests_total{filters.model()}, caller)"),
    ]


def build(config: MonitoringConfig) -> g.Dashboard:
    filters = Filters(config)
    names = Names(config)
    engines, callers = filters.engine(), filters.caller()
    vllm_targets, jobs = filters.target(), filters.job()
    warm_callers, classified_callers = filters.caller(WARM), filters.caller(CLASSIFIED)
    layout = Layout()

    layout.row("Prefix cache")
    layout.add(stat(
        "Engine hit ratio",
        "Share of the prompt tokens vLLM looked up that it found in its prefix cache, over "
        "the selected engines (ratio of summed rates). On a hybrid model about 94% is a full "
        "hit; 0% for a whole boot means the cache never works.",
        "percentunit",
        [target(f"sum(rate({HITS}{engines}[{RATE}]))\n/\n"
                f"(sum(rate({QUERIES}{engines}[{RATE}])) > 0)")],
        thresholds=HIT_RATIO_THRESHOLDS), 4, 5)
    layout.add(caller_hit_ratio_stat(
        "Caller hit ratio",
        "Share of the selected callers' prompt tokens served from the prefix cache, from the "
        "usage each response reports", callers), 4, 5)
    layout.add(stat(
        "Warm turns",
        "Share of the selected callers' turns that reused all the cache they could (warm), "
        "among warm, partial and cold turns. Short and unknown turns say nothing about the "
        "cache and are left out.",
        "percentunit",
        [target(f"(sum(rate(vllm_cache_requests_total{warm_callers}[{RATE}])) or vector(0))"
                f"\n/\n(sum(rate(vllm_cache_requests_total{classified_callers}[{RATE}])) > 0)")],
        thresholds=[("red", None), ("orange", 0.5), ("green", 0.8)]), 4, 5)
    layout.add(stat(
        "Prefix caching",
        "Whether each vLLM runs with enable_prefix_caching. Hybrid models default to off: "
        "then every turn re-reads its whole prompt (VllmCachePrefixCachingDisabled).",
        "none",
        [target(f"max by (target, model_name) (vllm_cache_engine_prefix_caching_enabled{engines})",
                "{{target}} {{model_name}}")],
        mappings=value_mapping(("0", "Off", "red"), ("1", "On", "green"))), 6, 5)
    layout.add(stat(
        "Cache granularity",
        "Tokens per cache granule per model: cached counts come in whole granules (the block "
        "size, 2,048 or ~800 on hybrid models), and where it came from (configured, learned "
        "from cached counts, or vLLM's block size).",
        TOKENS,
        [target(f"max by (model, source) (vllm_cache_granularity_tokens{filters.model()})",
                "{{model}} ({{source}})")]), 6, 5)
    layout.add(timeseries(
        "Hit ratio per vLLM engine",
        f"Prefix-cache hit ratio of each vLLM (summed over its engines), and its baseline as "
        f"recorded by the rules: the 90th percentile over {config.baseline_window} of the "
        f"{config.long_window} ratio, which a collapse cannot drag down within hours. "
        f"VllmCachePrefixCollapse fires when the {config.short_window} ratio stays below "
        f"{number(config.collapse_drop_factor)} x the baseline while traffic continues.",
        "percentunit",
        [target(f"sum by (target, model_name) (rate({HITS}{engines}[{RATE}]))\n/\n"
                f"(sum by (target, model_name) (rate({QUERIES}{engines}[{RATE}])) > 0)",
                "{{target}} {{model_name}}"),
         target(f"{names.target_hit_ratio[names.baseline]}{filters.engine()}",
                "{{target}} {{model_name}} baseline")],
        min_value=0, max_value=1), 12, 8)
    layout.add(timeseries(
        "Hit ratio per caller",
        f"Share of each caller's prompt tokens served from the prefix cache, and its baseline "
        f"(the 90th percentile over {config.baseline_window} of its {config.long_window} "
        "ratio). Two conversations that no longer fit the KV pool evict each other: both "
        "lines fall to ~0 together.",
        "percentunit",
        [target(f"sum by (caller, model) (rate(vllm_cache_cached_tokens_total{callers}[{RATE}]))"
                f"\n/\n(sum by (caller, model) (rate(vllm_cache_prompt_tokens_total{callers}"
                f"[{RATE}])) > 0)", "{{caller}} {{model}}"),
         target(f"{names.caller_hit_ratio[names.baseline]}{callers}",
                "{{caller}} {{model}} baseline")],
        min_value=0, max_value=1), 12, 8)

    layout.row("Turns and time to first token")
    layout.add(timeseries(
        "Turns per caller by state",
        "Requests per second per caller and cache outcome: warm (reused all it could), "
        "partial, cold, short (too short to hold one granule), unknown (cached tokens not "
        "reported), error.",
        "reqps",
        [target(f"sum by (caller, state) (rate(vllm_cache_requests_total{callers}[{RATE}]))",
                "{{caller}} {{state}}")],
        stacked=True, bars=True), 12, 8)
    layout.add(timeseries(
        "Warm vs cold time to first token",
        "Engine-side time to first token of warm and cold turns, median and 95th "
        "percentile, per source: engine is vLLM's own (vLLM with "
        "--enable-per-request-metrics), proxy the proxy's TTFT minus its admission wait. "
        "Seconds means the cache held; a minute or more means it was evicted.",
        "s",
        [target(f"histogram_quantile({quantile}, sum by (state, source, le) (rate("
                f"vllm_cache_ttft_seconds_bucket{filters.caller(WARM_COLD)}[{RATE}])))",
                f"{label} {{{{state}}}} {{{{source}}}}")
         for label, quantile in (("p50", 0.5), ("p95", 0.95))]), 12, 8)
    layout.add(table(
        "Callers",
        "One row per caller and model, now: hit ratio, warm share, turns per second, median "
        "time to first token of classified turns (vLLM's own where it measured them, else "
        "the proxy's), and prompt tokens per second whose cached count vLLM did not report. "
        "Click a caller for its drill-down.",
        "percentunit",
        [target(f"sum by (caller, model) (rate(vllm_cache_cached_tokens_total{callers}[{RATE}]))"
                f"\n/\n(sum by (caller, model) (rate(vllm_cache_prompt_tokens_total{callers}"
                f"[{RATE}])) > 0)", instant=True),
         target(f"(sum by (caller, model) (rate(vllm_cache_requests_total{warm_callers}"
                f"[{RATE}]))\n or\n sum by (caller, model) (rate(vllm_cache_requests_total"
                f"{classified_callers}[{RATE}])) * 0)\n/\n(sum by (caller, model) (rate("
                f"vllm_cache_requests_total{classified_callers}[{RATE}])) > 0)",
                instant=True),
         target(f"sum by (caller, model) (rate(vllm_cache_requests_total{callers}[{RATE}]))",
                instant=True),
         target(_engine_first_median(filters), instant=True),
         target(f"sum by (caller, model) (rate(vllm_cache_unreported_prompt_tokens_total{callers}"
                f"[{RATE}]))\nor\nsum by (caller, model) (rate(vllm_cache_requests_total{callers}"
                f"[{RATE}])) * 0", instant=True)],
        renames=CALLER_TABLE_COLUMNS,
        # Overrides apply after the rename, so they name the renamed columns.
        overrides=[
            _unit_override("Turns/s", "reqps"), _unit_override("Median TTFT", "s"),
            _unit_override("Unreported tokens/s", TOKENS_PER_SECOND),
            {"matcher": {"id": "byName", "options": "Caller"},
             "properties": [{"id": "links", "value": [{
                 "title": "Caller drill-down",
                 "url": f"/d/{config.caller_uid}?var-caller=${{__value.raw}}"
                        "&${job:queryparam}&${model:queryparam}&${datasource:queryparam}"
                        "&${__url_time_range}"}]}]},
        ]), 24, 8)

    layout.row("KV cache and scheduler")
    layout.add(timeseries(
        "KV cache: tokens used vs pool",
        "Tokens of conversation the KV pool holds now (usage x pool) against the pool size "
        "(vLLM's startup log: \"GPU KV cache size: N tokens\"). Conversations fit while their "
        "summed context stays a few thousand tokens under the pool.",
        TOKENS,
        [target(f"sum by (target, model_name) (vllm_cache_engine_kv_used_tokens{engines})",
                "{{target}} {{model_name}} used"),
         target(f"sum by (target, model_name) (vllm_cache_engine_kv_pool_tokens{engines})",
                "{{target}} {{model_name}} pool")]), 12, 8)
    layout.add(bargauge(
        "KV pool in use",
        "Fraction of each vLLM's KV pool in use (summed used tokens over summed pool tokens "
        "of its engines). VllmCacheKVPoolNearFull fires above "
        f"{number(config.kv_pool_full_ratio * 100)}% for {config.kv_pool_full_for}.",
        "percentunit",
        [target(f"sum by (target, model_name) (vllm_cache_engine_kv_used_tokens{engines})\n/\n"
                f"(sum by (target, model_name) (vllm_cache_engine_kv_pool_tokens{engines}) > 0)",
                "{{target}} {{model_name}}")],
        thresholds=[("green", None), ("orange", 0.8), ("red", config.kv_pool_full_ratio)]),
        12, 8)
    layout.add(timeseries(
        "Prompt tokens: from cache vs recomputed",
        "Prompt tokens per second vLLM served from its prefix cache and those it had to "
        "recompute. When two conversations evict each other the cached share drops to 0 "
        "while the recomputed one jumps.",
        TOKENS_PER_SECOND,
        [target(f"sum by (target, model_name) (rate({HITS}{engines}[{RATE}]))",
                "{{target}} {{model_name}} from cache"),
         target(f"sum by (target, model_name) (rate({QUERIES}{engines}[{RATE}]))\n-\n"
                f"sum by (target, model_name) (rate({HITS}{engines}[{RATE}]))",
                "{{target}} {{model_name}} recomputed")],
        stacked=True), 8, 8)
    layout.add(timeseries(
        "Preemptions",
        "Requests vLLM preempted per second: the running ones did not fit the KV pool, and a "
        "preempted request loses its blocks and is recomputed later.",
        "suffix: preemptions/s",
        [target(f"sum by (target, model_name) (rate(vllm_cache_engine_preemptions_total{engines}"
                f"[{RATE}]))", "{{target}} {{model_name}}")]), 8, 8)
    layout.add(timeseries(
        "Running and waiting requests",
        "Requests in vLLM's running batch and waiting in its queue. Waiting requests with a "
        "full KV pool mean the pool, not the scheduler, is the concurrency limit.",
        "short",
        [target(f"sum by (target, model_name) (vllm_cache_engine_requests_running{engines})",
                "{{target}} {{model_name}} running"),
         target(f"sum by (target, model_name) (vllm_cache_engine_requests_waiting{engines})",
                "{{target}} {{model_name}} waiting")]), 8, 8)

    _residency_row(layout, engines)
    _sources_row(layout, engines)
    _phases_row(layout, engines)

    layout.row("Can the numbers be trusted")
    layout.add(stat(
        "vLLM reachable",
        "Whether the exporter's last read of each vLLM /metrics succeeded "
        "(VllmCacheEngineDown).",
        "none",
        [target(f"max by (target) (vllm_cache_engine_up{vllm_targets})", "{{target}}")],
        mappings=value_mapping(("0", "Down", "red"), ("1", "Up", "green"))), 6, 6)
    layout.add(table(
        "vLLM metrics present",
        "For each signal the exporter reads, whether vLLM exposes it under any known name. "
        "Absent means renamed or dropped by a vLLM upgrade, too old a vLLM, or a flag that is "
        "off (KV residency needs --kv-cache-metrics): its panels show nothing, never a "
        "reassuring 0 (VllmCacheEngineMetricAbsent for the signals the alerts need).",
        "none",
        [target(f"min by (target, signal) (vllm_cache_engine_metric_present{vllm_targets})",
                instant=True)],
        renames={"target": "vLLM", "signal": "Signal", "Value": "Present"},
        mappings=value_mapping(("0", "ABSENT", "red"), ("1", "present", "green"))), 6, 6)
    layout.add(timeseries(
        "vLLM read errors",
        "Failed reads of each vLLM /metrics per second, by reason (connect, timeout, "
        "http_status, parse, ...); 0 when none.",
        "suffix: errors/s",
        [target(f"sum by (target, reason) (rate(vllm_cache_engine_scrape_errors_total{vllm_targets}"
                f"[{RATE}]))\nor\nsum by (target) (vllm_cache_engine_up{vllm_targets}) * 0",
                "{{target}} {{reason}}")]), 6, 6)
    layout.add(timeseries(
        "Usage events",
        "Per-request usage records accepted per second by each reader, those rejected (by "
        "reason; 0 when none), and those counted under the caller cap's overflow bucket.",
        "suffix: events/s",
        [target(f"sum by (reader) (rate(vllm_cache_usage_events_total{jobs}[{RATE}]))",
                "{{reader}} accepted"),
         target(f"sum by (reader, reason) (rate(vllm_cache_usage_events_rejected_total{jobs}"
                f"[{RATE}]))\nor\nsum by (reader) (rate(vllm_cache_usage_events_total{jobs}"
                f"[{RATE}])) * 0", "{{reader}} rejected {{reason}}"),
         target(f"sum(rate(vllm_cache_callers_overflowed_total{jobs}[{RATE}]))",
                "over the caller cap")]), 6, 6)

    return dashboard(
        config, TITLE, config.overview_uid,
        "Prefix-cache hit ratio per engine and per caller, warm vs cold time to first token, "
        "KV occupancy in tokens and preemptions, from vllm-cache-exporter.",
        variables(config), layout)


def _median(histogram: str, engines: str) -> str:
    return (f"histogram_quantile(0.5, sum by (target, model_name, le) "
            f"(rate({histogram}_bucket{engines}[{RATE}])))")


def _residency_row(layout: Layout, engines: str) -> None:
    """What vLLM's sampled evictions say (vLLM started with --kv-cache-metrics)."""
    layout.row("KV residency (vLLM with --kv-cache-metrics)")
    layout.add(timeseries(
        "KV blocks: lifetime, idle before eviction, reuse gap",
        "Medians over the blocks vLLM sampled and evicted: lifetime (allocation to eviction), "
        "idle before eviction (last prefix-cache hit to eviction) and the gap between hits on "
        "a block. Blocks evicted after less idle than the reuse gap went before their "
        "conversation came back; a reuse-gap line that vanishes while evictions go on means "
        "no evicted block had been hit since it was computed. Empty when vLLM runs without "
        "--kv-cache-metrics (see \"vLLM metrics present\") or evicts nothing.",
        "s",
        [target(_median(f"vllm_cache_engine_kv_block_{histogram}_seconds", engines),
                f"{{{{target}}}} {{{{model_name}}}} {label}")
         for histogram, label in (("lifetime", "lifetime"),
                                  ("idle_before_evict", "idle before eviction"),
                                  ("reuse_gap", "reuse gap"))]), 12, 8)
    layout.add(timeseries(
        "Evicted before reuse",
        "Share of the evicted blocks' lifetime they sat idle before eviction (sampled "
        "blocks). Near 100% with a falling hit ratio: blocks are evicted before any turn "
        "comes back to them, the KV pool is too small for the conversations it holds. It "
        "trails the hit ratio by minutes, so the collapse alert stays on the ratio.",
        "percentunit",
        [target("sum by (target, model_name) (rate("
                f"vllm_cache_engine_kv_block_idle_before_evict_seconds_sum{engines}[{RATE}]))"
                "\n/\n(sum by (target, model_name) (rate("
                f"vllm_cache_engine_kv_block_lifetime_seconds_sum{engines}[{RATE}])) > 0)",
                "{{target}} {{model_name}}")],
        min_value=0, max_value=1), 6, 8)
    layout.add(timeseries(
        "Sampled evictions and reuses",
        "Sampled blocks evicted per second, and hits on them per second (reuse gaps seen at "
        "their eviction, 3 at most per block). Multiply by 1 / --kv-cache-metrics-sample "
        "(default 100) for the whole pool.",
        "suffix: /s",
        [target("sum by (target, model_name) (rate("
                f"vllm_cache_engine_kv_block_idle_before_evict_seconds_count{engines}[{RATE}]))",
                "{{target}} {{model_name}} evicted"),
         target("sum by (target, model_name) (rate("
                f"vllm_cache_engine_kv_block_reuse_gap_seconds_count{engines}[{RATE}]))",
                "{{target}} {{model_name}} reuse gaps")]), 6, 8)


def _sources_row(layout: Layout, engines: str) -> None:
    """Where prompt tokens came from: computed, vLLM's own cache, or a KV connector."""
    layout.row("Where prompt tokens come from")
    by_source = "sum by (target, model_name, source) (rate({name}{engines}[{rate}]))"
    layout.add(timeseries(
        "Prompt tokens by source",
        "Prompt tokens per second by where their KV came from: local_compute (prefilled), "
        "local_cache_hit (vLLM's prefix cache) or external_kv_transfer (loaded through a KV "
        "connector: LMCache, CPU offloading, a prefill server). vLLM 0.16 and later.",
        TOKENS_PER_SECOND,
        [target(by_source.format(name="vllm_cache_engine_prompt_tokens_by_source_total",
                                 engines=engines, rate=RATE),
                "{{target}} {{model_name}} {{source}}")],
        stacked=True), 8, 8)
    cached = by_source.format(name="vllm_cache_engine_prompt_tokens_cached_by_source_total",
                              engines=engines, rate=RATE)
    layout.add(timeseries(
        "Cached tokens by tier",
        "Share of the cached prompt tokens each cache tier supplied: device (GPU memory), "
        "host (offloaded to CPU memory), disk, p2p (another vLLM), external_unspecified. "
        "vLLM 0.32 and later.",
        "percentunit",
        [target(f"{cached}\n/ on (target, model_name) group_left ()\n"
                f"(sum by (target, model_name) ({cached}) > 0)",
                "{{target}} {{model_name}} {{source}}")],
        stacked=True, min_value=0, max_value=1), 8, 8)
    layout.add(timeseries(
        "External KV cache (connector)",
        "Prompt tokens per second vLLM looked up in a KV connector's cache after its own, and "
        "those the connector supplied. 0 without a connector.",
        TOKENS_PER_SECOND,
        [target("sum by (target, model_name) (rate("
                f"vllm_cache_engine_external_prefix_cache_queries_tokens_total{engines}"
                f"[{RATE}]))", "{{target}} {{model_name}} looked up"),
         target("sum by (target, model_name) (rate("
                f"vllm_cache_engine_external_prefix_cache_hits_tokens_total{engines}[{RATE}]))",
                "{{target}} {{model_name}} found")]), 8, 8)


def _phases_row(layout: Layout, engines: str) -> None:
    """Where a slow turn spent its time inside vLLM when the cache did hold."""
    layout.row("Time inside vLLM")
    layout.add(timeseries(
        "Request phases",
        "Median and 95th percentile of finished requests' time in vLLM's queue (arrival to "
        "first scheduled), prefill (first scheduled to first token, preemptions included) "
        "and decode (first to last token). A slow turn whose cache held spent it here; vLLM's "
        "buckets start at 0.3 s.",
        "s",
        [target(f"histogram_quantile({quantile}, sum by (le) (rate("
                f"vllm_cache_engine_request_{phase}_time_seconds_bucket{engines}[{RATE}])))",
                f"{label} {phase}")
         for phase in ("queue", "prefill", "decode")
         for label, quantile in (("p50", 0.5), ("p95", 0.95))]), 12, 8)
    layout.add(timeseries(
        "Inter-token latency",
        "Median and 95th percentile of the time between output tokens.",
        "s",
        [target(f"histogram_quantile({quantile}, sum by (le) (rate("
                f"vllm_cache_engine_inter_token_latency_seconds_bucket{engines}[{RATE}])))",
                label)
         for label, quantile in (("p50", 0.5), ("p95", 0.95))]), 6, 8)
    layout.add(timeseries(
        "Waiting requests by reason",
        "Requests waiting in vLLM: for capacity (KV or batch room) or deferred (LoRA budget, "
        "a pending KV transfer). vLLM 0.20 and later.",
        "short",
        [target("sum by (target, model_name, reason) "
                f"(vllm_cache_engine_requests_waiting_by_reason{engines})",
                "{{target}} {{model_name}} {{reason}}")],
        stacked=True), 6, 8)


def _unit_override(field: str, unit: str) -> dict[str, object]:
    return {"matcher": {"id": "byName", "options": field},
            "properties": [{"id": "unit", "value": unit}]}


def _engine_first_median(filters: Filters) -> str:
    """Median TTFT of a caller's classified turns for a one-row-per-caller table: vLLM's own
    where it measured turns in the window (``>= 0`` drops the NaN of a window without
    any), else the proxy's. Never both summed into one distribution."""
    def median(source: str) -> str:
        return (f"histogram_quantile(0.5, sum by (caller, model, le) (rate("
                f"vllm_cache_ttft_seconds_bucket{filters.caller(CLASSIFIED, source)}"
                f"[{RATE}])))")

    engine, proxy = median('source="engine"'), median('source!="engine"')
    return f"({engine} >= 0)\nor\n{proxy}"
