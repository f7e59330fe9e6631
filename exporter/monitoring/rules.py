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
"""

from __future__ import annotations

from typing import Any

from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.promql import PromQL, number

CALLER = ("caller", "model")
CALLER_STATE = ("caller", "model", "state")
TARGET = ("target", "model_name")
MODEL = ("model_name",)

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
        both = (short, long)
        # "p90_1d_rate1h": newest operation first, as Prometheus names recorded series.
        baseline = f"{BASELINE_QUANTILE[0]}_{config.baseline_window}_{long}"
        self.short, self.long, self.baseline = short, long, baseline
        # per caller
        self.caller_prompt = {
            window: f"caller_model:vllm_cache_prompt_tokens:{window}" for window in both}
        self.caller_cached = {
            window: f"caller_model:vllm_cache_cached_tokens:{window}" for window in both}
        self.caller_hit_ratio = {
            window: f"caller_model:vllm_cache_hit_ratio:{window}" for window in (*both, baseline)}
        self.caller_unreported = {
            window: f"caller_model:vllm_cache_unreported_prompt_tokens:{window}"
            for window in both}
        self.caller_state_requests = f"caller_model_state:vllm_cache_requests:{short}"
        self.caller_warm_share = {
            window: f"caller_model:vllm_cache_warm_request_share:{window}"
            for window in (*both, baseline)}
        self.caller_state_ttft_bucket = (
            f"caller_model_state:vllm_cache_ttft_seconds_bucket:{short}")
        self.caller_state_ttft = {
            quantile: f"caller_model_state:vllm_cache_ttft_seconds:{quantile}_{short}"
            for quantile, _ in QUANTILES}
        # all classified turns of a caller: "turns that should be warm" when its baseline is
        self.caller_ttft = {
            quantile: f"caller_model:vllm_cache_ttft_seconds:{quantile}_{short}"
            for quantile, _ in QUANTILES}
        self.model_state_ttft = {
            quantile: f"model_state:vllm_cache_ttft_seconds:{quantile}_{short}"
            for quantile, _ in QUANTILES}
        # per vLLM target (and fleet-wide per model)
        self.target_queries = {
            window: f"target_model:vllm_cache_engine_prefix_cache_queries_tokens:{window}"
            for window in both}
        self.target_hits = {
            window: f"target_model:vllm_cache_engine_prefix_cache_hits_tokens:{window}"
            for window in both}
        self.target_hit_ratio = {
            window: f"target_model:vllm_cache_engine_hit_ratio:{window}"
            for window in (*both, baseline)}
        self.model_hit_ratio = {
            window: f"model:vllm_cache_engine_hit_ratio:{window}" for window in both}
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
        # foresight: completion tokens declared vs used, per caller
        self.caller_completion_bucket = (
            f"caller_model:vllm_cache_completion_used_tokens_bucket:{long}")
        self.caller_completion_used = {
            quantile: f"caller_model:vllm_cache_completion_used_tokens:{quantile}_{long}"
            for quantile, _ in COMPLETION_QUANTILES}
        self.caller_completion_declared = (
            f"caller_model:vllm_cache_completion_declared_tokens:mean_{long}")
        self.caller_completion_overstatement = (
            f"caller_model:vllm_cache_completion_overstatement:ratio_{long}")


def _rule(record: str, expr: str) -> dict[str, Any]:
    return {"record": record, "expr": expr.strip()}


def _ratio(promql: PromQL, numerator: str, denominator: str) -> str:
    """numerator / denominator of two recorded series with the same labels, 0/0 guarded."""
    return (f"(\n  {numerator}{promql.sel()}\n  or\n  {denominator}{promql.sel()} * 0\n)\n/\n"
            f"({denominator}{promql.sel()} > 0)")


def _baseline(config: MonitoringConfig, promql: PromQL, ratio: str) -> str:
    """The ratio the cache holds when it works: a high quantile of the long-window ratio over
    ``baseline_window``.

    A collapse cannot become its own baseline until it has lasted most of that window (90%
    of its samples), so a page lasts as long as the collapse does; the long-window ratio it
    is taken from already smooths single cold turns, and hours without traffic have no ratio
    and no say. A plain long-window ratio as baseline absorbs a collapse within the hour.
    """
    return (f"quantile_over_time({BASELINE_QUANTILE[1]}, "
            f"{ratio}{promql.sel()}[{config.baseline_window}])")


def _caller_rules(config: MonitoringConfig, promql: PromQL,
                  names: Names) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    windows = ((names.short, config.short_window), (names.long, config.long_window))
    for suffix, window in windows:
        rules.append(_rule(names.caller_prompt[suffix],
                           f"sum {promql.by(*CALLER)} (rate(vllm_cache_prompt_tokens_total"
                           f"{promql.sel()}[{window}]))"))
        rules.append(_rule(names.caller_cached[suffix],
                           f"sum {promql.by(*CALLER)} (rate(vllm_cache_cached_tokens_total"
                           f"{promql.sel()}[{window}]))"))
        rules.append(_rule(names.caller_hit_ratio[suffix],
                           _ratio(promql, names.caller_cached[suffix],
                                  names.caller_prompt[suffix])))
        rules.append(_rule(names.caller_unreported[suffix],
                           f"sum {promql.by(*CALLER)} ("
                           f"rate(vllm_cache_unreported_prompt_tokens_total"
                           f"{promql.sel()}[{window}]))"))
    rules.append(_rule(names.caller_state_requests,
                       f"sum {promql.by(*CALLER_STATE)} (rate(vllm_cache_requests_total"
                       f"{promql.sel()}[{config.short_window}]))"))
    classified = promql.states_matcher()
    warm_only = 'state="warm"'
    for suffix, window in windows:
        if suffix == names.short:
            warm = (f"sum {promql.by(*CALLER)} "
                    f"({names.caller_state_requests}{promql.sel(warm_only)})")
            total = (f"sum {promql.by(*CALLER)} "
                     f"({names.caller_state_requests}{promql.sel(classified)})")
        else:
            warm = (f"sum {promql.by(*CALLER)} (rate(vllm_cache_requests_total"
                    f"{promql.sel(warm_only)}[{window}]))")
            total = (f"sum {promql.by(*CALLER)} (rate(vllm_cache_requests_total"
                     f"{promql.sel(classified)}[{window}]))")
        # Short (too small for one granule), unknown (cached tokens not reported) and error
        # turns say nothing about the cache, so they are out of the denominator.
        rules.append(_rule(names.caller_warm_share[suffix],
                           f"(\n  {warm}\n  or\n  {total} * 0\n)\n/\n({total} > 0)"))
    rules.append(_rule(names.caller_hit_ratio[names.baseline],
                       _baseline(config, promql, names.caller_hit_ratio[names.long])))
    rules.append(_rule(names.caller_warm_share[names.baseline],
                       _baseline(config, promql, names.caller_warm_share[names.long])))
    rules.append(_rule(names.caller_state_ttft_bucket,
                       f"sum {promql.by(*CALLER_STATE, 'le')} ("
                       f"rate(vllm_cache_ttft_seconds_bucket"
                       f"{promql.sel(classified)}[{config.short_window}]))"))
    # ">= 0" drops the NaN histogram_quantile returns for a window without requests.
    for name, quantile in QUANTILES:
        rules.append(_rule(names.caller_state_ttft[name],
                           f"histogram_quantile({quantile}, "
                           f"{names.caller_state_ttft_bucket}{promql.sel()}) >= 0"))
    for name, quantile in QUANTILES:
        rules.append(_rule(names.caller_ttft[name],
                           f"histogram_quantile({quantile}, sum {promql.by(*CALLER, 'le')} "
                           f"({names.caller_state_ttft_bucket}{promql.sel()})) >= 0"))
    for name, quantile in QUANTILES:
        rules.append(_rule(names.model_state_ttft[name],
                           f"histogram_quantile({quantile}, "
                           f"sum {promql.by('model', 'state', 'le')} "
                           f"({names.caller_state_ttft_bucket}{promql.sel()})) >= 0"))
    rules.extend(_completion_rules(config, promql, names))
    return rules


def _completion_rules(config: MonitoringConfig, promql: PromQL,
                      names: Names) -> list[dict[str, Any]]:
    """Declared vs used completion tokens per caller, over the long window: an admission gate
    that charges the declared max_tokens holds a fraction of the conversations it could."""
    window = config.long_window
    rules = [_rule(names.caller_completion_bucket,
                   f"sum {promql.by(*CALLER, 'le')} (rate("
                   f"vllm_cache_completion_used_tokens_bucket{promql.sel()}[{window}]))")]
    for name, quantile in COMPLETION_QUANTILES:
        rules.append(_rule(names.caller_completion_used[name],
                           f"histogram_quantile({quantile}, "
                           f"{names.caller_completion_bucket}{promql.sel()}) >= 0"))
    declared = (f"sum {promql.by(*CALLER)} (rate("
                f"vllm_cache_completion_declared_tokens_total{promql.sel()}[{window}]))")
    requests = (f"sum {promql.by(*CALLER)} (rate("
                f"vllm_cache_completion_used_tokens_count{promql.sel()}[{window}]))")
    rules.append(_rule(names.caller_completion_declared,
                       f"{declared}\n/\n({requests} > 0)"))
    rules.append(_rule(names.caller_completion_overstatement,
                       f"{names.caller_completion_declared}{promql.sel()}\n/\n"
                       f"({names.caller_completion_used['p50']}{promql.sel()} > 0)"))
    return rules


def _engine_rules(config: MonitoringConfig, promql: PromQL,
                  names: Names) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for suffix, window in ((names.short, config.short_window),
                           (names.long, config.long_window)):
        rules.append(_rule(names.target_queries[suffix],
                           f"sum {promql.by(*TARGET)} (rate("
                           f"vllm_cache_engine_prefix_cache_queries_tokens_total{promql.sel()}"
                           f"[{window}]))"))
        rules.append(_rule(names.target_hits[suffix],
                           f"sum {promql.by(*TARGET)} (rate("
                           f"vllm_cache_engine_prefix_cache_hits_tokens_total{promql.sel()}"
                           f"[{window}]))"))
        rules.append(_rule(names.target_hit_ratio[suffix],
                           _ratio(promql, names.target_hits[suffix],
                                  names.target_queries[suffix])))
        hits = f"sum {promql.by(*MODEL)} ({names.target_hits[suffix]}{promql.sel()})"
        queries = f"sum {promql.by(*MODEL)} ({names.target_queries[suffix]}{promql.sel()})"
        rules.append(_rule(names.model_hit_ratio[suffix],
                           f"(\n  {hits}\n  or\n  {queries} * 0\n)\n/\n({queries} > 0)"))
    rules.append(_rule(names.target_hit_ratio[names.baseline],
                       _baseline(config, promql, names.target_hit_ratio[names.long])))
    rules.append(_rule(names.target_kv_used_tokens,
                       f"sum {promql.by(*TARGET)} "
                       f"(vllm_cache_engine_kv_used_tokens{promql.sel()})"))
    rules.append(_rule(names.target_kv_pool_tokens,
                       f"sum {promql.by(*TARGET)} "
                       f"(vllm_cache_engine_kv_pool_tokens{promql.sel()})"))
    rules.append(_rule(names.target_kv_used_ratio,
                       f"{names.target_kv_used_tokens}{promql.sel()}\n/\n"
                       f"({names.target_kv_pool_tokens}{promql.sel()} > 0)"))
    rules.append(_rule(names.model_kv_used_ratio,
                       f"sum {promql.by(*MODEL)} ({names.target_kv_used_tokens}{promql.sel()})"
                       f"\n/\n(sum {promql.by(*MODEL)} "
                       f"({names.target_kv_pool_tokens}{promql.sel()}) > 0)"))
    rules.append(_rule(names.target_preemptions,
                       f"sum {promql.by(*TARGET)} (rate(vllm_cache_engine_preemptions_total"
                       f"{promql.sel()}[{config.short_window}]))"))
    rules.append(_rule(names.model_preemptions,
                       f"sum {promql.by(*MODEL)} ({names.target_preemptions}{promql.sel()})"))
    rules.extend(_foresight_engine_rules(config, promql, names))
    return rules


def _foresight_engine_rules(config: MonitoringConfig, promql: PromQL,
                            names: Names) -> list[dict[str, Any]]:
    """Live conversations against the pool (read after the pool's own rule, in this group),
    and the smallest pool over ``pool_min_window`` with the admission budget under it."""
    selector = promql.sel()
    headroom = number(config.conversations_headroom_tokens)
    return [
        _rule(names.target_conversations,
              f"sum {promql.by(*TARGET)} (vllm_cache_engine_conversations_active{selector})"),
        _rule(names.target_demand,
              f"sum {promql.by(*TARGET)} "
              f"(vllm_cache_engine_conversations_demand_tokens{selector})"),
        _rule(names.target_fit_ratio,
              f"{names.target_demand}{selector}\n/\n"
              f"({names.target_kv_pool_tokens}{selector} > 0)"),
        _rule(names.target_pool_min,
              f"sum {promql.by(*TARGET)} (min_over_time("
              f"vllm_cache_engine_kv_pool_min_tokens{selector}[{config.pool_min_window}]))"),
        _rule(names.target_budget,
              f"clamp_min({names.target_pool_min}{selector} - {headroom}, 0)"),
    ]


def _group(config: MonitoringConfig, name: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    group: dict[str, Any] = {"name": name}
    if config.rule_interval:
        group["interval"] = config.rule_interval
    group["rules"] = rules
    return group


def recording_rule_groups(config: MonitoringConfig) -> list[dict[str, Any]]:
    promql = PromQL(config)
    names = Names(config)
    return [
        _group(config, "vllm-cache-caller.rules", _caller_rules(config, promql, names)),
        _group(config, "vllm-cache-engine.rules", _engine_rules(config, promql, names)),
    ]


def recorded_names(config: MonitoringConfig) -> list[str]:
    return [rule["record"] for group in recording_rule_groups(config) for rule in group["rules"]]

