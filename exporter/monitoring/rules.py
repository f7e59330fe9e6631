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
from exporter.monitoring.promql import PromQL

CALLER = ("caller", "model")
CALLER_STATE = ("caller", "model", "state")
TARGET = ("target", "model_name")
MODEL = ("model_name",)
CALLER_MODEL = ("model",)

QUANTILES = (("p50", 0.5), ("p95", 0.95))


class Names:
    """The recorded series' names for one configuration (windows are part of the names)."""

    def __init__(self, config: MonitoringConfig) -> None:
        s = PromQL.window_suffix(config.short_window)
        lw = PromQL.window_suffix(config.long_window)
        self.short, self.long = s, lw
        # per caller
        self.caller_prompt = {w: f"caller_model:vllm_cache_prompt_tokens:{w}" for w in (s, lw)}
        self.caller_cached = {w: f"caller_model:vllm_cache_cached_tokens:{w}" for w in (s, lw)}
        self.caller_hit_ratio = {w: f"caller_model:vllm_cache_hit_ratio:{w}" for w in (s, lw)}
        self.caller_unreported = {
            w: f"caller_model:vllm_cache_unreported_prompt_tokens:{w}" for w in (s, lw)}
        self.caller_state_requests = f"caller_model_state:vllm_cache_requests:{s}"
        self.caller_warm_share = {
            w: f"caller_model:vllm_cache_warm_request_share:{w}" for w in (s, lw)}
        self.caller_state_ttft_bucket = f"caller_model_state:vllm_cache_ttft_seconds_bucket:{s}"
        self.caller_state_ttft = {
            q: f"caller_model_state:vllm_cache_ttft_seconds:{q}_{s}" for q, _ in QUANTILES}
        # all classified turns of a caller: "turns that should be warm" when its baseline is
        self.caller_ttft = {
            q: f"caller_model:vllm_cache_ttft_seconds:{q}_{s}" for q, _ in QUANTILES}
        self.model_state_ttft = {
            q: f"model_state:vllm_cache_ttft_seconds:{q}_{s}" for q, _ in QUANTILES}
        # per vLLM target (and fleet-wide per model)
        self.target_queries = {
            w: f"target_model:vllm_cache_engine_prefix_cache_queries_tokens:{w}" for w in (s, lw)}
        self.target_hits = {
            w: f"target_model:vllm_cache_engine_prefix_cache_hits_tokens:{w}" for w in (s, lw)}
        self.target_hit_ratio = {
            w: f"target_model:vllm_cache_engine_hit_ratio:{w}" for w in (s, lw)}
        self.model_hit_ratio = {w: f"model:vllm_cache_engine_hit_ratio:{w}" for w in (s, lw)}
        self.target_kv_used_tokens = "target_model:vllm_cache_engine_kv_used_tokens:sum"
        self.target_kv_pool_tokens = "target_model:vllm_cache_engine_kv_pool_tokens:sum"
        self.target_kv_used_ratio = "target_model:vllm_cache_engine_kv_used:ratio"
        self.model_kv_used_ratio = "model:vllm_cache_engine_kv_used:ratio"
        self.target_preemptions = f"target_model:vllm_cache_engine_preemptions:{s}"
        self.model_preemptions = f"model:vllm_cache_engine_preemptions:{s}"


def _rule(record: str, expr: str) -> dict[str, Any]:
    return {"record": record, "expr": expr.strip()}


def _ratio(q: PromQL, numerator: str, denominator: str) -> str:
    """numerator / denominator of two recorded series with the same labels, 0/0 guarded."""
    return (f"(\n  {numerator}{q.sel()}\n  or\n  {denominator}{q.sel()} * 0\n)\n/\n"
            f"({denominator}{q.sel()} > 0)")


def _caller_rules(config: MonitoringConfig, q: PromQL, n: Names) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    windows = ((n.short, config.short_window), (n.long, config.long_window))
    for suffix, window in windows:
        rules.append(_rule(n.caller_prompt[suffix],
                           f"sum {q.by(*CALLER)} (rate(vllm_cache_prompt_tokens_total"
                           f"{q.sel()}[{window}]))"))
        rules.append(_rule(n.caller_cached[suffix],
                           f"sum {q.by(*CALLER)} (rate(vllm_cache_cached_tokens_total"
                           f"{q.sel()}[{window}]))"))
        rules.append(_rule(n.caller_hit_ratio[suffix],
                           _ratio(q, n.caller_cached[suffix], n.caller_prompt[suffix])))
        rules.append(_rule(n.caller_unreported[suffix],
                           f"sum {q.by(*CALLER)} (rate(vllm_cache_unreported_prompt_tokens_total"
                           f"{q.sel()}[{window}]))"))
    rules.append(_rule(n.caller_state_requests,
                       f"sum {q.by(*CALLER_STATE)} (rate(vllm_cache_requests_total{q.sel()}"
                       f"[{config.short_window}]))"))
    classified = q.states_matcher()
    warm_only = 'state="warm"'
    for suffix, window in windows:
        if suffix == n.short:
            warm = f"sum {q.by(*CALLER)} ({n.caller_state_requests}{q.sel(warm_only)})"
            total = f"sum {q.by(*CALLER)} ({n.caller_state_requests}{q.sel(classified)})"
        else:
            warm = (f"sum {q.by(*CALLER)} (rate(vllm_cache_requests_total"
                    f"{q.sel(warm_only)}[{window}]))")
            total = (f"sum {q.by(*CALLER)} (rate(vllm_cache_requests_total"
                     f"{q.sel(classified)}[{window}]))")
        # Short (too small for one granule), unknown (cached tokens not reported) and error
        # turns say nothing about the cache, so they are out of the denominator.
        rules.append(_rule(n.caller_warm_share[suffix],
                           f"(\n  {warm}\n  or\n  {total} * 0\n)\n/\n({total} > 0)"))
    rules.append(_rule(n.caller_state_ttft_bucket,
                       f"sum {q.by(*CALLER_STATE, 'le')} (rate(vllm_cache_ttft_seconds_bucket"
                       f"{q.sel(classified)}[{config.short_window}]))"))
    # ">= 0" drops the NaN histogram_quantile returns for a window without requests.
    for name, quantile in QUANTILES:
        rules.append(_rule(n.caller_state_ttft[name],
                           f"histogram_quantile({quantile}, "
                           f"{n.caller_state_ttft_bucket}{q.sel()}) >= 0"))
    for name, quantile in QUANTILES:
        rules.append(_rule(n.caller_ttft[name],
                           f"histogram_quantile({quantile}, sum {q.by(*CALLER, 'le')} "
                           f"({n.caller_state_ttft_bucket}{q.sel()})) >= 0"))
    for name, quantile in QUANTILES:
        rules.append(_rule(n.model_state_ttft[name],
                           f"histogram_quantile({quantile}, sum {q.by('model', 'state', 'le')} "
                           f"({n.caller_state_ttft_bucket}{q.sel()})) >= 0"))
    return rules


def _engine_rules(config: MonitoringConfig, q: PromQL, n: Names) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for suffix, window in ((n.short, config.short_window), (n.long, config.long_window)):
        rules.append(_rule(n.target_queries[suffix],
                           f"sum {q.by(*TARGET)} (rate("
                           f"vllm_cache_engine_prefix_cache_queries_tokens_total{q.sel()}"
                           f"[{window}]))"))
        rules.append(_rule(n.target_hits[suffix],
                           f"sum {q.by(*TARGET)} (rate("
                           f"vllm_cache_engine_prefix_cache_hits_tokens_total{q.sel()}"
                           f"[{window}]))"))
        rules.append(_rule(n.target_hit_ratio[suffix],
                           _ratio(q, n.target_hits[suffix], n.target_queries[suffix])))
        hits = f"sum {q.by(*MODEL)} ({n.target_hits[suffix]}{q.sel()})"
        queries = f"sum {q.by(*MODEL)} ({n.target_queries[suffix]}{q.sel()})"
        rules.append(_rule(n.model_hit_ratio[suffix],
                           f"(\n  {hits}\n  or\n  {queries} * 0\n)\n/\n({queries} > 0)"))
    rules.append(_rule(n.target_kv_used_tokens,
                       f"sum {q.by(*TARGET)} (vllm_cache_engine_kv_used_tokens{q.sel()})"))
    rules.append(_rule(n.target_kv_pool_tokens,
                       f"sum {q.by(*TARGET)} (vllm_cache_engine_kv_pool_tokens{q.sel()})"))
    rules.append(_rule(n.target_kv_used_ratio,
                       f"{n.target_kv_used_tokens}{q.sel()}\n/\n"
                       f"({n.target_kv_pool_tokens}{q.sel()} > 0)"))
    rules.append(_rule(n.model_kv_used_ratio,
                       f"sum {q.by(*MODEL)} ({n.target_kv_used_tokens}{q.sel()})\n/\n"
                       f"(sum {q.by(*MODEL)} ({n.target_kv_pool_tokens}{q.sel()}) > 0)"))
    rules.append(_rule(n.target_preemptions,
                       f"sum {q.by(*TARGET)} (rate(vllm_cache_engine_preemptions_total"
                       f"{q.sel()}[{config.short_window}]))"))
    rules.append(_rule(n.model_preemptions,
                       f"sum {q.by(*MODEL)} ({n.target_preemptions}{q.sel()})"))
    return rules


def _group(config: MonitoringConfig, name: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    group: dict[str, Any] = {"name": name}
    if config.rule_interval:
        group["interval"] = config.rule_interval
    group["rules"] = rules
    return group


def recording_rule_groups(config: MonitoringConfig) -> list[dict[str, Any]]:
    q = PromQL(config)
    n = Names(config)
    return [
        _group(config, "vllm-cache-caller.rules", _caller_rules(config, q, n)),
        _group(config, "vllm-cache-engine.rules", _engine_rules(config, q, n)),
    ]


def recorded_names(config: MonitoringConfig) -> list[str]:
    return [rule["record"] for group in recording_rule_groups(config) for rule in group["rules"]]

