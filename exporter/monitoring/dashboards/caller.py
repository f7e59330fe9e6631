"""Per-caller drill-down: one agent's cache, turns and waits, and the collapse alert's view.

The hit-ratio panel draws exactly what VllmCachePrefixCollapse compares (the recorded short
and long window ratios and the line the short one must stay under), so an operator who is
paged lands on the reason. The token panel splits the caller's prompt into cached, recomputed
and unreported, which answers "is it the cache, or is vLLM not telling us".
"""

from __future__ import annotations

from grafanalib import core as g

from exporter import families
from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.dashboards.panels import (
    RATE,
    TOKENS_PER_SECOND,
    Filters,
    Layout,
    alert_below,
    caller_hit_ratio_stat,
    dashboard,
    job_variable,
    query_variable,
    stat,
    target,
    timeseries,
    topology_variables,
    warm_share_stat,
)
from exporter.monitoring.promql import PromQL, hit_ratio, number, over, share
from exporter.monitoring.rules import QUANTILES, Names

FILENAME = "vllm-cache-caller.json"
TITLE = "vLLM prefix cache: caller"

CLASSIFIED = PromQL.states_matcher()
WARM = 'state="warm"'
COLD = 'state="cold"'
SOURCES = (
    "One series per source: engine is vLLM's own (scheduled to first token, vLLM with "
    "--enable-per-request-metrics), proxy the proxy's TTFT minus its admission wait "
    "(vLLM's queue still in it)."
)


def variables(config: MonitoringConfig) -> list[g.Template]:
    filters = Filters(config)
    return [
        *topology_variables(config),
        job_variable(config),
        query_variable(
            "model", "Model", f"label_values({families.REQUESTS.total}{filters.job()}, model)"
        ),
        query_variable(
            "caller", "Caller", f"label_values({families.REQUESTS.total}{filters.model()}, caller)"
        ),
    ]


def build(config: MonitoringConfig) -> g.Dashboard:
    filters = Filters(config)
    names = Names(config)
    layout = Layout()
    _now_row(layout, config, filters, names)
    _cache_row(layout, config, filters, names)
    _prefill_row(layout, config, filters, names)
    _waiting_row(layout, filters)
    _prompt_order_row(layout, config, filters, names)
    return dashboard(
        config,
        TITLE,
        config.caller_uid,
        "One caller's prefix-cache hit ratio against the collapse alert's baseline, its turns "
        "by cache outcome, time to first token and admission wait, and its prompt order, "
        "from vllm-cache-exporter.",
        variables(config),
        layout,
    )


def _now_row(layout: Layout, config: MonitoringConfig, filters: Filters, names: Names) -> None:
    callers = filters.caller()
    short = names.short

    def ttft_median(state: str) -> str:
        # One value per source: vLLM's own and the proxy's are never one distribution.
        return (
            f"histogram_quantile(0.5, sum by (source, le) ("
            f"{names.caller_state_ttft_bucket}{filters.caller(state)}))"
        )

    layout.row("Now")
    layout.add(
        caller_hit_ratio_stat(
            config,
            "Hit ratio",
            "Share of the selected callers' prompt tokens served from the prefix cache",
        ),
        4,
        5,
    )
    layout.add(
        warm_share_stat(
            config, "Warm turns", "Share of warm turns among warm, partial and cold ones."
        ),
        4,
        5,
    )
    layout.add(
        stat(
            "Turns per second",
            "Requests per second from the selected callers, all states.",
            "reqps",
            [target(f"sum({names.caller_state_requests}{callers})")],
        ),
        4,
        5,
    )
    layout.add(
        stat(
            "Median TTFT, warm turns",
            "Engine-side median time to first token of warm turns: seconds when the cache holds. "
            f"{SOURCES}",
            "s",
            [target(ttft_median(WARM), "{{source}}")],
        ),
        4,
        5,
    )
    layout.add(
        stat(
            "Median TTFT, cold turns",
            "Engine-side median time to first token of cold turns: what every turn costs once "
            f"the cache is lost. {SOURCES}",
            "s",
            [target(ttft_median(COLD), "{{source}}")],
        ),
        4,
        5,
    )
    unreported = f"(sum({names.caller_unreported[short]}{callers}) or vector(0))"
    layout.add(
        stat(
            "Unreported prompt tokens",
            "Share of prompt tokens whose response did not say how many were cached. Near 100% "
            "means vLLM runs without --enable-prompt-tokens-details.",
            "percentunit",
            [
                target(
                    share(unreported, f"{unreported} + sum({names.caller_prompt[short]}{callers})")
                )
            ],
            thresholds=[("green", None), ("orange", 0.1), ("red", 0.5)],
        ),
        4,
        5,
    )


def _cache_row(layout: Layout, config: MonitoringConfig, filters: Filters, names: Names) -> None:
    callers = filters.caller()
    short = names.short
    baseline = names.caller_hit_ratio[names.baseline]
    layout.row("Cache")
    layout.add(
        timeseries(
            "Hit ratio against its baseline",
            f"What VllmCachePrefixCollapse compares: the recorded {config.short_window} hit ratio "
            f"must stay under {number(config.collapse_drop_factor)} x the baseline (the 90th "
            f"percentile over {config.baseline_window} of the {config.long_window} ratio; the "
            f"'alert below' line) for {config.collapse_for}, with the baseline above "
            f"{number(config.collapse_min_baseline)} and the caller still sending prompt tokens. "
            "The thin line is the ratio at the dashboard's own resolution.",
            "percentunit",
            [
                target(
                    hit_ratio(
                        f"sum by (caller, model) (rate({families.CACHED_TOKENS.total}"
                        f"{callers}[{RATE}]))",
                        f"sum by (caller, model) (rate({families.PROMPT_TOKENS.total}"
                        f"{callers}[{RATE}]))",
                    ),
                    "{{caller}} {{model}}",
                ),
                target(
                    f"{names.caller_hit_ratio[names.short]}{callers}",
                    f"{{{{caller}}}} {{{{model}}}} {config.short_window}",
                ),
                target(f"{baseline}{callers}", "{{caller}} {{model}} baseline"),
                alert_below(config, f"{baseline}{callers}", "{{caller}} {{model}}"),
            ],
            min_value=0,
            max_value=1,
        ),
        24,
        9,
    )
    layout.add(
        timeseries(
            "Hit ratio per replica",
            f"The caller's recorded {config.short_window} hit ratio on each vLLM replica "
            "(target) that served it, for the requests whose usage names one. Behind a gateway "
            "a caller's cache lives on the replica that served it: one replica that keeps "
            "evicting it barely moves the ratio above. VllmCachePrefixCollapse "
            "(scope=\"caller_target\") fires when a replica's line stays under the caller's "
            f"'alert below' line for {config.collapse_for}, with the caller still sending that "
            "replica prompt tokens and not collapsed on every replica.",
            "percentunit",
            [
                target(
                    f"{names.caller_target_hit_ratio}{callers}",
                    "{{caller}} {{model}} {{target}}",
                ),
                alert_below(config, f"{baseline}{callers}", "{{caller}} {{model}}"),
            ],
            min_value=0,
            max_value=1,
        ),
        24,
        9,
    )
    layout.add(
        timeseries(
            "Prompt tokens: cached, recomputed, unreported",
            "The caller's prompt tokens per second: served from the cache, recomputed, and those "
            "whose response did not report a cached count (then the hit ratio cannot be known).",
            TOKENS_PER_SECOND,
            [
                target(
                    f"sum by (caller) ({names.caller_cached[short]}{callers})", "{{caller}} cached"
                ),
                target(
                    f"sum by (caller) ({names.caller_prompt[short]}{callers})\n-\n"
                    f"sum by (caller) ({names.caller_cached[short]}{callers})",
                    "{{caller}} recomputed",
                ),
                target(
                    f"sum by (caller) ({names.caller_unreported[short]}{callers})\nor\n"
                    f"sum by (caller) ({names.caller_state_requests}{callers}) * 0",
                    "{{caller}} unreported",
                ),
            ],
            stacked=True,
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "Turns by state",
            "Requests per second by cache outcome: warm, partial, cold, short (too short for one "
            "granule), unknown (cached tokens not reported), error.",
            "reqps",
            [
                target(
                    f"sum by (caller, state) ({names.caller_state_requests}{callers})",
                    "{{caller}} {{state}}",
                )
            ],
            stacked=True,
            bars=True,
        ),
        12,
        8,
    )


def _prefill_row(layout: Layout, config: MonitoringConfig, filters: Filters, names: Names) -> None:
    """What the cache is worth to the caller in prefill time, and why its misses missed."""
    callers = filters.caller()
    minutes_per_hour = "60 * sum by (caller, model) "
    layout.row("Prefill time and misses")
    layout.add(
        timeseries(
            "Prefill time saved and lost",
            f"Minutes of prefill per hour, over the last {config.long_window}: saved is the "
            "caller's cached tokens at the prefill rate its model's vLLMs measured (prompt "
            "tokens they computed over the seconds their requests spent in prefill), lost its "
            "tokens missed because their prefix had been evicted, at the same rate. An "
            "estimate: prefill time includes other requests batched alongside, and attention "
            "costs more per token the longer the context, so a long conversation's saved "
            "minutes are a floor. No line where no vLLM serves the caller's model under that "
            "name; no lost line without the missed-tokens series (a caller under __other__).",
            "suffix: min/h",
            [
                target(
                    f"{minutes_per_hour}({names.caller_prefill_saved}{callers})",
                    "{{caller}} {{model}} saved",
                ),
                target(
                    f"{minutes_per_hour}({names.caller_prefill_lost}{callers})",
                    "{{caller}} {{model}} lost to evictions",
                ),
            ],
            min_value=0,
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "Why it missed",
            "Prompt tokens per second not served from the prefix cache, by cause (new, "
            "evicted, order, granule, caching_off, unreported, unknown; docs/metrics.md says "
            "what each means). Summed: prompt less cached tokens plus the unreported ones. "
            "Per caller for the exporter's detailed callers only; the others are summed under "
            'caller="__other__". The evicted tokens are what the lost minutes beside it price.',
            TOKENS_PER_SECOND,
            [
                target(
                    f"sum by (caller, cause) (rate({families.MISSED_PROMPT_TOKENS.total}"
                    f"{callers}[{RATE}]))",
                    "{{caller}} {{cause}}",
                )
            ],
            stacked=True,
        ),
        12,
        8,
    )


def _waiting_row(layout: Layout, filters: Filters) -> None:
    callers = filters.caller()
    layout.row("Waiting")
    layout.add(
        timeseries(
            "Time to first token by state",
            "Engine-side time to first token, median and 95th percentile, per cache outcome. "
            "Seconds means the cache held; a minute means it was evicted "
            "(VllmCacheWarmTTFTCollapse watches the median of turns that should be warm, vLLM's "
            f"own where there is one). {SOURCES}",
            "s",
            # At the dashboard's resolution and per exporter instance, as the queue wait beside
            # it (the recorded bucket rates sum instances away and hold only the rule's window).
            [
                target(
                    f"histogram_quantile({quantile}, sum by (caller, state, source, le) (rate("
                    f"{families.TTFT_SECONDS.bucket}{filters.caller(CLASSIFIED)}[{RATE}])))",
                    f"{{{{caller}}}} {{{{state}}}} {{{{source}}}} {label}",
                )
                for label, quantile in QUANTILES
            ],
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "Admission queue wait",
            "Time requests waited before vLLM started reading their prompt, median and 95th "
            "percentile, per queue: proxy is the admission gate in front of vLLM (its "
            "queue_seconds), engine is vLLM's own scheduler queue (vLLM with "
            "--enable-per-request-metrics). A request can wait in both. Long waits with fast "
            "engine TTFT mean a queue, not the cache, is the bottleneck.",
            "s",
            [
                target(
                    f"histogram_quantile({quantile}, sum by (caller, source, le) (rate("
                    f"{families.QUEUE_WAIT_SECONDS.bucket}{callers}[{RATE}])))",
                    f"{{{{caller}}}} {{{{source}}}} {label}",
                )
                for label, quantile in QUANTILES
            ],
        ),
        12,
        8,
    )


def _prompt_order_row(
    layout: Layout, config: MonitoringConfig, filters: Filters, names: Names
) -> None:
    """Prompt order at the dashboard's resolution (the rules record only the long window's,
    drawn beside it)."""
    callers = filters.caller()
    layout.row("Prompt order (the tap)")

    def rate(family: families.Family) -> str:
        return f"sum by (caller, model) (rate({family.total}{callers}[{RATE}]))"

    def per_flagged(family: families.Family) -> str:
        return over(rate(family), rate(families.PROMPT_ORDER_VARIABLE_TOP))

    layout.add(
        timeseries(
            "Requests sharing their text but not its beginning",
            "Share of the requests the tap compared with a recent one of the same caller and "
            "model that share most of their text with it but not its beginning: something "
            "variable (a per-agent task, a timestamp, a request id) sits at the top of the "
            "prompt, so the prefix cache reuses none of the shared text. 0 is the good layout "
            f"(or unrelated prompts). VllmCachePromptVariableTop fires above "
            f"{number(config.prompt_order_share)} of the {config.long_window} figure for "
            f"{config.prompt_order_for}. Only the tap sees prompts: callers reported another way "
            "have no line.",
            "percentunit",
            [
                target(
                    over(
                        rate(families.PROMPT_ORDER_VARIABLE_TOP),
                        rate(families.PROMPT_ORDER_COMPARED),
                    ),
                    "{{caller}} {{model}}",
                ),
                target(
                    f"{names.caller_order_share}{callers}",
                    f"{{{{caller}}}} {{{{model}}}} {config.long_window}",
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
            "Shared text and first difference",
            "Of those requests: how much text they share with the recent one (~N characters, as "
            "bytes of the prompt's JSON), and within how many characters from the start they "
            "first differ (M: the variable part sits before it). M of a few hundred is the first "
            "line (a timestamp, an id); M about the size of the per-agent part means that part "
            "comes first.",
            "short",
            [
                target(
                    per_flagged(families.PROMPT_ORDER_SHARED_BYTES), "{{caller}} {{model}} shared"
                ),
                target(
                    per_flagged(families.PROMPT_ORDER_FIRST_DIFFERENCE_BYTES),
                    "{{caller}} {{model}} differs within",
                ),
            ],
            min_value=0,
        ),
        12,
        8,
    )
