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

from dataclasses import dataclass

from grafanalib import core as g

from exporter import families
from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.dashboards.panels import (
    MODEL_NAME,
    RATE,
    TOKENS,
    TOKENS_PER_SECOND,
    Filters,
    Layout,
    bargauge,
    caller_hit_ratio_stat,
    dashboard,
    hit_ratio_thresholds,
    job_variable,
    query_variable,
    stat,
    table,
    target,
    timeseries,
    topology_variables,
    value_mapping,
    warm_share_stat,
)
from exporter.monitoring.promql import CLASSIFIED_STATES, hit_ratio, number, warm_share
from exporter.monitoring.rules import QUANTILES, Names

FILENAME = "vllm-cache-overview.json"
TITLE = "vLLM prefix cache: overview"

CLASSIFIED = 'state=~"' + "|".join(CLASSIFIED_STATES) + '"'
WARM = 'state="warm"'
WARM_COLD = 'state=~"warm|cold"'
CALLER_TABLE_COLUMNS = {
    "caller": "Caller",
    "model": "Model",
    "Value #A": "Hit ratio",
    "Value #B": "Warm turns",
    "Value #C": "Turns/s",
    "Value #D": "Median TTFT",
    "Value #E": "Unreported tokens/s",
}


def variables(config: MonitoringConfig) -> list[g.Template]:
    filters = Filters(config)
    # One model dropdown for both label spellings: vLLM's model_name on engine series and the
    # requested model on per-caller series (the regex takes whichever the row has).
    series = f'__name__=~"{families.REQUESTS.total}|{families.ENGINE_KV_POOL_TOKENS.series}"'
    models = f"query_result(count by (model, model_name) ({filters.job(series)}))"
    return [
        *topology_variables(config),
        job_variable(config),
        query_variable(
            "target", "vLLM", f"label_values({families.ENGINE_UP.series}{filters.job()}, target)"
        ),
        query_variable("model", "Model", models, regex='/model(?:_name)?="([^"]+)"/'),
        query_variable(
            "caller", "Caller", f"label_values({families.REQUESTS.total}{filters.model()}, caller)"
        ),
    ]


@dataclass(frozen=True)
class _Queries:
    """What every row builder needs: the configuration, the filters and the recorded names."""

    config: MonitoringConfig
    filters: Filters
    names: Names

    @property
    def engines(self) -> str:
        return self.filters.engine()

    @property
    def callers(self) -> str:
        return self.filters.caller()

    def engine_rate(self, recorded: dict[str, str]) -> str:
        """A recorded per-target rate at the short window, for the selected engines."""
        return f"{recorded[self.names.short]}{self.engines}"

    def caller_rate(self, recorded: dict[str, str]) -> str:
        return f"{recorded[self.names.short]}{self.callers}"


def build(config: MonitoringConfig) -> g.Dashboard:
    queries = _Queries(config, Filters(config), Names(config))
    layout = Layout()
    _cache_row(layout, queries)
    _hit_ratio_lines(layout, queries)
    _turns_row(layout, queries)
    _callers_table(layout, queries)
    _kv_row(layout, queries)
    _residency_row(layout, queries)
    _sources_row(layout, queries)
    _cross_check_row(layout, queries)
    _phases_row(layout, queries.engines)
    _trust_row(layout, queries.filters)
    return dashboard(
        config,
        TITLE,
        config.overview_uid,
        "Prefix-cache hit ratio per engine and per caller, warm vs cold time to first token, "
        "KV occupancy in tokens and preemptions, from vllm-cache-exporter.",
        variables(config),
        layout,
    )


def _cache_row(layout: Layout, queries: _Queries) -> None:
    """The cache now: engine and caller hit ratios, warm share, prefix caching, granularity."""
    config, names, engines = queries.config, queries.names, queries.engines
    layout.row("Prefix cache")
    layout.add(
        stat(
            "Engine hit ratio",
            "Share of the prompt tokens vLLM looked up that it found in its prefix cache, over "
            "the selected engines (ratio of summed rates). On a hybrid model about 94% is a full "
            "hit; 0% for a whole boot means the cache never works.",
            "percentunit",
            [
                target(
                    hit_ratio(
                        f"sum({queries.engine_rate(names.target_hits)})",
                        f"sum({queries.engine_rate(names.target_queries)})",
                    )
                )
            ],
            thresholds=hit_ratio_thresholds(config),
        ),
        4,
        5,
    )
    layout.add(
        caller_hit_ratio_stat(
            config,
            "Caller hit ratio",
            "Share of the selected callers' prompt tokens served from the prefix cache, from the "
            "usage each response reports",
        ),
        4,
        5,
    )
    layout.add(
        warm_share_stat(
            config,
            "Warm turns",
            "Share of the selected callers' turns that reused all the cache they could (warm), "
            "among warm, partial and cold turns. Short and unknown turns say nothing about the "
            "cache and are left out.",
        ),
        4,
        5,
    )
    layout.add(
        stat(
            "Prefix caching",
            "Whether each vLLM runs with enable_prefix_caching. Hybrid models default to off: "
            "then every turn re-reads its whole prompt (VllmCachePrefixCachingDisabled).",
            "none",
            [
                target(
                    f"max by (target, model_name) "
                    f"({families.ENGINE_PREFIX_CACHING_ENABLED.series}{engines})",
                    "{{target}} {{model_name}}",
                )
            ],
            mappings=value_mapping(("0", "Off", "red"), ("1", "On", "green")),
        ),
        6,
        5,
    )
    layout.add(
        stat(
            "Cache granularity",
            "Tokens per cache granule per model: cached counts come in whole granules (the block "
            "size, 2,048 or ~800 on hybrid models), and where it came from (configured, learned "
            "from cached counts, or vLLM's block size).",
            TOKENS,
            [
                target(
                    f"max by (model, source) "
                    f"({families.GRANULARITY_TOKENS.series}{queries.filters.model()})",
                    "{{model}} ({{source}})",
                )
            ],
        ),
        6,
        5,
    )


def _hit_ratio_lines(layout: Layout, queries: _Queries) -> None:
    """The recorded hit ratios per engine and per caller, each against its baseline."""
    config, names = queries.config, queries.names
    layout.add(
        timeseries(
            "Hit ratio per vLLM engine",
            f"Prefix-cache hit ratio of each vLLM (summed over its engines), and its baseline as "
            f"recorded by the rules: the 90th percentile over {config.baseline_window} of the "
            f"{config.long_window} ratio, which a collapse cannot drag down within hours. "
            f"VllmCachePrefixCollapse fires when the {config.short_window} ratio stays below "
            f"{number(config.collapse_drop_factor)} x the baseline while traffic continues.",
            "percentunit",
            [
                target(queries.engine_rate(names.target_hit_ratio), "{{target}} {{model_name}}"),
                target(
                    f"{names.target_hit_ratio[names.baseline]}{queries.engines}",
                    "{{target}} {{model_name}} baseline",
                ),
            ],
            min_value=0,
            max_value=1,
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "Hit ratio per caller",
            f"Share of each caller's prompt tokens served from the prefix cache, and its baseline "
            f"(the 90th percentile over {config.baseline_window} of its {config.long_window} "
            "ratio). Two conversations that no longer fit the KV pool evict each other: both "
            "lines fall to ~0 together.",
            "percentunit",
            [
                target(queries.caller_rate(names.caller_hit_ratio), "{{caller}} {{model}}"),
                target(
                    f"{names.caller_hit_ratio[names.baseline]}{queries.callers}",
                    "{{caller}} {{model}} baseline",
                ),
            ],
            min_value=0,
            max_value=1,
        ),
        12,
        8,
    )


def _turns_row(layout: Layout, queries: _Queries) -> None:
    """Turns per caller by state, and warm vs cold time to first token."""
    filters, names = queries.filters, queries.names
    layout.row("Turns and time to first token")
    layout.add(
        timeseries(
            "Turns per caller by state",
            "Requests per second per caller and cache outcome: warm (reused all it could), "
            "partial, cold, short (too short to hold one granule), unknown (cached tokens not "
            "reported), error.",
            "reqps",
            [
                target(
                    f"sum by (caller, state) ({names.caller_state_requests}{queries.callers})",
                    "{{caller}} {{state}}",
                )
            ],
            stacked=True,
            bars=True,
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "Warm vs cold time to first token",
            "Engine-side time to first token of warm and cold turns, median and 95th "
            "percentile, per source: engine is vLLM's own (vLLM with "
            "--enable-per-request-metrics), proxy the proxy's TTFT minus its admission wait. "
            "Seconds means the cache held; a minute or more means it was evicted.",
            "s",
            [
                target(
                    f"histogram_quantile({quantile}, sum by (state, source, le) ("
                    f"{names.caller_state_ttft_bucket}{filters.caller(WARM_COLD)}))",
                    f"{label} {{{{state}}}} {{{{source}}}}",
                )
                for label, quantile in QUANTILES
            ],
        ),
        12,
        8,
    )


def _callers_table(layout: Layout, queries: _Queries) -> None:
    """One row per caller and model, from the recorded per-caller series."""
    config, names, filters = queries.config, queries.names, queries.filters

    def per_caller(recorded: str, *matchers: str) -> str:
        # Summed by (caller, model): one row each, whatever jobs are selected.
        return f"sum by (caller, model) ({recorded}{filters.caller(*matchers)})"

    requests = per_caller(names.caller_state_requests)
    short = names.short
    layout.add(
        table(
            "Callers",
            "One row per caller and model, now: hit ratio, warm share, turns per second, median "
            "time to first token of classified turns (vLLM's own where it measured them, else "
            "the proxy's), and prompt tokens per second whose cached count vLLM did not report. "
            "Click a caller for its drill-down.",
            "percentunit",
            [
                target(
                    hit_ratio(
                        per_caller(names.caller_cached[short]),
                        per_caller(names.caller_prompt[short]),
                    ),
                    instant=True,
                ),
                target(
                    warm_share(
                        per_caller(names.caller_state_requests, WARM),
                        per_caller(names.caller_state_requests, CLASSIFIED),
                    ),
                    instant=True,
                ),
                target(requests, instant=True),
                target(_engine_first_median(queries), instant=True),
                target(
                    f"{per_caller(names.caller_unreported[short])}\nor\n{requests} * 0",
                    instant=True,
                ),
            ],
            renames=CALLER_TABLE_COLUMNS,
            # Overrides apply after the rename, so they name the renamed columns.
            overrides=[
                _unit_override("Turns/s", "reqps"),
                _unit_override("Median TTFT", "s"),
                _unit_override("Unreported tokens/s", TOKENS_PER_SECOND),
                {
                    "matcher": {"id": "byName", "options": "Caller"},
                    "properties": [
                        {
                            "id": "links",
                            "value": [
                                {
                                    "title": "Caller drill-down",
                                    "url": f"/d/{config.caller_uid}?var-caller=${{__value.raw}}"
                                    "&${job:queryparam}&${model:queryparam}&${datasource:queryparam}"
                                    "&${__url_time_range}",
                                }
                            ],
                        }
                    ],
                },
            ],
        ),
        24,
        8,
    )


def _kv_row(layout: Layout, queries: _Queries) -> None:
    """Do the conversations fit the KV pool: tokens used vs pool, preemptions, the queue."""
    config, names, engines = queries.config, queries.names, queries.engines
    by_target = "sum by (target, model_name) "
    layout.row("KV cache and scheduler")
    layout.add(
        timeseries(
            "KV cache: tokens used vs pool",
            "Tokens of conversation the KV pool holds now (usage x pool) against the pool size "
            '(vLLM\'s startup log: "GPU KV cache size: N tokens"). Conversations fit while their '
            "summed context stays a few thousand tokens under the pool.",
            TOKENS,
            [
                target(f"{names.target_kv_used_tokens}{engines}", "{{target}} {{model_name}} used"),
                target(f"{names.target_kv_pool_tokens}{engines}", "{{target}} {{model_name}} pool"),
            ],
        ),
        12,
        8,
    )
    layout.add(
        bargauge(
            "KV pool in use",
            "Fraction of each vLLM's KV pool in use (summed used tokens over summed pool tokens "
            "of its engines). VllmCacheKVPoolNearFull fires above "
            f"{number(config.kv_pool_full_ratio * 100)}% for {config.kv_pool_full_for}.",
            "percentunit",
            [target(f"{names.target_kv_used_ratio}{engines}", "{{target}} {{model_name}}")],
            thresholds=[("green", None), ("orange", 0.8), ("red", config.kv_pool_full_ratio)],
        ),
        12,
        8,
    )
    hits, looked_up = (
        queries.engine_rate(names.target_hits),
        queries.engine_rate(names.target_queries),
    )
    layout.add(
        timeseries(
            "Prompt tokens: from cache vs recomputed",
            "Prompt tokens per second vLLM served from its prefix cache and those it had to "
            "recompute. When two conversations evict each other the cached share drops to 0 "
            "while the recomputed one jumps.",
            TOKENS_PER_SECOND,
            [
                target(hits, "{{target}} {{model_name}} from cache"),
                target(f"{looked_up}\n-\n{hits}", "{{target}} {{model_name}} recomputed"),
            ],
            stacked=True,
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Preemptions",
            "Requests vLLM preempted per second: the running ones did not fit the KV pool, and a "
            "preempted request loses its blocks and is recomputed later.",
            "suffix: preemptions/s",
            [target(f"{names.target_preemptions}{engines}", "{{target}} {{model_name}}")],
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Running and waiting requests",
            "Requests in vLLM's running batch and waiting in its queue. Waiting requests with a "
            "full KV pool mean the pool, not the scheduler, is the concurrency limit.",
            "short",
            [
                target(
                    f"{by_target}({families.ENGINE_REQUESTS_RUNNING.series}{engines})",
                    "{{target}} {{model_name}} running",
                ),
                target(
                    f"{by_target}({families.ENGINE_REQUESTS_WAITING.series}{engines})",
                    "{{target}} {{model_name}} waiting",
                ),
            ],
        ),
        8,
        8,
    )


def _trust_row(layout: Layout, filters: Filters) -> None:
    """Can the numbers be trusted: vLLM read, its metrics present, usage flowing."""
    vllm_targets, jobs = filters.target(), filters.job()
    events = families.USAGE_EVENTS.total
    layout.row("Can the numbers be trusted")
    layout.add(
        stat(
            "vLLM reachable",
            "Whether the exporter's last read of each vLLM /metrics succeeded "
            "(VllmCacheEngineDown).",
            "none",
            [target(f"max by (target) ({families.ENGINE_UP.series}{vllm_targets})", "{{target}}")],
            mappings=value_mapping(("0", "Down", "red"), ("1", "Up", "green")),
        ),
        6,
        6,
    )
    layout.add(
        table(
            "vLLM metrics present",
            "For each signal the exporter reads, whether vLLM exposes it under any known name. "
            "Absent means renamed or dropped by a vLLM upgrade, too old a vLLM, or a flag that is "
            "off (KV residency needs --kv-cache-metrics): its panels show nothing, never a "
            "reassuring 0 (VllmCacheEngineMetricAbsent for the signals the alerts need).",
            "none",
            [
                target(
                    f"min by (target, signal) "
                    f"({families.ENGINE_METRIC_PRESENT.series}{vllm_targets})",
                    instant=True,
                )
            ],
            renames={"target": "vLLM", "signal": "Signal", "Value": "Present"},
            mappings=value_mapping(("0", "ABSENT", "red"), ("1", "present", "green")),
        ),
        6,
        6,
    )
    layout.add(
        timeseries(
            "vLLM read errors",
            "Failed reads of each vLLM /metrics per second, by reason (connect, timeout, "
            "http_status, parse, ...); 0 when none.",
            "suffix: errors/s",
            [
                target(
                    f"sum by (target, reason) (rate({families.ENGINE_SCRAPE_ERRORS.total}"
                    f"{vllm_targets}[{RATE}]))\nor\n"
                    f"sum by (target) ({families.ENGINE_UP.series}{vllm_targets}) * 0",
                    "{{target}} {{reason}}",
                )
            ],
        ),
        6,
        6,
    )
    layout.add(
        timeseries(
            "Usage events",
            "Per-request usage records accepted per second by each reader, those rejected (by "
            "reason; 0 when none), and those counted under the caller cap's overflow bucket.",
            "suffix: events/s",
            [
                target(f"sum by (reader) (rate({events}{jobs}[{RATE}]))", "{{reader}} accepted"),
                target(
                    f"sum by (reader, reason) (rate({families.USAGE_EVENTS_REJECTED.total}{jobs}"
                    f"[{RATE}]))\nor\nsum by (reader) (rate({events}{jobs}[{RATE}])) * 0",
                    "{{reader}} rejected {{reason}}",
                ),
                target(
                    f"sum(rate({families.CALLERS_OVERFLOWED.total}{jobs}[{RATE}]))",
                    "over the caller cap",
                ),
            ],
        ),
        6,
        6,
    )


def _residency_row(layout: Layout, queries: _Queries) -> None:
    """What vLLM's sampled evictions say (vLLM started with --kv-cache-metrics)."""
    names, engines = queries.names, queries.engines
    layout.row("KV residency (vLLM with --kv-cache-metrics)")
    layout.add(
        timeseries(
            "KV blocks: lifetime, idle before eviction, reuse gap",
            "Medians over the blocks vLLM sampled and evicted: lifetime (allocation to eviction), "
            "idle before eviction (last prefix-cache hit to eviction) and the gap between hits on "
            "a block. Blocks evicted after less idle than the reuse gap went before their "
            "conversation came back; a reuse-gap line that vanishes while evictions go on means "
            "no evicted block had been hit since it was computed. Empty when vLLM runs without "
            '--kv-cache-metrics (see "vLLM metrics present") or evicts nothing.',
            "s",
            [
                target(
                    f"{names.target_kv_block_median[histogram]}{engines}",
                    f"{{{{target}}}} {{{{model_name}}}} {label}",
                )
                for histogram, label in (
                    ("lifetime", "lifetime"),
                    ("idle_before_evict", "idle before eviction"),
                    ("reuse_gap", "reuse gap"),
                )
            ],
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "Evicted before reuse",
            "Share of the evicted blocks' lifetime they sat idle before eviction (sampled "
            "blocks). Near 100% with a falling hit ratio: blocks are evicted before any turn "
            "comes back to them, the KV pool is too small for the conversations it holds. It "
            "trails the hit ratio by minutes, so the collapse alert stays on the ratio.",
            "percentunit",
            [target(f"{names.target_kv_block_idle_share}{engines}", "{{target}} {{model_name}}")],
            min_value=0,
            max_value=1,
        ),
        6,
        8,
    )
    by_target = "sum by (target, model_name) (rate("
    layout.add(
        timeseries(
            "Sampled evictions and reuses",
            "Sampled blocks evicted per second, and hits on them per second (reuse gaps seen at "
            "their eviction, 3 at most per block). Multiply by 1 / --kv-cache-metrics-sample "
            "(default 100) for the whole pool.",
            "suffix: /s",
            [
                target(
                    f"{by_target}{families.ENGINE_KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS.count}"
                    f"{engines}[{RATE}]))",
                    "{{target}} {{model_name}} evicted",
                ),
                target(
                    f"{by_target}{families.ENGINE_KV_BLOCK_REUSE_GAP_SECONDS.count}"
                    f"{engines}[{RATE}]))",
                    "{{target}} {{model_name}} reuse gaps",
                ),
            ],
        ),
        6,
        8,
    )


def _sources_row(layout: Layout, queries: _Queries) -> None:
    """Where prompt tokens came from: computed, vLLM's own cache, or a KV connector."""
    names, engines = queries.names, queries.engines
    layout.row("Where prompt tokens come from")
    layout.add(
        timeseries(
            "Prompt tokens by source",
            "Prompt tokens per second by where their KV came from: local_compute (prefilled), "
            "local_cache_hit (vLLM's prefix cache) or external_kv_transfer (loaded through a KV "
            "connector: LMCache, CPU offloading, a prefill server). vLLM 0.16 and later.",
            TOKENS_PER_SECOND,
            [
                target(
                    f"{names.target_source_prompt}{engines}", "{{target}} {{model_name}} {{source}}"
                )
            ],
            stacked=True,
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Cached tokens by tier",
            "Share of the cached prompt tokens each cache tier supplied: device (GPU memory), "
            "host (offloaded to CPU memory), disk, p2p (another vLLM), external_unspecified. "
            "vLLM 0.32 and later.",
            "percentunit",
            [
                target(
                    f"{names.target_source_cached_share}{engines}",
                    "{{target}} {{model_name}} {{source}}",
                )
            ],
            stacked=True,
            min_value=0,
            max_value=1,
        ),
        8,
        8,
    )
    by_target = "sum by (target, model_name) (rate("
    layout.add(
        timeseries(
            "External KV cache (connector)",
            "Prompt tokens per second vLLM looked up in a KV connector's cache after its own, and "
            "those the connector supplied. 0 without a connector.",
            TOKENS_PER_SECOND,
            [
                target(
                    f"{by_target}{families.ENGINE_EXTERNAL_PREFIX_CACHE_QUERIES_TOKENS.total}"
                    f"{engines}[{RATE}]))",
                    "{{target}} {{model_name}} looked up",
                ),
                target(
                    f"{by_target}{families.ENGINE_EXTERNAL_PREFIX_CACHE_HITS_TOKENS.total}"
                    f"{engines}[{RATE}]))",
                    "{{target}} {{model_name}} found",
                ),
            ],
        ),
        8,
        8,
    )


def _cross_check_row(layout: Layout, queries: _Queries) -> None:
    """The engine against the callers: its prefill rate (what the callers' saved and lost
    minutes are priced at), the prompt tokens no caller sent through the exporters, and the
    hits vLLM counted more than once."""
    config, names, engines = queries.config, queries.names, queries.engines
    long = config.long_window
    layout.row("Engine against callers")
    layout.add(
        timeseries(
            "Prefill rate",
            f"Prompt tokens each vLLM computed per second of prefill, over the last {long} "
            "(its prompt tokens less the cached ones, over its requests' prefill seconds), and "
            "per model over every vLLM serving it: the rate the caller dashboard prices saved "
            "and lost prefill at. Prefill time includes other requests batched alongside; "
            "longer contexts prefill more slowly per token. Empty before vLLM 0.16.",
            TOKENS_PER_SECOND,
            [
                target(f"{names.target_prefill_rate}{engines}", "{{target}} {{model_name}}"),
                target(
                    f"{names.model_prefill_rate}{queries.filters.job(MODEL_NAME)}",
                    "{{model_name}} (every vLLM)",
                ),
            ],
            min_value=0,
        ),
        6,
        8,
    )
    layout.add(
        timeseries(
            "Prompt tokens that bypassed the exporter",
            f"Share of each vLLM's prompt tokens, over the last {long}, that no caller sent "
            "through the exporters: its prompt tokens less those the callers' usage attributes "
            "to it (by target), never below 0. Only for vLLMs some usage names; none means no "
            "line, not 100%. A high share: clients that call vLLM directly, or a proxy whose "
            "usage does not name the replica; usage without a cached count counts as bypassed.",
            "percentunit",
            [target(f"{names.target_bypassed_share}{engines}", "{{target}} {{model_name}}")],
            min_value=0,
            max_value=1,
        ),
        6,
        8,
    )
    layout.add(
        timeseries(
            "Bypassed prompt tokens",
            f"The same in tokens per second, over the last {long}, beside each vLLM's prompt "
            "tokens.",
            TOKENS_PER_SECOND,
            [
                target(f"{names.target_bypassed}{engines}", "{{target}} {{model_name}} bypassed"),
                target(f"{names.target_prompt}{engines}", "{{target}} {{model_name}} all"),
            ],
            min_value=0,
        ),
        6,
        8,
    )
    layout.add(
        timeseries(
            "Hits counted more than once",
            f"Prefix-cache hits per second, over the last {config.short_window}, that vLLM "
            "counted at admission beyond the local cache hits it counts once per request at "
            "the first token (by source where vLLM splits them, else all cached tokens), never "
            "below 0. Above 0 the engine's hit ratio reads better than its callers': a request "
            "admitted again after a failed KV allocation, or a vLLM before the fix for "
            "re-admitted preempted requests. Near 0 on current vLLM; small wobbles are the two "
            "counters' different moments.",
            TOKENS_PER_SECOND,
            [target(f"{names.target_hits_recounted}{engines}", "{{target}} {{model_name}}")],
            min_value=0,
        ),
        6,
        8,
    )


def _phases_row(layout: Layout, engines: str) -> None:
    """Where a slow turn spent its time inside vLLM when the cache did hold."""
    layout.row("Time inside vLLM")
    layout.add(
        timeseries(
            "Request phases",
            "Median and 95th percentile of finished requests' time in vLLM's queue (arrival to "
            "first scheduled), prefill (first scheduled to first token, preemptions included) "
            "and decode (first to last token). A slow turn whose cache held spent it here; vLLM's "
            "buckets start at 0.3 s.",
            "s",
            [
                target(
                    f"histogram_quantile({quantile}, sum by (le) (rate("
                    f"{family.bucket}{engines}[{RATE}])))",
                    f"{label} {phase}",
                )
                for phase, family in (
                    ("queue", families.ENGINE_REQUEST_QUEUE_TIME_SECONDS),
                    ("prefill", families.ENGINE_REQUEST_PREFILL_TIME_SECONDS),
                    ("decode", families.ENGINE_REQUEST_DECODE_TIME_SECONDS),
                )
                for label, quantile in QUANTILES
            ],
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "Inter-token latency",
            "Median and 95th percentile of the time between output tokens.",
            "s",
            [
                target(
                    f"histogram_quantile({quantile}, sum by (le) (rate("
                    f"{families.ENGINE_INTER_TOKEN_LATENCY_SECONDS.bucket}{engines}[{RATE}])))",
                    label,
                )
                for label, quantile in QUANTILES
            ],
        ),
        6,
        8,
    )
    layout.add(
        timeseries(
            "Waiting requests by reason",
            "Requests waiting in vLLM: for capacity (KV or batch room) or deferred (LoRA budget, "
            "a pending KV transfer). vLLM 0.20 and later.",
            "short",
            [
                target(
                    "sum by (target, model_name, reason) "
                    f"({families.ENGINE_REQUESTS_WAITING_BY_REASON.series}{engines})",
                    "{{target}} {{model_name}} {{reason}}",
                )
            ],
            stacked=True,
        ),
        6,
        8,
    )


def _unit_override(field: str, unit: str) -> dict[str, object]:
    return {
        "matcher": {"id": "byName", "options": field},
        "properties": [{"id": "unit", "value": unit}],
    }


def _engine_first_median(queries: _Queries) -> str:
    """Median TTFT of a caller's classified turns for a one-row-per-caller table: vLLM's own
    where it measured turns in the window (``>= 0`` drops the NaN of a window without
    any), else the proxy's. Never both summed into one distribution."""

    def median(source: str) -> str:
        return (
            f"histogram_quantile(0.5, sum by (caller, model, le) ("
            f"{queries.names.caller_state_ttft_bucket}"
            f"{queries.filters.caller(CLASSIFIED, source)}))"
        )

    engine, proxy = median('source="engine"'), median('source!="engine"')
    return f"({engine} >= 0)\nor\n{proxy}"
