"""Foresight series: live conversation demand, the smallest pool and the admission budget,
declared vs used completion tokens, prompt order. A public contract like the others: add,
never rename.

Gauges of demand are computed at scrape time from the tracked conversations (those seen
within the idle window); ratios (demand over the pool, declared over used) are PromQL.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from exporter import families
from exporter.signals import foresight
from exporter.signals.engine import EngineState
from exporter.signals.usage import COMPLETION_BUCKETS, Histogram, UsageState

_COMPLETION_LE = [floatToGoString(bound) for bound in COMPLETION_BUCKETS] + ["+Inf"]
_ZERO_COMPLETION = Histogram(COMPLETION_BUCKETS)

USED = families.COMPLETION_USED_TOKENS


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
        active = families.gauge(families.CONVERSATIONS_ACTIVE)
        demand = families.gauge(families.CONVERSATIONS_DEMAND_TOKENS)
        live = foresight.live_demand(tracker, self.engine, now)  # one pass for both sums
        for model, part in sorted(tracker.by_model(now, live).items()):
            active.add_metric([model], part.conversations)
            demand.add_metric([model], part.tokens)
        engine_active = families.gauge(families.ENGINE_CONVERSATIONS_ACTIVE)
        engine_demand = families.gauge(families.ENGINE_CONVERSATIONS_DEMAND_TOKENS)
        for (target, model_name), part in sorted(
            foresight.by_target(tracker, self.engine, now, live).items()
        ):
            engine_active.add_metric([target, model_name], part.conversations)
            engine_demand.add_metric([target, model_name], part.tokens)
        dropped = families.counter(families.CONVERSATIONS_DROPPED)
        dropped.add_metric([], tracker.dropped_active)
        dropped_turns = families.counter(families.DROPPED_CONVERSATION_TURNS)
        dropped_turns.add_metric([], tracker.dropped_turns)
        idle = families.gauge(families.CONVERSATION_IDLE_WINDOW_SECONDS)
        idle.add_metric([], tracker.idle_seconds)
        turns = families.counter(families.CONVERSATION_TURNS)
        unseen = families.counter(families.UNSEEN_HISTORY_REQUESTS)
        for model in sorted(tracker.models):
            turns.add_metric([model], tracker.turns.get(model, 0))
            unseen.add_metric([model], tracker.unseen_history.get(model, 0))
        yield from (
            active,
            demand,
            engine_active,
            engine_demand,
            dropped,
            dropped_turns,
            idle,
            turns,
            unseen,
        )

    def _pools(self) -> Iterator[Metric]:
        headroom = self.usage.conversations.settings.admission_headroom_tokens
        smallest = families.gauge(families.ENGINE_KV_POOL_MIN_TOKENS)
        budget = families.gauge(families.ENGINE_ADMISSION_BUDGET_TOKENS)
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
        used = families.histogram(families.COMPLETION_USED_TOKENS)
        declared = families.counter(families.COMPLETION_DECLARED_TOKENS)
        for (caller, model), series in sorted(usage.costly.items()):
            hist = series.completion
            if hist is None:
                continue
            held = hist.shown_from > now or series.shown_from > now
            shown = _ZERO_COMPLETION if held else hist
            labels = {"caller": caller, "model": model}
            running = 0
            for le, count in zip(_COMPLETION_LE, shown.counts, strict=True):
                running += count
                used.samples.append(Sample(USED.bucket, {**labels, "le": le}, running))
            used.samples.append(Sample(USED.count, labels, running))
            used.samples.append(Sample(USED.sum, labels, shown.total))
            declared.add_metric([caller, model], 0 if held else series.declared_completion_tokens)
        yield from (used, declared)

    def _prompt_order(self) -> Iterator[Metric]:
        usage = self.usage
        now = usage.now()
        compared = families.counter(families.PROMPT_ORDER_COMPARED)
        variable = families.counter(families.PROMPT_ORDER_VARIABLE_TOP)
        shared = families.counter(families.PROMPT_ORDER_SHARED_BYTES)
        first = families.counter(families.PROMPT_ORDER_FIRST_DIFFERENCE_BYTES)
        for (caller, model), series in sorted(usage.costly.items()):
            counts = series.order
            if counts is None:
                continue
            held = counts.shown_from > now or series.shown_from > now
            values = (
                (0, 0, 0, 0)
                if held
                else (
                    counts.compared,
                    counts.variable_top,
                    counts.shared_bytes,
                    counts.first_difference_bytes,
                )
            )
            for family, number in zip((compared, variable, shared, first), values, strict=True):
                family.add_metric([caller, model], number)
        window = families.gauge(families.PROMPT_ORDER_WINDOW_SECONDS)
        window.add_metric([], usage.order.window_seconds)
        yield from (compared, variable, shared, first, window)
