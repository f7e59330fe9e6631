"""Alerting rules. Names are a public contract: users route on them.

Every alert carries ``severity`` (critical pages, warning makes a ticket), a static one-line
``summary``, a ``description`` templated with the labels and humanized values, a
``runbook_url`` into docs/runbook.md (anchor = lower-cased alert name) and a ``dashboard_url``
deep link with the dashboard's variables filled in. docs/runbook.md explains each expression;
the promtool tests in alerts/tests/ are the proof that they fire and stay silent as stated.
"""

from __future__ import annotations

from typing import Any

from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.promql import PromQL, number
from exporter.monitoring.rules import CALLER, TARGET, Names

ALERT_NAMES = (
    "VllmCachePrefixCollapse",
    "VllmCacheWarmTTFTCollapse",
    "VllmCachePrefixCachingDisabled",
    "VllmCacheCachedTokensNotReported",
    "VllmCachePreemptions",
    "VllmCacheKVPoolNearFull",
    "VllmCacheEngineDown",
    "VllmCacheEngineMetricAbsent",
    "VllmCacheExporterDown",
)

# alert label -> dashboard variable it fills
_DASHBOARD_VARS = {"job": "job", "target": "target", "model_name": "model", "model": "model",
                   "caller": "caller"}


def runbook_anchor(alertname: str) -> str:
    return alertname.lower()


class _Alerts:
    def __init__(self, config: MonitoringConfig) -> None:
        self.config = config
        self.q = PromQL(config)
        self.n = Names(config)

    # --- annotation helpers -------------------------------------------------------------------
    def query_value(self, metric: str, level: tuple[str, ...], fmt: str) -> str:
        """Template text that looks up one recorded series with the alert's own labels."""
        labels = self.q.labels(*level)
        matchers = ",".join(f"{label}=%q" for label in labels)
        args = " ".join(f"$labels.{label}" for label in labels)
        return (f'{{{{ with printf "{metric}{{{matchers}}}" {args} | query }}}}'
                f"{{{{ . | first | value | {fmt} }}}}{{{{ end }}}}")

    def dashboard_link(self, uid: str, labels: tuple[str, ...]) -> str:
        params = []
        for label in dict.fromkeys((*self.config.group_labels, *labels)):
            var = _DASHBOARD_VARS.get(label)
            if var is not None:
                params.append(f"var-{var}={{{{ $labels.{label} | urlquery }}}}")
        query = "?" + "&".join(params) if params else ""
        return f"{self.config.dashboard_url.rstrip('/')}/d/{uid}{query}"

    def alert(self, name: str, expr: str, duration: str, severity: str, summary: str,
              description: str, dashboard: str,
              extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
        labels = {"severity": severity, **(extra_labels or {})}
        return {
            "alert": name,
            "expr": expr.strip(),
            "for": duration,
            "labels": labels,
            "annotations": {
                "summary": summary,
                "description": " ".join(description.split()),
                "runbook_url": f"{self.config.runbook_url}#{runbook_anchor(name)}",
                "dashboard_url": dashboard,
            },
        }

    # --- the alerts ---------------------------------------------------------------------------
    def prefix_collapse(self) -> list[dict[str, Any]]:
        c, q, n = self.config, self.q, self.n
        s, lw = n.short, n.long
        factor, baseline = number(c.collapse_drop_factor), number(c.collapse_min_baseline)
        engine_floor = number(c.collapse_engine_min_tokens_per_second)
        caller_floor = number(c.collapse_caller_min_tokens_per_second)
        # Traffic above the floor now AND one window earlier: a collapse happens while
        # traffic continues, so one cold turn after a quiet spell can never page.
        engine_expr = f"""
{n.target_hit_ratio[s]}{q.sel()}
  < {factor} * {n.target_hit_ratio[lw]}{q.sel()}
and {n.target_hit_ratio[lw]}{q.sel()} > {baseline}
and {n.target_queries[s]}{q.sel()} > {engine_floor}
and {n.target_queries[s]}{q.sel()} offset {c.short_window} > {engine_floor}"""
        caller_expr = f"""
{n.caller_hit_ratio[s]}{q.sel()}
  < {factor} * {n.caller_hit_ratio[lw]}{q.sel()}
and {n.caller_hit_ratio[lw]}{q.sel()} > {baseline}
and {n.caller_prompt[s]}{q.sel()} > {caller_floor}
and {n.caller_prompt[s]}{q.sel()} offset {c.short_window} > {caller_floor}"""
        engine_baseline = self.query_value(n.target_hit_ratio[lw], TARGET, "humanizePercentage")
        engine_traffic = self.query_value(n.target_queries[s], TARGET, "humanize")
        caller_baseline = self.query_value(n.caller_hit_ratio[lw], CALLER, "humanizePercentage")
        caller_traffic = self.query_value(n.caller_prompt[s], CALLER, "humanize")
        return [
            self.alert(
                "VllmCachePrefixCollapse", engine_expr, c.collapse_for, c.collapse_severity,
                "The prefix-cache hit ratio of a vLLM engine collapsed while prompt traffic "
                "continues.",
                f"""vLLM {{{{ $labels.target }}}} ({{{{ $labels.model_name }}}}) served
                {{{{ $value | humanizePercentage }}}} of looked-up prompt tokens from its prefix
                cache over the last {c.short_window}, against {engine_baseline} over the last
                {c.long_window}, while still looking up {engine_traffic} prompt tokens/s.""",
                self.dashboard_link(c.overview_uid, TARGET), {"scope": "engine"}),
            self.alert(
                "VllmCachePrefixCollapse", caller_expr, c.collapse_for, c.collapse_severity,
                "The prefix-cache hit ratio of a caller collapsed while its prompt traffic "
                "continues.",
                f"""Caller {{{{ $labels.caller }}}} on {{{{ $labels.model }}}} got
                {{{{ $value | humanizePercentage }}}} of its prompt tokens from the prefix cache
                over the last {c.short_window}, against {caller_baseline} over the last
                {c.long_window}, while still sending {caller_traffic} prompt tokens/s.""",
                self.dashboard_link(c.caller_uid, CALLER), {"scope": "caller"}),
        ]

    def warm_ttft_collapse(self) -> dict[str, Any]:
        c, q, n = self.config, self.q, self.n
        expr = f"""
{n.caller_ttft['p50']}{q.sel()} > {number(c.warm_ttft_seconds)}
and {n.caller_warm_share[n.long]}{q.sel()} > {number(c.warm_ttft_min_warm_share)}
and sum {q.by(*CALLER)} ({n.caller_state_requests}{q.sel(q.states_matcher())})
  > {number(c.warm_ttft_min_requests_per_second)}"""
        share = self.query_value(n.caller_warm_share[n.long], CALLER, "humanizePercentage")
        return self.alert(
            "VllmCacheWarmTTFTCollapse", expr, c.warm_ttft_for, c.warm_ttft_severity,
            "Turns that should be warm take a minute or more to their first token.",
            f"""Caller {{{{ $labels.caller }}}} on {{{{ $labels.model }}}}: the median
            engine-side time to first token of its turns over the last {c.short_window} is
            {{{{ $value | humanizeDuration }}}}, although {share} of its turns were warm over
            the last {c.long_window}. Seconds means the cache held; a minute means it was
            evicted or the engine is shared too widely.""",
            self.dashboard_link(c.caller_uid, CALLER))

    def prefix_caching_disabled(self) -> dict[str, Any]:
        c, q = self.config, self.q
        expr = f"max {q.by(*TARGET)} (vllm_cache_engine_prefix_caching_enabled{q.sel()}) == 0"
        return self.alert(
            "VllmCachePrefixCachingDisabled", expr, c.prefix_caching_disabled_for,
            c.prefix_caching_disabled_severity,
            "vLLM runs with prefix caching off.",
            """vLLM {{ $labels.target }} serves {{ $labels.model_name }} with
            enable_prefix_caching=False, so every turn re-reads its whole prompt. Hybrid
            models often default to off; start vLLM with --enable-prefix-caching.""",
            self.dashboard_link(c.overview_uid, TARGET))

    def cached_tokens_not_reported(self) -> dict[str, Any]:
        c, q, n = self.config, self.q, self.n
        expr = f"""
{n.caller_unreported[n.long]}{q.sel()} > 0
unless
{n.caller_prompt[n.long]}{q.sel()} > 0"""
        return self.alert(
            "VllmCacheCachedTokensNotReported", expr, c.not_reported_for,
            c.not_reported_severity,
            "vLLM does not report cached tokens per request, so this caller's hit ratio is "
            "unknown.",
            f"""Caller {{{{ $labels.caller }}}} on {{{{ $labels.model }}}} sent
            {{{{ $value | humanize }}}} prompt tokens/s over the last {c.long_window} without
            prompt_tokens_details.cached_tokens in the usage, and none with it. Start vLLM
            with --enable-prompt-tokens-details (streaming clients also need
            stream_options.include_usage).""",
            self.dashboard_link(c.caller_uid, CALLER))

    def preemptions(self) -> dict[str, Any]:
        c, q, n = self.config, self.q, self.n
        expr = f"{n.target_preemptions}{q.sel()} * 60 > {number(c.preemptions_per_minute)}"
        return self.alert(
            "VllmCachePreemptions", expr, c.preemptions_for, c.preemptions_severity,
            "vLLM keeps preempting requests because the running ones do not fit its KV pool.",
            f"""vLLM {{{{ $labels.target }}}} ({{{{ $labels.model_name }}}}) preempted
            {{{{ $value | humanize }}}} requests per minute over the last {c.short_window}; a
            preempted request loses its KV blocks and is recomputed later.""",
            self.dashboard_link(c.overview_uid, TARGET))

    def kv_pool_near_full(self) -> dict[str, Any]:
        c, q, n = self.config, self.q, self.n
        expr = f"{n.target_kv_used_ratio}{q.sel()} > {number(c.kv_pool_full_ratio)}"
        pool = self.query_value(n.target_kv_pool_tokens, TARGET, "humanize")
        return self.alert(
            "VllmCacheKVPoolNearFull", expr, c.kv_pool_full_for, c.kv_pool_full_severity,
            "The KV-cache pool of a vLLM engine is nearly full.",
            f"""vLLM {{{{ $labels.target }}}} ({{{{ $labels.model_name }}}}) has
            {{{{ $value | humanizePercentage }}}} of its {pool}-token KV pool in use: the
            conversations it runs at once barely fit, and the next one will evict or preempt
            another.""",
            self.dashboard_link(c.overview_uid, TARGET))

    def engine_down(self) -> dict[str, Any]:
        c, q = self.config, self.q
        return self.alert(
            "VllmCacheEngineDown", f"vllm_cache_engine_up{q.sel()} == 0",
            c.engine_down_for, c.engine_down_severity,
            "The exporter cannot read a vLLM engine's metrics.",
            f"""Exporter {{{{ $labels.instance }}}} has failed to read
            {{{{ $labels.target }}}} for {c.engine_down_for}: vLLM is down, restarting, or
            unreachable from the exporter. Its cache signals are absent meanwhile.""",
            self.dashboard_link(c.overview_uid, ("target",)))

    def exporter_down(self) -> dict[str, Any]:
        c, q = self.config, self.q
        return self.alert(
            "VllmCacheExporterDown", f"up{q.sel()} == 0", c.exporter_down_for,
            c.exporter_down_severity,
            "Prometheus cannot scrape vllm-cache-exporter, so no cache alert can fire.",
            f"""Prometheus has failed to scrape {{{{ $labels.instance }}}} (job
            {{{{ $labels.job }}}}) for {c.exporter_down_for}; every prefix-cache alert is
            blind until it is back.""",
            self.dashboard_link(c.overview_uid, ()))

    def engine_metric_absent(self) -> dict[str, Any]:
        c, q = self.config, self.q
        signals = 'signal=~"' + "|".join(c.required_signals) + '"'
        return self.alert(
            "VllmCacheEngineMetricAbsent",
            f"vllm_cache_engine_metric_present{q.sel(signals)} == 0",
            c.metric_absent_for, c.metric_absent_severity,
            "vLLM no longer exposes a metric the cache rules depend on.",
            """vLLM {{ $labels.target }} exposes no metric for the {{ $labels.signal }}
            signal under any name the exporter knows: a vLLM upgrade renamed or dropped it.
            Panels and alerts built on it show nothing, not a reassuring 0.""",
            self.dashboard_link(c.overview_uid, ("target",)))


def alert_rule_groups(config: MonitoringConfig) -> list[dict[str, Any]]:
    alerts = _Alerts(config)
    rules = [
        *alerts.prefix_collapse(),
        alerts.warm_ttft_collapse(),
        alerts.prefix_caching_disabled(),
        alerts.cached_tokens_not_reported(),
        alerts.preemptions(),
        alerts.kv_pool_near_full(),
        alerts.engine_down(),
        alerts.engine_metric_absent(),
        alerts.exporter_down(),
    ]
    group: dict[str, Any] = {"name": "vllm-cache.alerts"}
    if config.rule_interval:
        group["interval"] = config.rule_interval
    group["rules"] = rules
    return [group]
