"""Foresight series: live conversation demand, the smallest pool and the admission budget,
declared vs used completion tokens, prompt order. A public contract like the others: add,
never rename.

Gauges of demand are computed at scrape time from the tracked conversations (those seen
within the idle window); ratios (demand over the pool, declared over used) are PromQL.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from exporter.signals import foresight
from exporter.signals.engine import EngineState
from exporter.signals.usage import COMPLETION_BUCKETS, Histogram, UsageState

ROW_LABELS = ["target", "model_name", "engine"]
_COMPLETION_LE = [floatToGoString(bound) for bound in COMPLETION_BUCKETS] + ["+Inf"]
_ZERO_COMPLETION = Histogram(COMPLETION_BUCKETS)

USED = "vllm_cache_completion_used_tokens"
DECLARED = "vllm_cache_completion_declared_tokens"


class ForesightCollector:
    def __init__(self, engine: EngineState, usage: UsageState) -> None:
        self.engine = engine
        self.usage = usage

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        yield from self._conversations()
        yield from self._pools()
        yield from self._completions()
        yield from self._prompt_order()

    def _conversations(self) -> Iterator[Metric]:
        usage = self.usage
        tracker = usage.conversations
        now = usage.now()
        active = GaugeMetricFamily(
            "vllm_cache_conversations_active",
            "Conversations (sessions, else caller and model) with a successful turn within "
            "the idle window (--signals.conversation-idle).", labels=["model"])
        demand = GaugeMetricFamily(
            "vllm_cache_conversations_demand_tokens",
            "KV-pool tokens the active conversations need to stay cached: each one's latest "
            "context (prompt + completion of its last turn) in whole KV blocks, plus on a "
            "hybrid model one copy of its recurrent state and one for the turn being computed, "
            "in the terms of the pool of the vLLM serving the model (vllm:cache_config_info).",
            labels=["model"])
        live = foresight.live_demand(tracker, self.engine, now)  # one pass for both sums
        for model, part in sorted(tracker.by_model(now, live).items()):
            active.add_metric([model], part.conversations)
            demand.add_metric([model], part.tokens)
        engine_active = GaugeMetricFamily(
            "vllm_cache_engine_conversations_active",
            "vllm_cache_conversations_active, attributed to the one vLLM whose pool they use "
            "(see docs/metrics.md, Foresight).", labels=["target", "model_name"])
        engine_demand = GaugeMetricFamily(
            "vllm_cache_engine_conversations_demand_tokens",
            "vllm_cache_conversations_demand_tokens, attributed to the one vLLM whose pool "
            "they use; compare with vllm_cache_engine_kv_pool_tokens.",
            labels=["target", "model_name"])
        for (target, model_name), part in sorted(
                foresight.by_target(tracker, self.engine, now, live).items()):
            engine_active.add_metric([target, model_name], part.conversations)
            engine_demand.add_metric([target, model_name], part.tokens)
        dropped = CounterMetricFamily(
            "vllm_cache_conversations_dropped",
            "Conversations forgotten while still active because more than "
            "--signals.conversations-max were tracked: demand is then a lower bound.")
        dropped.add_metric([], tracker.dropped_active)
        idle = GaugeMetricFamily(
            "vllm_cache_conversation_idle_window_seconds",
            "How long after its last turn a conversation still counts as active "
            "(--signals.conversation-idle).")
        idle.add_metric([], tracker.idle_seconds)
        yield from (active, demand, engine_active, engine_demand, dropped, idle)

    def _pools(self) -> Iterator[Metric]:
        headroom = self.usage.conversations.settings.admission_headroom_tokens
        smallest = GaugeMetricFamily(
            "vllm_cache_engine_kv_pool_min_tokens",
            "Smallest KV-cache pool this engine reported since the exporter started, across "
            "vLLM restarts (the pool moves from boot to boot).", labels=ROW_LABELS)
        budget = GaugeMetricFamily(
            "vllm_cache_engine_admission_budget_tokens",
            "Tokens a token-gating proxy in front of this engine may admit at once: the "
            "smallest pool seen less --signals.admission-headroom.", labels=ROW_LABELS)
        for state in sorted(self.engine.targets.values(), key=lambda state: state.shown):
            if not state.up:
                continue
            for row in state.rows:
                pool = state.smallest_pool.get(row.engine)
                if pool is None:
                    continue
                labels = [state.shown, row.model_name, row.engine]
                smallest.add_metric(labels, pool)
                budget.add_metric(labels, foresight.admission_budget(pool, headroom))
        yield from (smallest, budget)

    def _completions(self) -> Iterator[Metric]:
        usage = self.usage
        now = usage.now()
        used = HistogramMetricFamily(
            USED,
            "Completion tokens generated by successful requests that declared a max_tokens "
            "(what they used of the completion budget they declared).",
            labels=["caller", "model"])
        declared = CounterMetricFamily(
            DECLARED,
            "Completion tokens those same requests declared (their max_tokens, summed): over "
            "the histogram's _count, the mean declared budget.", labels=["caller", "model"])
        for (caller, model), series in sorted(usage.series.items()):
            hist = series.completion
            if hist is None:
                continue
            held = hist.shown_from > now or series.shown_from > now
            shown = _ZERO_COMPLETION if held else hist
            labels = {"caller": caller, "model": model}
            running = 0
            for le, count in zip(_COMPLETION_LE, shown.counts, strict=True):
                running += count
                used.samples.append(Sample(USED + "_bucket", {**labels, "le": le}, running))
            used.samples.append(Sample(USED + "_count", labels, running))
            used.samples.append(Sample(USED + "_sum", labels, shown.total))
            declared.add_metric([caller, model],
                                0 if held else series.declared_completion_tokens)
        yield from (used, declared)

    def _prompt_order(self) -> Iterator[Metric]:
        usage = self.usage
        now = usage.now()
        labels = ["caller", "model"]
        compared = CounterMetricFamily(
            "vllm_cache_prompt_order_compared",
            "Requests whose prompt the tap compared with a recent one of the same caller and "
            "model (within --signals.prompt-order-window; fingerprints, never text).",
            labels=labels)
        variable = CounterMetricFamily(
            "vllm_cache_prompt_order_variable_top",
            "Of those, requests that share most of their text with a recent one but not its "
            "beginning: something variable sits at the top of the prompt, so the prefix "
            "cache cannot reuse the shared text.", labels=labels)
        shared = CounterMetricFamily(
            "vllm_cache_prompt_order_shared_bytes",
            "Bytes of prompt (as sent, about characters) those requests share with the "
            "recent one, summed: over variable_top, the mean shared length.", labels=labels)
        first = CounterMetricFamily(
            "vllm_cache_prompt_order_first_difference_bytes",
            "Bytes into the prompt within which those requests first differ from the recent "
            "one, summed: over variable_top, where the variable part sits.", labels=labels)
        for (caller, model), series in sorted(usage.series.items()):
            counts = series.order
            if counts is None:
                continue
            held = counts.shown_from > now or series.shown_from > now
            values = (0, 0, 0, 0) if held else (
                counts.compared, counts.variable_top, counts.shared_bytes,
                counts.first_difference_bytes)
            for family, number in zip((compared, variable, shared, first), values,
                                      strict=True):
                family.add_metric([caller, model], number)
        window = GaugeMetricFamily(
            "vllm_cache_prompt_order_window_seconds",
            "How close in time two requests of a caller and model must be to be compared for "
            "prompt order (--signals.prompt-order-window).")
        window.add_metric([], usage.order.window_seconds)
        yield from (compared, variable, shared, first, window)
