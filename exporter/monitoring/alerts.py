"""Alerting rules. Names are a public contract: users route on them.

Every alert carries ``severity`` (critical pages, warning makes a ticket), a static one-line
``summary``, a ``description`` templated with the labels and humanized values, a
``runbook_url`` into docs/runbook.md (anchor = lower-cased alert name) and a ``dashboard_url``
deep link with the dashboard's variables filled in. docs/runbook.md explains each expression;
the promtool tests in alerts/tests/ are the proof that they fire and stay silent as stated.
"""

from __future__ import annotations

from typing import Any

from exporter import families
from exporter.monitoring.config import MonitoringConfig, duration_seconds
from exporter.monitoring.promql import PromQL, number
from exporter.monitoring.rules import CALLER, CALLER_TARGET, TARGET, Names

ALERT_NAMES = (
    "VllmCachePrefixCollapse",
    "VllmCacheWarmTTFTCollapse",
    "VllmCachePrefixCachingDisabled",
    "VllmCacheCachedTokensNotReported",
    "VllmCachePreemptions",
    "VllmCacheKVPoolNearFull",
    "VllmCacheConversationsExceedKVPool",
    "VllmCachePromptVariableTop",
    "VllmCacheUnseenHistory",
    "VllmCacheConversationsDropped",
    "VllmCacheEngineDown",
    "VllmCacheEngineMetricAbsent",
    "VllmCacheExporterDown",
    "VllmCacheExporterAbsent",
    "VllmCacheDuplicateTarget",
)

# alert label -> dashboard variable it fills
_DASHBOARD_VARS = {
    "job": "job",
    "target": "target",
    "model_name": "model",
    "model": "model",
    "caller": "caller",
}


def runbook_anchor(alertname: str) -> str:
    return alertname.lower()


class _Alerts:
    def __init__(self, config: MonitoringConfig) -> None:
        self.config = config
        self.promql = PromQL(config)
        self.names = Names(config)

    # --- annotation helpers -------------------------------------------------------------------
    def query_value(self, metric: str, level: tuple[str, ...], fmt: str) -> str:
        """Template text that looks up one recorded series with the alert's own labels. A
        label the alert lacks (a topology label the series do not carry) is "": Prometheus
        renders a missing label so, vmalert as no value, which printf turns into a query
        that fails, and the alert is not sent."""
        return self.query_text(metric, level, fmt, "{value}")

    def query_text(self, metric: str, level: tuple[str, ...], fmt: str, text: str) -> str:
        """``text`` with ``{value}`` the looked-up value (``metric`` may be an expression of
        one recorded series), all of it left out where the series is absent."""
        labels = self.promql.labels(*level)
        matchers = ",".join(f"{label}=%q" for label in labels)
        args = " ".join(f'(or $labels.{label} "")' for label in labels)
        value = f"{{{{ . | first | value | {fmt} }}}}"
        return (
            f'{{{{ with printf "{metric}{{{matchers}}}" {args} | query }}}}'
            + text.replace("{value}", value)
            + "{{ end }}"
        )

    def dashboard_link(self, uid: str, labels: tuple[str, ...]) -> str:
        """The dashboard with the alert's labels as its variables. A topology label (a
        dashboard variable of the same name) only where the alert has it: absent, the
        variable stays on All, which also matches series without the label."""
        params = []
        for label in dict.fromkeys((*self.config.group_labels, *labels)):
            variable = _DASHBOARD_VARS.get(label)
            if variable is not None and label not in self.config.topology_labels:
                params.append(f'var-{variable}={{{{ or $labels.{label} "" | urlquery }}}}')
        # "?&var-cluster=..." when nothing precedes it: an empty pair, which URLs allow.
        topology = [label for label in self.config.topology_labels if label not in _DASHBOARD_VARS]
        query = "?" + "&".join(params) if params or topology else ""
        for label in topology:
            value = "{{ . | urlquery }}"
            query += f"{{{{ with $labels.{label} }}}}&var-{label}={value}{{{{ end }}}}"
        return f"{self.config.dashboard_url.rstrip('/')}/d/{uid}{query}"

    def alert(
        self,
        name: str,
        expr: str,
        duration: str,
        severity: str,
        summary: str,
        description: str,
        dashboard: str,
        extra_labels: dict[str, str] | None = None,
        keep_firing_for: str = "0s",
    ) -> dict[str, Any]:
        labels = {"severity": severity, **(extra_labels or {})}
        rule: dict[str, Any] = {"alert": name, "expr": expr.strip(), "for": duration}
        if duration_seconds(keep_firing_for) > 0:
            rule["keep_firing_for"] = keep_firing_for
        rule["labels"] = labels
        rule["annotations"] = {
            "summary": summary,
            "description": " ".join(description.split()),
            "runbook_url": f"{self.config.runbook_url}#{runbook_anchor(name)}",
            "dashboard_url": dashboard,
        }
        return rule

    # --- the alerts ---------------------------------------------------------------------------
    def prefix_collapse(self) -> list[dict[str, Any]]:
        config, promql, names = self.config, self.promql, self.names
        short, long, baseline = names.short, names.long, names.baseline
        factor = number(config.collapse_drop_factor)
        min_baseline = number(config.collapse_min_baseline)
        engine_floor = number(config.collapse_engine_min_tokens_per_second)
        caller_floor = number(config.collapse_caller_min_tokens_per_second)
        selector = promql.sel()
        # The short-window ratio against the baseline the cache holds when it works (not
        # against the long-window ratio, which a collapse drags down with it within the
        # hour), where that baseline is above the minimum (the filter drops the others; the
        # baseline is read once: per caller, every series read costs). Traffic above the
        # floor now AND one window earlier: a collapse happens while traffic continues, so
        # one cold turn after a quiet spell can never page.
        engine_expr = f"""
{names.target_hit_ratio[short]}{selector}
  < {factor} * ({names.target_hit_ratio[baseline]}{selector} > {min_baseline})
and {names.target_queries[short]}{selector} > {engine_floor}
and {names.target_queries[short]}{selector} offset {config.short_window} > {engine_floor}"""
        caller_expr = f"""
{names.caller_hit_ratio[short]}{selector}
  < {factor} * ({names.caller_hit_ratio[baseline]}{selector} > {min_baseline})
and {names.caller_prompt[short]}{selector} > {caller_floor}
and {names.caller_prompt[short]}{selector} offset {config.short_window} > {caller_floor}"""
        # One replica (target) of many that keeps evicting a caller: its ratio there against
        # the caller's own baseline (over every replica: what its cache does when it works),
        # with the traffic floor on that replica, unless the caller collapsed everywhere
        # (the caller scope pages that once, not once per replica). __other__ is the
        # exporter's overflow of targets, no replica.
        caller_on = promql.on(*CALLER)
        target_selector = promql.sel('target!="__other__"')
        caller_target_expr = f"""
{names.caller_target_hit_ratio}{target_selector}
  < {caller_on} group_left ()
    ({factor} * ({names.caller_hit_ratio[baseline]}{selector} > {min_baseline}))
and {names.caller_target_prompt}{selector} > {caller_floor}
and {names.caller_target_prompt}{selector} offset {config.short_window} > {caller_floor}
unless {caller_on}
(
{caller_expr.strip()}
)"""
        engine_baseline = self.query_value(
            names.target_hit_ratio[baseline], TARGET, "humanizePercentage"
        )
        engine_long_ratio = self.query_value(
            names.target_hit_ratio[long], TARGET, "humanizePercentage"
        )
        engine_traffic = self.query_value(names.target_queries[short], TARGET, "humanize")
        caller_baseline = self.query_value(
            names.caller_hit_ratio[baseline], CALLER, "humanizePercentage"
        )
        caller_long_ratio = self.query_value(
            names.caller_hit_ratio[long], CALLER, "humanizePercentage"
        )
        caller_traffic = self.query_value(names.caller_prompt[short], CALLER, "humanize")
        # Minutes of prefill over the long window: the recorded seconds per second times
        # its length, rounded (printf, not humanizeDuration, which truncates 479.99 s to
        # 7m 59s). Each sentence only where its series exists (docs/runbook.md says how they
        # are estimated).
        minutes = number(config.long_seconds / 60)
        prefill_saved = self.query_text(
            f"{minutes} * {names.caller_prefill_saved}",
            CALLER,
            'printf "%.0fm"',
            f" Over the last {config.long_window} the cache saved it about {{value}} of prefill.",
        )
        prefill_lost = self.query_text(
            f"{minutes} * {names.caller_prefill_lost}",
            CALLER,
            'printf "%.0fm"',
            " Evictions cost it about {value}.",
        )
        caller_ratio = self.query_value(names.caller_hit_ratio[short], CALLER, "humanizePercentage")
        replica_traffic = self.query_value(names.caller_target_prompt, CALLER_TARGET, "humanize")
        return [
            self.alert(
                "VllmCachePrefixCollapse",
                engine_expr,
                config.collapse_for,
                config.collapse_severity,
                "The prefix-cache hit ratio of a vLLM engine collapsed while prompt traffic "
                "continues.",
                f"""vLLM {{{{ $labels.target }}}} ({{{{ $labels.model_name }}}}) served
                {{{{ $value | humanizePercentage }}}} of looked-up prompt tokens from its prefix
                cache over the last {config.short_window} ({engine_long_ratio} over the last
                {config.long_window}), against its baseline of {engine_baseline} (over the last
                {config.baseline_window}), while still looking up {engine_traffic} prompt
                tokens/s.""",
                self.dashboard_link(config.overview_uid, TARGET),
                {"scope": "engine"},
                keep_firing_for=config.collapse_keep_firing_for,
            ),
            self.alert(
                "VllmCachePrefixCollapse",
                caller_expr,
                config.collapse_for,
                config.collapse_severity,
                "The prefix-cache hit ratio of a caller collapsed while its prompt traffic "
                "continues.",
                f"""Caller {{{{ $labels.caller }}}} on {{{{ $labels.model }}}} got
                {{{{ $value | humanizePercentage }}}} of its prompt tokens from the prefix cache
                over the last {config.short_window} ({caller_long_ratio} over the last
                {config.long_window}), against its baseline of {caller_baseline} (over the last
                {config.baseline_window}), while still sending {caller_traffic} prompt
                tokens/s.{prefill_saved}{prefill_lost}""",
                self.dashboard_link(config.caller_uid, CALLER),
                {"scope": "caller"},
                keep_firing_for=config.collapse_keep_firing_for,
            ),
            self.alert(
                "VllmCachePrefixCollapse",
                caller_target_expr,
                config.collapse_for,
                config.collapse_severity,
                "The prefix-cache hit ratio of a caller collapsed on one vLLM replica while its "
                "prompt traffic there continues.",
                f"""Caller {{{{ $labels.caller }}}} on {{{{ $labels.model }}}} got
                {{{{ $value | humanizePercentage }}}} of its prompt tokens from the prefix cache
                of replica {{{{ $labels.target }}}} over the last {config.short_window}, against
                its baseline of {caller_baseline} (over every replica, the last
                {config.baseline_window}), while still sending {replica_traffic} prompt
                tokens/s there; over every replica it got {caller_ratio}. That replica evicts
                this caller's prefixes: check how the gateway routes the caller, that
                replica's KV pool and its preemptions.""",
                self.dashboard_link(config.caller_uid, CALLER),
                {"scope": "caller_target"},
                keep_firing_for=config.collapse_keep_firing_for,
            ),
        ]

    def warm_ttft_collapse(self) -> dict[str, Any]:
        config, promql, names = self.config, self.promql, self.names
        warm_share = names.caller_warm_share[names.baseline]
        median = names.caller_ttft["p50"]
        # vLLM's own TTFT where it measured the caller's turns in the window, else the
        # proxy's: a proxy's figure still holds vLLM's queue, which is not the cache.
        expr = f"""
(
  {median}{promql.sel('source="engine"')}
  or ignoring (source)
  {median}{promql.sel('source!="engine"')}
) > {number(config.warm_ttft_seconds)}
and {promql.on(*CALLER)} {warm_share}{promql.sel()} > {number(config.warm_ttft_min_warm_share)}
and {promql.on(*CALLER)}
{names.caller_classified_requests[names.short]}{promql.sel()}
  > {number(config.warm_ttft_min_requests_per_second)}"""
        share = self.query_value(warm_share, CALLER, "humanizePercentage")
        return self.alert(
            "VllmCacheWarmTTFTCollapse",
            expr,
            config.warm_ttft_for,
            config.warm_ttft_severity,
            "Turns that should be warm take a minute or more to their first token.",
            f"""Caller {{{{ $labels.caller }}}} on {{{{ $labels.model }}}}: the median
            engine-side time to first token of its turns{{{{ if eq $labels.source "proxy" }}}}
            (measured at the proxy, vLLM's own queue included){{{{ end }}}} over the last
            {config.short_window} is {{{{ $value | humanizeDuration }}}}, although its
            baseline warm share is {share} (over the last {config.baseline_window}). Seconds
            means the cache held; a minute means it was evicted or the engine is shared too
            widely.""",
            self.dashboard_link(config.caller_uid, CALLER),
            keep_firing_for=config.warm_ttft_keep_firing_for,
        )

    def prefix_caching_disabled(self) -> dict[str, Any]:
        config, promql = self.config, self.promql
        expr = (
            f"max {promql.by(*TARGET)} "
            f"({families.ENGINE_PREFIX_CACHING_ENABLED.series}{promql.sel()}) == 0"
        )
        return self.alert(
            "VllmCachePrefixCachingDisabled",
            expr,
            config.prefix_caching_disabled_for,
            config.prefix_caching_disabled_severity,
            "vLLM runs with prefix caching off.",
            """vLLM {{ $labels.target }} serves {{ $labels.model_name }} with
            enable_prefix_caching=False, so every turn re-reads its whole prompt. Hybrid
            models often default to off; start vLLM with --enable-prefix-caching.""",
            self.dashboard_link(config.overview_uid, TARGET),
        )

    def cached_tokens_not_reported(self) -> dict[str, Any]:
        config, promql, names = self.config, self.promql, self.names
        expr = f"""
{names.caller_unreported[names.long]}{promql.sel()} > 0
unless
{names.caller_prompt[names.long]}{promql.sel()} > 0"""
        return self.alert(
            "VllmCacheCachedTokensNotReported",
            expr,
            config.not_reported_for,
            config.not_reported_severity,
            "vLLM does not report cached tokens per request, so this caller's hit ratio is "
            "unknown.",
            f"""Caller {{{{ $labels.caller }}}} on {{{{ $labels.model }}}} sent
            {{{{ $value | humanize }}}} prompt tokens/s over the last {config.long_window} without
            prompt_tokens_details.cached_tokens in the usage, and none with it. Start vLLM
            with --enable-prompt-tokens-details (streaming clients also need
            stream_options.include_usage).""",
            self.dashboard_link(config.caller_uid, CALLER),
        )

    def preemptions(self) -> dict[str, Any]:
        config, promql, names = self.config, self.promql, self.names
        expr = (
            f"{names.target_preemptions}{promql.sel()} * 60 > "
            f"{number(config.preemptions_per_minute)}"
        )
        return self.alert(
            "VllmCachePreemptions",
            expr,
            config.preemptions_for,
            config.preemptions_severity,
            "vLLM keeps preempting requests because the running ones do not fit its KV pool.",
            f"""vLLM {{{{ $labels.target }}}} ({{{{ $labels.model_name }}}}) preempted
            {{{{ $value | humanize }}}} requests per minute over the last {config.short_window};
            a preempted request loses its KV blocks and is recomputed later.""",
            self.dashboard_link(config.overview_uid, TARGET),
        )

    def kv_pool_near_full(self) -> dict[str, Any]:
        config, promql, names = self.config, self.promql, self.names
        expr = f"{names.target_kv_used_ratio}{promql.sel()} > {number(config.kv_pool_full_ratio)}"
        pool = self.query_value(names.target_kv_pool_tokens, TARGET, "humanize")
        return self.alert(
            "VllmCacheKVPoolNearFull",
            expr,
            config.kv_pool_full_for,
            config.kv_pool_full_severity,
            "The KV-cache pool of a vLLM engine is nearly full.",
            f"""vLLM {{{{ $labels.target }}}} ({{{{ $labels.model_name }}}}) has
            {{{{ $value | humanizePercentage }}}} of its {pool}-token KV pool in use: the
            conversations it runs at once barely fit, and the next one will evict or preempt
            another.""",
            self.dashboard_link(config.overview_uid, TARGET),
        )

    def conversations_exceed_pool(self) -> dict[str, Any]:
        """Foresight: the live conversations cannot all stay cached. True as soon as the
        conversation that tips the sum over the pool has finished its first turn, which is
        before the turns it evicts come back cold and the hit ratio falls."""
        config, promql, names = self.config, self.promql, self.names
        selector = promql.sel()
        # The budget is the exporter's own series (recorded at its lowest over the pool's
        # window): an operator who changes --signals.admission-headroom moves this line.
        expr = f"""
{names.target_demand}{selector}
  > {names.target_budget}{selector}
and {names.target_conversations}{selector} >= {number(config.conversations_min_active)}"""
        active = self.query_value(names.target_conversations, TARGET, "humanize")
        pool = self.query_value(names.target_kv_pool_tokens, TARGET, "humanize")
        fit = self.query_value(names.target_fit_ratio, TARGET, "humanizePercentage")
        budget = self.query_value(names.target_budget, TARGET, "humanize")
        return self.alert(
            "VllmCacheConversationsExceedKVPool",
            expr,
            config.conversations_for,
            config.conversations_severity,
            "The conversations active on a vLLM engine no longer fit its KV pool together.",
            f"""{active} conversations active on vLLM {{{{ $labels.target }}}}
            ({{{{ $labels.model_name }}}}) need {{{{ $value | humanize }}}} tokens of KV cache
            to keep their prefixes, {fit} of its {pool}-token pool and more than its
            {budget}-token admission budget (the smallest pool seen less the exporter's
            --signals.admission-headroom, room for their next turns): each turn will evict
            another conversation's prefix, and the hit ratio will collapse. Gate admission by
            tokens, under that budget, or let fewer conversations share this engine.""",
            self.dashboard_link(config.overview_uid, TARGET),
        )

    def prompt_variable_top(self) -> dict[str, Any]:
        """Prompt order: most of a caller's requests share their text with a recent one but
        not its beginning (the tap's fingerprints), so the prefix cache reuses none of it."""
        config, promql, names = self.config, self.promql, self.names
        selector = promql.sel()
        expr = f"""
{names.caller_order_share}{selector} > {number(config.prompt_order_share)}
and {names.caller_order_variable_top}{selector} * {number(config.long_seconds)}
  >= {number(config.prompt_order_min_requests)}"""
        shared = self.query_value(names.caller_order_shared_bytes, CALLER, "humanize")
        first = self.query_value(names.caller_order_first_difference, CALLER, "humanize")
        return self.alert(
            "VllmCachePromptVariableTop",
            expr,
            config.prompt_order_for,
            config.prompt_order_severity,
            "A caller's prompts share most of their text but not its beginning: something "
            "variable sits at the top, so the prefix cache reuses none of it.",
            f"""{{{{ $value | humanizePercentage }}}} of the requests caller
            {{{{ $labels.caller }}}} sent to {{{{ $labels.model }}}} over the last
            {config.long_window} (compared at the tap) share ~{shared} characters with a
            recent one but differ within the first {first}: a per-agent task, a timestamp or
            a request id ahead of the shared text. Put the shared text first, byte-identical
            in every request, and the varying part last.""",
            self.dashboard_link(config.caller_uid, CALLER),
        )

    def unseen_history(self) -> dict[str, Any]:
        """Several exporters behind one stream, split by request instead of by session: a
        share of a model's turns cached more than the exporter saw of their conversation."""
        config, promql, names = self.config, self.promql, self.names
        selector = promql.sel()
        expr = f"""
{names.model_unseen_share}{selector} > {number(config.unseen_history_share)}
and {names.model_unseen}{selector} * {number(config.long_seconds)}
  >= {number(config.unseen_history_min_requests)}"""
        return self.alert(
            "VllmCacheUnseenHistory",
            expr,
            config.unseen_history_for,
            config.unseen_history_severity,
            "Many turns find more cached than the exporter saw of their conversation: the "
            "stream is split over exporters by request, not by session.",
            f"""{{{{ $value | humanizePercentage }}}} of the turns to {{{{ $labels.model }}}}
            over the last {config.long_window} had more tokens cached than the exporter that
            counted them saw of their conversation: their earlier turns went through another
            exporter. Their warm/cold classification, follow-ups and the conversations' demand
            on the KV pool are misread. Route each session to one exporter (sticky by session
            id, or by caller), or send every usage event to one exporter.""",
            self.dashboard_link(config.overview_uid, ("model",)),
        )

    def conversations_dropped(self) -> dict[str, Any]:
        """More conversations are live than --signals.conversations-max holds: the exporter
        drops ones still in use, and their next turns are classified unknown. Either counter
        growing says so: drops of active ones, or turns of ones dropped before their second
        turn (with many more live than the bound, most are)."""
        config, promql = self.config, self.promql
        window = config.short_window
        selector = promql.sel()
        dropped = promql.dedup(
            f"increase({families.CONVERSATIONS_DROPPED.total}{selector}[{window}])"
        )
        turns = promql.dedup(
            f"increase({families.DROPPED_CONVERSATION_TURNS.total}{selector}[{window}])"
        )
        expr = f"""
{dropped} > 0
or
{turns} > 0"""
        return self.alert(
            "VllmCacheConversationsDropped",
            expr,
            config.conversations_dropped_for,
            config.conversations_dropped_severity,
            "The exporter forgets conversations still in use, so their next turns cannot be "
            "classified.",
            f"""Exporter {{{{ $labels.instance }}}} has been dropping conversations still in
            use for {config.conversations_dropped_for}: more are live than
            --signals.conversations-max holds. Their next turns are classified unknown, not
            warm, partial or cold, so the warm share and the warm and cold TTFT leave them
            out, and the conversations' demand on the KV pool is a lower bound (tokens and
            hit ratios stay exact). Raise --signals.conversations-max above the live
            conversations (about 280 bytes each).""",
            self.dashboard_link(config.overview_uid, ()),
        )

    def engine_down(self) -> dict[str, Any]:
        config, promql = self.config, self.promql
        return self.alert(
            "VllmCacheEngineDown",
            promql.dedup(f"{families.ENGINE_UP.series}{promql.sel()}") + " == 0",
            config.engine_down_for,
            config.engine_down_severity,
            "The exporter cannot read a vLLM engine's metrics.",
            f"""Exporter {{{{ $labels.instance }}}} has failed to read
            {{{{ $labels.target }}}} for {config.engine_down_for}: vLLM is down, restarting, or
            unreachable from the exporter. Its cache signals are absent meanwhile.""",
            self.dashboard_link(config.overview_uid, ("target",)),
        )

    def exporter_down(self) -> dict[str, Any]:
        config, promql = self.config, self.promql
        return self.alert(
            "VllmCacheExporterDown",
            promql.dedup(f"up{promql.sel()}") + " == 0",
            config.exporter_down_for,
            config.exporter_down_severity,
            "Prometheus cannot scrape vllm-cache-exporter, so no cache alert can fire.",
            f"""Prometheus has failed to scrape {{{{ $labels.instance }}}} (job
            {{{{ $labels.job }}}}) for {config.exporter_down_for}; every prefix-cache alert is
            blind until it is back.""",
            self.dashboard_link(config.overview_uid, ()),
        )

    def exporter_absent(self) -> dict[str, Any]:
        """No exporter of a topology group has a sample any more, although one had within
        ``exporter_absent_window``; or none of the selector exists at all. VllmCacheExporterDown
        needs an ``up`` of 0, which a crashed Prometheus agent, a remote write that stopped or
        a target dropped from service discovery never writes: the series just end."""
        config, promql = self.config, self.promql
        topology = promql.by()
        recent = f"max_over_time(up{promql.sel()}[{config.exporter_absent_window}])"
        expr = f"""
group {topology} ({recent})
unless {promql.on()}
group {topology} (up{promql.sel()})
or
absent(up{promql.sel()})"""
        return self.alert(
            "VllmCacheExporterAbsent",
            expr,
            config.exporter_absent_for,
            config.exporter_absent_severity,
            "No sample of vllm-cache-exporter reaches this Prometheus, so no cache alert can fire.",
            f"""No exporter of job {{{{ $labels.job }}}}{{{{ with $labels.cluster }}}} in
            cluster {{{{ . }}}}{{{{ end }}}}{{{{ with $labels.namespace }}}} in namespace
            {{{{ . }}}}{{{{ end }}}} has an `up` sample any more (one had within the last
            {config.exporter_absent_window}, or none ever did): the Prometheus or agent that
            scrapes them stopped writing here, or service discovery no longer finds them.
            Every prefix-cache alert of these exporters is blind.""",
            self.dashboard_link(config.overview_uid, ()),
        )

    def duplicate_target(self) -> dict[str, Any]:
        """Two exporters (instances) report one vLLM target under the same topology labels:
        the per-target rules sum them into one engine, doubling pools and merging hit
        ratios. Sidecars all read http://localhost:8000/metrics; without the relabelling of
        ``target`` to the pod they are indistinguishable."""
        config, promql = self.config, self.promql
        expr = (
            f"count {promql.by('target')} "
            f"({promql.dedup(f'{families.ENGINE_UP.series}{promql.sel()}')}) > 1"
        )
        return self.alert(
            "VllmCacheDuplicateTarget",
            expr,
            config.duplicate_target_for,
            config.duplicate_target_severity,
            "Several exporters report the same vLLM target, so the per-engine rules merge "
            "different engines into one.",
            """{{ $value }} exporters report vLLM {{ $labels.target }} under the same labels:
            every target_model:* series sums them as one engine (pools, KV in use, hit
            ratio). Sidecars that read vLLM on localhost need their target label rewritten to
            the pod (deploy/kubernetes/servicemonitor.yaml), or a topology label that tells
            them apart.""",
            self.dashboard_link(config.overview_uid, ("target",)),
        )

    def engine_metric_absent(self) -> dict[str, Any]:
        config, promql = self.config, self.promql
        signals = 'signal=~"' + "|".join(config.required_signals) + '"'
        return self.alert(
            "VllmCacheEngineMetricAbsent",
            promql.dedup(f"{families.ENGINE_METRIC_PRESENT.series}{promql.sel(signals)}") + " == 0",
            config.metric_absent_for,
            config.metric_absent_severity,
            "vLLM no longer exposes a metric the cache rules depend on.",
            """vLLM {{ $labels.target }} exposes no metric for the {{ $labels.signal }}
            signal under any name the exporter knows: a vLLM upgrade renamed or dropped it.
            Panels and alerts built on it show nothing, not a reassuring 0.""",
            self.dashboard_link(config.overview_uid, ("target",)),
        )


# Per-caller alerts on series recorded every caller_detail_interval or caller_long_interval
# (two minutes): evaluated as often as those, in their own group, since each reads a series
# per caller and evaluating them every 15 s adds nothing to what a series that old says.
CALLER_MINUTE_ALERTS = (
    "VllmCacheWarmTTFTCollapse",
    "VllmCacheCachedTokensNotReported",
    "VllmCachePromptVariableTop",
)


# Scopes of an alert otherwise evaluated every interval that read such series: the collapse
# per caller and replica reads caller_model_target:*, recorded with the caller detail.
CALLER_MINUTE_SCOPES = ("caller_target",)


def _reads_minute_series(rule: dict[str, Any]) -> bool:
    return (
        rule["alert"] in CALLER_MINUTE_ALERTS or rule["labels"].get("scope") in CALLER_MINUTE_SCOPES
    )


def alert_rule_groups(config: MonitoringConfig) -> list[dict[str, Any]]:
    alerts = _Alerts(config)
    rules = [
        *alerts.prefix_collapse(),
        alerts.warm_ttft_collapse(),
        alerts.prefix_caching_disabled(),
        alerts.cached_tokens_not_reported(),
        alerts.preemptions(),
        alerts.kv_pool_near_full(),
        alerts.conversations_exceed_pool(),
        alerts.prompt_variable_top(),
        alerts.unseen_history(),
        alerts.conversations_dropped(),
        alerts.engine_down(),
        alerts.engine_metric_absent(),
        alerts.exporter_down(),
        alerts.exporter_absent(),
        alerts.duplicate_target(),
    ]
    group: dict[str, Any] = {"name": "vllm-cache.alerts"}
    if config.rule_interval:
        group["interval"] = config.rule_interval
    group["rules"] = [rule for rule in rules if not _reads_minute_series(rule)]
    callers = {
        "name": "vllm-cache-caller.alerts",
        "interval": config.caller_detail_interval,
        "rules": [rule for rule in rules if _reads_minute_series(rule)],
    }
    return [group, callers]
