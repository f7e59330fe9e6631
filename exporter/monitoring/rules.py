"""Recording rules, named ``level:metric:operations``.

Every ratio is a ratio of summed rates: the numerator and the denominator are each summed
over the labels that do not matter (instance, engine rank, replica) BEFORE dividing, and the
denominator carries a ``> 0`` guard so an idle window yields no sample instead of NaN or a
fake 0. Averaging per-replica ratios would weigh a replica that served ten tokens like one that
served a million; a lifetime ratio (no rate) would take hours to notice a collapse.

Where a numerator's series may not exist yet (a caller that never had a warm turn, an
exporter that just restarted), ``(numerator or denominator * 0)`` makes it an honest 0 for
every label set the denominator has, so a ratio falls to 0 instead of vanishing.

Rules inside one group are evaluated in order at the same timestamp, so later rules read the
rates recorded just before them and a ratio is computed from exactly the rates it shows.

At a platform's scale (ten thousand callers times every model) a rule costs Prometheus the
series it reads at each evaluation, so the per-caller rules are grouped by how often they
must run: the collapse alert's short-window ratio every ``caller_interval``, the rest of the
short window every ``caller_detail_interval``, the long windows and baselines every
``caller_long_interval`` (docs/monitoring.md, "What the rules cost"; bench/bench_rules.py).
"""

from __future__ import annotations

import re
from typing import Any

from exporter import families
from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.promql import PromQL, guarded, hit_ratio, over, ratio, warm_share

CALLER = ("caller", "model")
# One caller on one vLLM replica: ``target`` is the engine series' own label, so these join
# the ``target_model:*`` series.
CALLER_TARGET = ("caller", "model", "target")
CALLER_STATE = ("caller", "model", "state")
TARGET = ("target", "model_name")
MODEL = ("model_name",)
CALLER_MODEL = ("model",)
TARGET_SOURCE = ("target", "model_name", "source")
# The KV-residency histograms whose median is recorded, by the name part they share.
KV_BLOCK_HISTOGRAMS = {
    "idle_before_evict": families.ENGINE_KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS,
    "lifetime": families.ENGINE_KV_BLOCK_LIFETIME_SECONDS,
    "reuse_gap": families.ENGINE_KV_BLOCK_REUSE_GAP_SECONDS,
}

WARM = 'state="warm"'
EVICTED = 'cause="evicted"'
LOCAL_CACHE_HIT = 'source="local_cache_hit"'
NAMED_TARGET = 'target!="__other__"'  # __other__ is the exporter's overflow of targets
QUANTILES = (("p50", 0.5), ("p95", 0.95))
# What callers use of the completion budget they declare: the median, and the p99 an
# admission gate should charge instead of the declared figure.
COMPLETION_QUANTILES = (("p50", 0.5), ("p99", 0.99))
# The collapse alerts' baseline: this quantile, over ``baseline_window``, of the long-window
# ratio. High enough that the baseline is what the cache does when it works, low enough that
# one unusually good hour does not raise the bar.
BASELINE_QUANTILE = ("p90", 0.9)


class Names:
    """The recorded series' names for one configuration (windows are part of the names)."""

    def __init__(self, config: MonitoringConfig) -> None:
        short = PromQL.window_suffix(config.short_window)
        long = PromQL.window_suffix(config.long_window)
        # "p90_1d_rate1h": newest operation first, as Prometheus names recorded series.
        baseline = f"{BASELINE_QUANTILE[0]}_{config.baseline_window}_{long}"
        self.short, self.long, self.baseline = short, long, baseline
        self._caller_names(short, long, baseline)
        self._engine_names(config, short, long, baseline)

    def _caller_names(self, short: str, long: str, baseline: str) -> None:
        both = (short, long)
        # per caller
        self.caller_prompt = {
            window: f"caller_model:vllm_cache_prompt_tokens:{window}" for window in both
        }
        self.caller_cached = {
            window: f"caller_model:vllm_cache_cached_tokens:{window}" for window in both
        }
        self.caller_hit_ratio = {
            window: f"caller_model:vllm_cache_hit_ratio:{window}" for window in (*both, baseline)
        }
        self.caller_unreported = {
            window: f"caller_model:vllm_cache_unreported_prompt_tokens:{window}" for window in both
        }
        self.caller_state_requests = f"caller_model_state:vllm_cache_requests:{short}"
        # per caller and vLLM replica (target): a caller collapsed on one replica of many
        self.caller_target_prompt = f"caller_model_target:vllm_cache_prompt_tokens:{short}"
        self.caller_target_cached = f"caller_model_target:vllm_cache_cached_tokens:{short}"
        self.caller_target_hit_ratio = f"caller_model_target:vllm_cache_hit_ratio:{short}"
        # the warm share's two sides: warm turns, and classified ones (warm, partial, cold)
        self.caller_warm_requests = {
            window: f"caller_model:vllm_cache_warm_requests:{window}" for window in both
        }
        self.caller_classified_requests = {
            window: f"caller_model:vllm_cache_classified_requests:{window}" for window in both
        }
        self.caller_warm_share = {
            window: f"caller_model:vllm_cache_warm_request_share:{window}"
            for window in (*both, baseline)
        }
        self.caller_state_ttft_bucket = f"caller_model_state:vllm_cache_ttft_seconds_bucket:{short}"
        self.caller_state_ttft = {
            quantile: f"caller_model_state:vllm_cache_ttft_seconds:{quantile}_{short}"
            for quantile, _ in QUANTILES
        }
        # all classified turns of a caller: "turns that should be warm" when its baseline is
        self.caller_ttft = {
            quantile: f"caller_model:vllm_cache_ttft_seconds:{quantile}_{short}"
            for quantile, _ in QUANTILES
        }
        self.model_state_ttft = {
            quantile: f"model_state:vllm_cache_ttft_seconds:{quantile}_{short}"
            for quantile, _ in QUANTILES
        }
        # foresight: completion tokens declared vs used, per caller
        self.caller_completion_bucket = (
            f"caller_model:vllm_cache_completion_used_tokens_bucket:{long}"
        )
        self.caller_completion_used = {
            quantile: f"caller_model:vllm_cache_completion_used_tokens:{quantile}_{long}"
            for quantile, _ in COMPLETION_QUANTILES
        }
        self.caller_completion_declared = (
            f"caller_model:vllm_cache_completion_declared_tokens:mean_{long}"
        )
        self.caller_completion_used_mean = (
            f"caller_model:vllm_cache_completion_used_tokens:mean_{long}"
        )
        self.caller_completion_overstatement = (
            f"caller_model:vllm_cache_completion_overstatement:ratio_{long}"
        )
        # prompt order (the tap): requests sharing most of their text but not its beginning
        self.caller_order_compared = f"caller_model:vllm_cache_prompt_order_compared:{long}"
        self.caller_order_variable_top = f"caller_model:vllm_cache_prompt_order_variable_top:{long}"
        self.caller_order_share = f"caller_model:vllm_cache_prompt_order_variable_top_share:{long}"
        self.caller_order_shared_bytes = (
            f"caller_model:vllm_cache_prompt_order_shared_bytes:mean_{long}"
        )
        self.caller_order_first_difference = (
            f"caller_model:vllm_cache_prompt_order_first_difference_bytes:mean_{long}"
        )
        # prefill time: what the cache saved each caller, and what evictions cost it, in
        # seconds of the model's prefill per second
        self.caller_prefill_saved = f"caller_model:vllm_cache_prefill_seconds_saved:{long}"
        self.caller_prefill_lost = f"caller_model:vllm_cache_prefill_seconds_lost:{long}"

    def _engine_names(self, config: MonitoringConfig, short: str, long: str, baseline: str) -> None:
        both = (short, long)
        # per vLLM target (and fleet-wide per model)
        self.target_queries = {
            window: f"target_model:vllm_cache_engine_prefix_cache_queries_tokens:{window}"
            for window in both
        }
        self.target_hits = {
            window: f"target_model:vllm_cache_engine_prefix_cache_hits_tokens:{window}"
            for window in both
        }
        self.target_hit_ratio = {
            window: f"target_model:vllm_cache_engine_hit_ratio:{window}"
            for window in (*both, baseline)
        }
        self.model_hit_ratio = {
            window: f"model:vllm_cache_engine_hit_ratio:{window}" for window in both
        }
        self.target_kv_used_tokens = "target_model:vllm_cache_engine_kv_used_tokens:sum"
        self.target_kv_pool_tokens = "target_model:vllm_cache_engine_kv_pool_tokens:sum"
        self.target_kv_used_ratio = "target_model:vllm_cache_engine_kv_used:ratio"
        self.model_kv_used_ratio = "model:vllm_cache_engine_kv_used:ratio"
        self.target_preemptions = f"target_model:vllm_cache_engine_preemptions:{short}"
        self.model_preemptions = f"model:vllm_cache_engine_preemptions:{short}"
        # foresight: live conversations against the pool, the smallest pool and the budget
        pool_min = f"min{config.pool_min_window}"
        self.target_conversations = "target_model:vllm_cache_conversations_active:sum"
        self.target_demand = "target_model:vllm_cache_conversations_demand_tokens:sum"
        self.target_fit_ratio = "target_model:vllm_cache_conversations_fit:ratio"
        self.target_pool_min = f"target_model:vllm_cache_engine_kv_pool_min_tokens:{pool_min}"
        self.target_budget = f"target_model:vllm_cache_admission_budget_tokens:{pool_min}"
        # where prompt tokens came from, per vLLM target and source
        self.target_source_prompt = (
            f"target_model_source:vllm_cache_engine_prompt_tokens_by_source:{short}"
        )
        self.target_source_prompt_share = (
            f"target_model_source:vllm_cache_engine_prompt_tokens_source_share:{short}"
        )
        self.target_source_cached = (
            f"target_model_source:vllm_cache_engine_cached_tokens_by_source:{short}"
        )
        self.target_source_cached_share = (
            f"target_model_source:vllm_cache_engine_cached_tokens_source_share:{short}"
        )
        # KV residency (vLLM with --kv-cache-metrics), per vLLM target
        self.target_kv_block_median = {
            histogram: f"target_model:vllm_cache_engine_kv_block_{histogram}_seconds:p50_{short}"
            for histogram in KV_BLOCK_HISTOGRAMS
        }
        # several exporters behind one stream: turns whose history another exporter saw
        self.model_turns = f"model:vllm_cache_conversation_turns:{long}"
        self.model_unseen = f"model:vllm_cache_unseen_history_requests:{long}"
        self.model_unseen_share = f"model:vllm_cache_unseen_history_request_share:{long}"
        self.target_kv_block_idle_share = (
            f"target_model:vllm_cache_engine_kv_block_idle_lifetime_share:{short}"
        )
        # the engine's measured prefill rate: the prompt tokens it computed over its prefill time
        self.target_prompt = f"target_model:vllm_cache_engine_prompt_tokens:{long}"
        self.target_computed = f"target_model:vllm_cache_engine_computed_prompt_tokens:{long}"
        self.target_prefill_seconds = f"target_model:vllm_cache_engine_prefill_seconds:{long}"
        self.target_prefill_rate = (
            f"target_model:vllm_cache_engine_prefill_tokens_per_second:{long}"
        )
        self.model_prefill_rate = f"model:vllm_cache_engine_prefill_tokens_per_second:{long}"
        # cross-checks: prompt tokens no caller sent through the exporters, and hits vLLM
        # counted more than once per request
        self.target_callers_prompt = f"target:vllm_cache_target_prompt_tokens:{long}"
        self.target_bypassed = f"target_model:vllm_cache_engine_bypassed_prompt_tokens:{long}"
        self.target_bypassed_share = (
            f"target_model:vllm_cache_engine_bypassed_prompt_tokens_share:{long}"
        )
        self.target_hits_recounted = f"target_model:vllm_cache_engine_hits_recounted_tokens:{short}"


def _rule(record: str, expr: str) -> dict[str, Any]:
    return {"record": record, "expr": expr.strip()}


def _ratio(promql: PromQL, numerator: str, denominator: str) -> str:
    """numerator / denominator of two recorded series with the same labels, 0/0 guarded."""
    return ratio(f"{numerator}{promql.sel()}", f"{denominator}{promql.sel()}")


def _baseline(config: MonitoringConfig, promql: PromQL, ratio: str) -> str:
    """The ratio the cache holds when it works: a high quantile of the long-window ratio over
    ``baseline_window``, read at one instant every ``baseline_step`` (5 minutes of a day:
    288 instants, aligned to multiples of the step as the status page's are,
    exporter/signals/history.py), not at every evaluation: the same definition as the page
    and ``check``, and 288 samples a series read instead of one per evaluation (5,760 at
    15 s, which at ten thousand callers passes Prometheus' --query.max-samples).

    A collapse cannot become its own baseline until it has lasted most of that window (90%
    of its instants), so a page lasts as long as the collapse does; the long-window ratio it
    is taken from already smooths single cold turns, and hours without traffic have no ratio
    and no say. A plain long-window ratio as baseline absorbs a collapse within the hour.
    """
    return (
        f"quantile_over_time({BASELINE_QUANTILE[1]}, "
        f"{ratio}{promql.sel()}[{config.baseline_window}:{config.baseline_step}])"
    )


def _caller_rules(config: MonitoringConfig, promql: PromQL, names: Names) -> list[dict[str, Any]]:
    """What the collapse alert compares now, per caller, every ``caller_interval``: the
    short-window prompt and cached tokens and their ratio (the ratio reads the rates just
    recorded, so each rate is computed once). Nothing else per caller is evaluated this
    often: at ten thousand callers the cost of a rule is the series it reads, and these
    read two."""
    return _caller_token_rules(promql, names.short, config.short_window, names)[:3]


def _caller_detail_rules(
    config: MonitoringConfig, promql: PromQL, names: Names
) -> list[dict[str, Any]]:
    """The rest of the short window per caller, every ``caller_detail_interval`` (two
    minutes): unreported tokens, requests by state and the warm share, TTFT. Dashboards and
    the TTFT alert (for: 5m) read them; the requests alone are six series per caller."""
    window = config.short_window
    rules = _caller_token_rules(promql, names.short, window, names)[3:]
    rules.append(
        _rule(
            names.caller_state_requests,
            promql.sum_by(CALLER_STATE, f"rate({families.REQUESTS.total}{promql.sel()}[{window}])"),
        )
    )
    by_state = names.caller_state_requests
    rules.extend(
        _warm_share_rules(
            promql,
            names,
            names.short,
            f"sum {promql.by(*CALLER)} ({by_state}{promql.sel(WARM)})",
            f"sum {promql.by(*CALLER)} ({by_state}{promql.sel(promql.states_matcher())})",
        )
    )
    rules.extend(_ttft_rules(config, promql, names))
    rules.extend(_caller_target_rules(config, promql, names))
    return rules


def _caller_target_rules(
    config: MonitoringConfig, promql: PromQL, names: Names
) -> list[dict[str, Any]]:
    """Each caller's short-window tokens and hit ratio per vLLM replica (``target``). Behind a
    gateway a caller's cache lives on the replica that served it: one replica that keeps
    evicting it hides in the caller's ratio over all of them, which the healthy replicas keep
    above half its baseline. Recorded every ``caller_detail_interval``, with the alert that
    reads them: per caller they are a series per replica, the most the rules read."""
    window = config.short_window

    def rate(family: families.Family) -> str:
        return promql.sum_by(CALLER_TARGET, f"rate({family.total}{promql.sel()}[{window}])")

    return [
        _rule(names.caller_target_prompt, rate(families.TARGET_PROMPT_TOKENS)),
        _rule(names.caller_target_cached, rate(families.TARGET_CACHED_TOKENS)),
        _rule(
            names.caller_target_hit_ratio,
            hit_ratio(
                names.caller_target_cached + promql.sel(),
                names.caller_target_prompt + promql.sel(),
            ),
        ),
    ]


def _caller_long_rules(
    config: MonitoringConfig, promql: PromQL, names: Names
) -> list[dict[str, Any]]:
    """Per caller over the long window, and the baselines over the baseline window: its own
    group, evaluated every ``caller_long_interval`` (two minutes), since an hour's rate moves
    little in a minute and, per caller, these are most of what the rules cost. The baselines
    come last, so they read the long-window ratios just recorded."""
    window = config.long_window
    rules = _caller_token_rules(promql, names.long, window, names)
    rules.extend(_prefill_caller_rules(config, promql, names))
    rules.extend(_bypass_rules(config, promql, names))
    requests = families.REQUESTS.total
    rules.extend(
        _warm_share_rules(
            promql,
            names,
            names.long,
            promql.sum_by(CALLER, f"rate({requests}{promql.sel(WARM)}[{window}])"),
            promql.sum_by(
                CALLER, f"rate({requests}{promql.sel(promql.states_matcher())}[{window}])"
            ),
        )
    )
    rules.extend(_unseen_history_rules(config, promql, names))
    rules.extend(_completion_rules(config, promql, names))
    rules.extend(_prompt_order_rules(config, promql, names))
    rules.append(
        _rule(
            names.caller_hit_ratio[names.baseline],
            _baseline(config, promql, names.caller_hit_ratio[names.long]),
        )
    )
    rules.append(
        _rule(
            names.caller_warm_share[names.baseline],
            _baseline(config, promql, names.caller_warm_share[names.long]),
        )
    )
    return rules


def _caller_token_rules(
    promql: PromQL, suffix: str, window: str, names: Names
) -> list[dict[str, Any]]:
    """Prompt and cached tokens per caller over one window, the hit ratio of the two rates
    just recorded, and the unreported tokens (last: the short window's are not in the
    collapse alert's group)."""
    return [
        _rule(
            names.caller_prompt[suffix],
            promql.sum_by(CALLER, f"rate({families.PROMPT_TOKENS.total}{promql.sel()}[{window}])"),
        ),
        _rule(
            names.caller_cached[suffix],
            promql.sum_by(CALLER, f"rate({families.CACHED_TOKENS.total}{promql.sel()}[{window}])"),
        ),
        _rule(
            names.caller_hit_ratio[suffix],
            hit_ratio(
                names.caller_cached[suffix] + promql.sel(),
                names.caller_prompt[suffix] + promql.sel(),
            ),
        ),
        _rule(
            names.caller_unreported[suffix],
            promql.sum_by(
                CALLER,
                f"rate({families.UNREPORTED_PROMPT_TOKENS.total}{promql.sel()}[{window}])",
            ),
        ),
    ]


def _warm_share_rules(
    promql: PromQL, names: Names, suffix: str, warm: str, classified: str
) -> list[dict[str, Any]]:
    """The warm share of a window: warm turns and classified turns (warm, partial, cold) per
    caller, each summed once, then their ratio. Short (too small for one granule), unknown
    (cached tokens not reported) and error turns say nothing about the cache, so they are
    out of the denominator."""
    warm_name = names.caller_warm_requests[suffix]
    classified_name = names.caller_classified_requests[suffix]
    return [
        _rule(warm_name, warm),
        _rule(classified_name, classified),
        _rule(
            names.caller_warm_share[suffix],
            warm_share(warm_name + promql.sel(), classified_name + promql.sel()),
        ),
    ]


def _ttft_rules(config: MonitoringConfig, promql: PromQL, names: Names) -> list[dict[str, Any]]:
    """TTFT per caller, state and source, over the short window. The exporter keeps TTFT
    per caller only for its detailed callers, and sums every other one under
    ``caller="__other__"``, so the per-caller quantiles cover those; the per-model ones sum
    the buckets of every caller (the histograms, never their quantiles) first. TTFT keeps
    its source (vLLM's own, or the proxy's): two ways of measuring, never summed into one
    distribution."""
    classified = promql.states_matcher()
    rules = [
        _rule(
            names.caller_state_ttft_bucket,
            promql.sum_by(
                (*CALLER_STATE, "source", "le"),
                f"rate({families.TTFT_SECONDS.bucket}"
                f"{promql.sel(classified)}[{config.short_window}])",
            ),
        )
    ]
    # ">= 0" drops the NaN histogram_quantile returns for a window without requests.
    for name, quantile in QUANTILES:
        rules.append(
            _rule(
                names.caller_state_ttft[name],
                f"histogram_quantile({quantile}, "
                f"{names.caller_state_ttft_bucket}{promql.sel()}) >= 0",
            )
        )
    for name, quantile in QUANTILES:
        rules.append(
            _rule(
                names.caller_ttft[name],
                f"histogram_quantile({quantile}, "
                f"sum {promql.by(*CALLER, 'source', 'le')} "
                f"({names.caller_state_ttft_bucket}{promql.sel()})) >= 0",
            )
        )
    for name, quantile in QUANTILES:
        rules.append(
            _rule(
                names.model_state_ttft[name],
                f"histogram_quantile({quantile}, "
                f"sum {promql.by('model', 'state', 'source', 'le')} "
                f"({names.caller_state_ttft_bucket}{promql.sel()})) >= 0",
            )
        )
    return rules


def _prompt_order_rules(
    config: MonitoringConfig, promql: PromQL, names: Names
) -> list[dict[str, Any]]:
    """Prompt order per caller, over the long window (a fan-out comes in bursts): the share
    of compared requests that share most of their text with a recent one but not its
    beginning, and, of those, the mean shared length and where they first differ."""
    window = config.long_window

    def rate(family: families.Family) -> str:
        return promql.sum_by(CALLER, f"rate({family.total}{promql.sel()}[{window}])")

    flagged = names.caller_order_variable_top
    return [
        _rule(names.caller_order_compared, rate(families.PROMPT_ORDER_COMPARED)),
        _rule(flagged, rate(families.PROMPT_ORDER_VARIABLE_TOP)),
        _rule(names.caller_order_share, _ratio(promql, flagged, names.caller_order_compared)),
        _rule(
            names.caller_order_shared_bytes,
            over(rate(families.PROMPT_ORDER_SHARED_BYTES), flagged + promql.sel()),
        ),
        _rule(
            names.caller_order_first_difference,
            over(rate(families.PROMPT_ORDER_FIRST_DIFFERENCE_BYTES), flagged + promql.sel()),
        ),
    ]


def _unseen_history_rules(
    config: MonitoringConfig, promql: PromQL, names: Names
) -> list[dict[str, Any]]:
    """Per model, over the long window: the share of turns whose cached tokens the
    exporter's memory of their conversation cannot explain, summed over every exporter
    before dividing (each counts the turns it misread)."""
    window = config.long_window
    turns, unseen = families.CONVERSATION_TURNS, families.UNSEEN_HISTORY_REQUESTS
    return [
        _rule(
            names.model_turns,
            promql.sum_by(CALLER_MODEL, f"rate({turns.total}{promql.sel()}[{window}])"),
        ),
        _rule(
            names.model_unseen,
            promql.sum_by(CALLER_MODEL, f"rate({unseen.total}{promql.sel()}[{window}])"),
        ),
        _rule(names.model_unseen_share, _ratio(promql, names.model_unseen, names.model_turns)),
    ]


def _completion_rules(
    config: MonitoringConfig, promql: PromQL, names: Names
) -> list[dict[str, Any]]:
    """Declared vs used completion tokens per caller, over the long window: an admission gate
    that charges the declared max_tokens holds a fraction of the conversations it could."""
    window = config.long_window
    rules = [
        _rule(
            names.caller_completion_bucket,
            promql.sum_by(
                (*CALLER, "le"),
                f"rate({families.COMPLETION_USED_TOKENS.bucket}{promql.sel()}[{window}])",
            ),
        )
    ]
    for name, quantile in COMPLETION_QUANTILES:
        rules.append(
            _rule(
                names.caller_completion_used[name],
                f"histogram_quantile({quantile}, "
                f"{names.caller_completion_bucket}{promql.sel()}) >= 0",
            )
        )
    declared = promql.sum_by(
        CALLER, f"rate({families.COMPLETION_DECLARED_TOKENS.total}{promql.sel()}[{window}])"
    )
    requests = promql.sum_by(
        CALLER, f"rate({families.COMPLETION_USED_TOKENS.count}{promql.sel()}[{window}])"
    )
    used = promql.sum_by(
        CALLER, f"rate({families.COMPLETION_USED_TOKENS.sum}{promql.sel()}[{window}])"
    )
    rules.append(_rule(names.caller_completion_declared, over(declared, requests)))
    # The means are exact (sums over counts), as the page and check say them: a median read
    # inside a bucket said "used 384" when every request used 300.
    rules.append(_rule(names.caller_completion_used_mean, over(used, requests)))
    rules.append(
        _rule(
            names.caller_completion_overstatement,
            over(
                names.caller_completion_declared + promql.sel(),
                names.caller_completion_used_mean + promql.sel(),
            ),
        )
    )
    return rules


def _engine_rules(config: MonitoringConfig, promql: PromQL, names: Names) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for suffix, window in ((names.short, config.short_window), (names.long, config.long_window)):
        rules.append(
            _rule(
                names.target_queries[suffix],
                promql.sum_by(
                    TARGET,
                    f"rate({families.ENGINE_PREFIX_CACHE_QUERIES_TOKENS.total}{promql.sel()}[{window}])",
                ),
            )
        )
        rules.append(
            _rule(
                names.target_hits[suffix],
                promql.sum_by(
                    TARGET,
                    f"rate({families.ENGINE_PREFIX_CACHE_HITS_TOKENS.total}{promql.sel()}[{window}])",
                ),
            )
        )
        rules.append(
            _rule(
                names.target_hit_ratio[suffix],
                hit_ratio(
                    names.target_hits[suffix] + promql.sel(),
                    names.target_queries[suffix] + promql.sel(),
                ),
            )
        )
        hits = f"sum {promql.by(*MODEL)} ({names.target_hits[suffix]}{promql.sel()})"
        queries = f"sum {promql.by(*MODEL)} ({names.target_queries[suffix]}{promql.sel()})"
        rules.append(_rule(names.model_hit_ratio[suffix], hit_ratio(hits, queries)))
    rules.append(
        _rule(
            names.target_hit_ratio[names.baseline],
            _baseline(config, promql, names.target_hit_ratio[names.long]),
        )
    )
    rules.append(
        _rule(
            names.target_kv_used_tokens,
            promql.sum_by(TARGET, f"{families.ENGINE_KV_USED_TOKENS.series}{promql.sel()}"),
        )
    )
    rules.append(
        _rule(
            names.target_kv_pool_tokens,
            promql.sum_by(TARGET, f"{families.ENGINE_KV_POOL_TOKENS.series}{promql.sel()}"),
        )
    )
    rules.append(
        _rule(
            names.target_kv_used_ratio,
            over(
                names.target_kv_used_tokens + promql.sel(),
                names.target_kv_pool_tokens + promql.sel(),
            ),
        )
    )
    rules.append(
        _rule(
            names.model_kv_used_ratio,
            over(
                f"sum {promql.by(*MODEL)} ({names.target_kv_used_tokens}{promql.sel()})",
                f"sum {promql.by(*MODEL)} ({names.target_kv_pool_tokens}{promql.sel()})",
            ),
        )
    )
    rules.append(
        _rule(
            names.target_preemptions,
            promql.sum_by(
                TARGET,
                f"rate({families.ENGINE_PREEMPTIONS.total}{promql.sel()}[{config.short_window}])",
            ),
        )
    )
    rules.append(
        _rule(
            names.model_preemptions,
            f"sum {promql.by(*MODEL)} ({names.target_preemptions}{promql.sel()})",
        )
    )
    rules.extend(_foresight_engine_rules(config, promql, names))
    return rules


def _foresight_engine_rules(
    config: MonitoringConfig, promql: PromQL, names: Names
) -> list[dict[str, Any]]:
    """Live conversations against the pool (read after the pool's own rule, in this group),
    and the smallest pool over ``pool_min_window`` with the admission budget under it: the
    exporter's own (the pool it saw less its --signals.admission-headroom), at its lowest
    over the same window, so an exporter restart does not forget a smaller pool."""
    selector = promql.sel()
    return [
        _rule(
            names.target_conversations,
            promql.sum_by(TARGET, f"{families.ENGINE_CONVERSATIONS_ACTIVE.series}{selector}"),
        ),
        _rule(
            names.target_demand,
            promql.sum_by(
                TARGET, f"{families.ENGINE_CONVERSATIONS_DEMAND_TOKENS.series}{selector}"
            ),
        ),
        _rule(
            names.target_fit_ratio,
            over(names.target_demand + selector, names.target_kv_pool_tokens + selector),
        ),
        _rule(
            names.target_pool_min,
            promql.sum_by(
                TARGET,
                f"min_over_time({families.ENGINE_KV_POOL_MIN_TOKENS.series}{selector}"
                f"[{config.pool_min_window}])",
            ),
        ),
        _rule(
            names.target_budget,
            promql.sum_by(
                TARGET,
                f"min_over_time({families.ENGINE_ADMISSION_BUDGET_TOKENS.series}{selector}"
                f"[{config.pool_min_window}])",
            ),
        ),
    ]


def _share(promql: PromQL, rate: str) -> str:
    """Each source's share of a recorded per-source rate, within its (target, model_name)."""
    total = f"sum {promql.by(*TARGET)} ({rate}{promql.sel()})"
    # "group_left ()": a bare group_left would take the parenthesis after it for its labels.
    return f"{rate}{promql.sel()}\n/ {promql.on(*TARGET)} group_left ()\n{guarded(total)}"


def _source_rules(config: MonitoringConfig, promql: PromQL, names: Names) -> list[dict[str, Any]]:
    """Where prompt tokens came from: computed, local cache hit or external KV transfer; and
    which tier held the cached ones. Shares of the summed rates per vLLM target, so an idle
    window has no share rather than a made-up one."""
    window = config.short_window
    return [
        _rule(
            names.target_source_prompt,
            promql.sum_by(
                TARGET_SOURCE,
                f"rate({families.ENGINE_PROMPT_TOKENS_BY_SOURCE.total}{promql.sel()}[{window}])",
            ),
        ),
        _rule(names.target_source_prompt_share, _share(promql, names.target_source_prompt)),
        _rule(
            names.target_source_cached,
            promql.sum_by(
                TARGET_SOURCE,
                f"rate({families.ENGINE_PROMPT_TOKENS_CACHED_BY_SOURCE.total}{promql.sel()}"
                f"[{window}])",
            ),
        ),
        _rule(names.target_source_cached_share, _share(promql, names.target_source_cached)),
    ]


def _residency_rules(
    config: MonitoringConfig, promql: PromQL, names: Names
) -> list[dict[str, Any]]:
    """KV residency from vLLM's sampled evictions: the medians of block lifetime, idle time
    before eviction and gap between reuses; and the share of the evicted blocks' lifetime
    they sat idle before eviction. That share near 1 means blocks are evicted without a turn
    ever coming back to them since they were computed: with a hit ratio that fell, the
    collapse seen from inside. No sample in a window (no eviction, or vLLM without
    --kv-cache-metrics) records nothing."""
    window = config.short_window
    rules = []
    for histogram in KV_BLOCK_HISTOGRAMS:
        rules.append(
            _rule(
                names.target_kv_block_median[histogram],
                "histogram_quantile(0.5, "
                + promql.sum_by(
                    (*TARGET, "le"),
                    f"rate({KV_BLOCK_HISTOGRAMS[histogram].bucket}{promql.sel()}[{window}])",
                )
                + ") >= 0",
            )
        )
    idle = promql.sum_by(
        TARGET,
        f"rate({families.ENGINE_KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS.sum}{promql.sel()}[{window}])",
    )
    lifetime = promql.sum_by(
        TARGET, f"rate({families.ENGINE_KV_BLOCK_LIFETIME_SECONDS.sum}{promql.sel()}[{window}])"
    )
    rules.append(_rule(names.target_kv_block_idle_share, over(idle, lifetime)))
    return rules


def _prefill_engine_rules(
    config: MonitoringConfig, promql: PromQL, names: Names
) -> list[dict[str, Any]]:
    """Each engine's measured prefill rate over the long window: the prompt tokens it
    computed (its prompt tokens less those served from a cache, both counted once per request
    when its first token comes out) over the seconds its requests spent in prefill (the
    prefill-time histogram's sum: first scheduled to first token, observed when the request
    finishes). Per model, the sums over every vLLM serving it before dividing. vLLM without
    prompt_tokens_cached (before 0.16) has no computed tokens and so no rate: nothing is
    made up. docs/monitoring.md says what the figure includes."""
    window = config.long_window
    selector = promql.sel()

    def rate(sample: str) -> str:
        return promql.sum_by(TARGET, f"rate({sample}{selector}[{window}])")

    return [
        _rule(names.target_prompt, rate(families.ENGINE_PROMPT_TOKENS.total)),
        _rule(
            names.target_computed,
            f"{names.target_prompt}{selector}\n-\n"
            + rate(families.ENGINE_PROMPT_TOKENS_CACHED.total),
        ),
        _rule(
            names.target_prefill_seconds,
            rate(families.ENGINE_REQUEST_PREFILL_TIME_SECONDS.sum),
        ),
        _rule(
            names.target_prefill_rate,
            over(names.target_computed + selector, names.target_prefill_seconds + selector),
        ),
        _rule(
            names.model_prefill_rate,
            over(
                f"sum {promql.by(*MODEL)} ({names.target_computed}{selector})",
                f"sum {promql.by(*MODEL)} ({names.target_prefill_seconds}{selector})",
            ),
        ),
    ]


def _per_model_prefill_rate(promql: PromQL, names: Names) -> str:
    """The model's prefill rate under the callers' label for it (``model``, the model the
    request named, joins vLLM's ``model_name``), with zero rates dropped."""
    return guarded(
        f'label_replace({names.model_prefill_rate}{promql.sel()}, "model", "$1", '
        '"model_name", "(.*)")'
    )


def _prefill_caller_rules(
    config: MonitoringConfig, promql: PromQL, names: Names
) -> list[dict[str, Any]]:
    """Seconds of prefill per second the cache saved each caller (its cached tokens at the
    model's measured prefill rate) and the seconds evictions cost it (its prompt tokens
    missed because their prefix had been evicted, at the same rate), over the long window.
    Every ``caller_long_interval``: they read the long-window cached tokens recorded just
    before them, and the per-model rate the engine group records. A caller whose model no
    vLLM serves under that name has neither; one without the missed-tokens family (a
    caller folded into __other__, an exporter that does not serve it) has no lost figure,
    and one with it but no eviction reads 0."""
    window = config.long_window
    selector = promql.sel()
    join = f"/ {promql.on('model')} group_left ()\n"
    missed = families.MISSED_PROMPT_TOKENS.total
    evicted = promql.sum_by(CALLER, f"rate({missed}{promql.sel(EVICTED)}[{window}])")
    any_cause = promql.sum_by(CALLER, f"rate({missed}{selector}[{window}])")
    prefill_rate = _per_model_prefill_rate(promql, names)
    return [
        _rule(
            names.caller_prefill_saved,
            f"{names.caller_cached[names.long]}{selector}\n{join}{prefill_rate}",
        ),
        _rule(
            names.caller_prefill_lost,
            f"(\n  {evicted}\n  or\n  {any_cause} * 0\n)\n{join}{prefill_rate}",
        ),
    ]


def _bypass_rules(config: MonitoringConfig, promql: PromQL, names: Names) -> list[dict[str, Any]]:
    """Prompt tokens an engine prefilled that no caller sent through the exporters: its
    prompt tokens less the callers' per-target prompt tokens on it, over the long window,
    never below 0. Only where the target has per-caller series (the subtraction drops the
    others): an engine no usage names has no figure, never a made-up 100%. The callers'
    sum is per target only (their ``model`` and vLLM's ``model_name`` need not be spelled
    alike). In the long caller group: it reads a series per caller, model and replica."""
    window = config.long_window
    selector = promql.sel()
    return [
        _rule(
            names.target_callers_prompt,
            promql.sum_by(
                ("target",),
                f"rate({families.TARGET_PROMPT_TOKENS.total}{promql.sel(NAMED_TARGET)}[{window}])",
            ),
        ),
        _rule(
            names.target_bypassed,
            f"clamp_min(\n  {names.target_prompt}{selector}\n"
            f"  - {promql.on('target')} group_left ()\n"
            f"  {names.target_callers_prompt}{selector},\n  0\n)",
        ),
        _rule(
            names.target_bypassed_share,
            over(names.target_bypassed + selector, names.target_prompt + selector),
        ),
    ]


def _recount_rules(config: MonitoringConfig, promql: PromQL, names: Names) -> list[dict[str, Any]]:
    """Prefix-cache hits vLLM counted more than once per request: its admission-time hits
    (prefix_cache_hits, counted at every admission that looks the cache up) less the local
    cache hits it counts once per request at the first token (prompt_tokens_by_source
    local_cache_hit, else prompt_tokens_cached, which also holds a KV connector's tokens),
    never below 0. Whatever recounts (a retried allocation, a re-admitted request), the
    difference is what makes the engine's hit ratio read better than its callers'."""
    window = config.short_window
    selector = promql.sel()
    local = promql.sum_by(
        TARGET,
        f"rate({families.ENGINE_PROMPT_TOKENS_BY_SOURCE.total}"
        f"{promql.sel(LOCAL_CACHE_HIT)}[{window}])",
    )
    cached = promql.sum_by(
        TARGET, f"rate({families.ENGINE_PROMPT_TOKENS_CACHED.total}{selector}[{window}])"
    )
    return [
        _rule(
            names.target_hits_recounted,
            f"clamp_min(\n  {names.target_hits[names.short]}{selector}\n"
            f"  - (\n    {local}\n    or\n    {cached}\n  ),\n  0\n)",
        )
    ]


def _group(
    config: MonitoringConfig, name: str, rules: list[dict[str, Any]], interval: str = ""
) -> dict[str, Any]:
    group: dict[str, Any] = {"name": name}
    if interval or config.rule_interval:
        group["interval"] = interval or config.rule_interval
    group["rules"] = rules
    return group


def recording_rule_groups(config: MonitoringConfig) -> list[dict[str, Any]]:
    promql = PromQL(config)
    names = Names(config)
    return [
        _group(
            config,
            "vllm-cache-caller.rules",
            _caller_rules(config, promql, names),
            config.caller_interval,
        ),
        _group(
            config,
            "vllm-cache-caller-detail.rules",
            _caller_detail_rules(config, promql, names),
            config.caller_detail_interval,
        ),
        _group(
            config,
            "vllm-cache-caller-long.rules",
            _caller_long_rules(config, promql, names),
            config.caller_long_interval,
        ),
        _group(
            config,
            "vllm-cache-engine.rules",
            _engine_rules(config, promql, names)
            + _source_rules(config, promql, names)
            + _residency_rules(config, promql, names)
            + _prefill_engine_rules(config, promql, names)
            + _recount_rules(config, promql, names),
        ),
    ]


def recorded_names(config: MonitoringConfig) -> list[str]:
    return [rule["record"] for group in recording_rule_groups(config) for rule in group["rules"]]


def recorded_markdown(config: MonitoringConfig) -> str:
    """docs/metrics.md's table of the recorded series: each one's group and the series it is
    computed from (the exporter's own, and recorded ones it builds on)."""
    lines = ["| recorded series | group | computed from |", "|---|---|---|"]
    for group in recording_rule_groups(config):
        for rule in group["rules"]:
            sources = dict.fromkeys(
                re.findall(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+|vllm_cache_\w+", rule["expr"])
            )
            sources.pop(rule["record"], None)
            lines.append(
                f"| `{rule['record']}` | {group['name']} | "
                + ", ".join(f"`{source}`" for source in sources)
                + " |"
            )
    return "\n".join(lines) + "\n"
