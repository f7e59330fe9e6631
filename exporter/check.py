"""``vllm-cache-exporter check``: one look at a vLLM's /metrics, in plain words.

The field reports' (docs/field-reports.md) worst hours went to things one read of /metrics
shows: prefix caching silently off (the hybrid default in older vLLM), a renamed counter
that a dashboard read as a reassuring 0, a KV pool too small for the conversations it has to
hold. This command reads each vLLM once through the exporter's own engine reader and says
what it finds, before any Prometheus or Grafana is set up. Exit status: 0 nothing wrong, 1 a
problem found, 2 bad flags, 3 a condition that pages holds now (with ``--exporter.url``: the
exporter's status model says an alert of critical severity, VllmCachePrefixCollapse as
shipped, has its condition true; the line starting ``PAGE:`` names it).

It also says how many tokens of conversation fit: the pool, the smallest pool it can know of,
the admission budget under it; and, given ``--exporter.url`` (a running exporter, which has
seen the usage and every vLLM boot since it started), whether the live conversations fit and
what each caller declares against what it uses. The sentences come from
``exporter.signals.advice``, shared with the other surfaces that say the same.

Two flags of vLLM's API server decide what the per-request readers see and show in no metric:
``--enable-prompt-tokens-details`` and ``--enable-per-request-metrics``. The report names both
(the tap logs when an answer lacks the second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from exporter.config import metrics_url
from exporter.engine import names
from exporter.engine.fetch import FetchError, decode_and_parse, fetch_body
from exporter.engine.parse import Samples
from exporter.redaction import redact_text, redact_url
from exporter.server import STATUS_ROUTE
from exporter.signals import advice, kvpool, prefill, timing
from exporter.signals.foresight import admission_budget
from exporter.values import EngineSnapshot, EngineValues, HistogramValue

# Signals whose absence breaks the cache signals (a problem), and those that only exist in
# newer vLLM releases or with a flag (a note).
REQUIRED = (
    names.PREFIX_CACHE_QUERIES,
    names.PREFIX_CACHE_HITS,
    names.PREEMPTIONS,
    names.KV_USAGE,
    names.CACHE_CONFIG,
)
WHY_ABSENT = {
    names.PROMPT_TOKENS_CACHED.name: "vLLM before 0.16 has no vllm:prompt_tokens_cached_total",
    names.PROMPT_TOKENS_BY_SOURCE.name: "vLLM before 0.16 does not split prompt tokens by source",
    names.PROMPT_TOKENS_CACHED_BY_SOURCE.name: "vLLM before 0.32 does not split cached tokens "
    "by tier",
    names.REQUESTS_WAITING_BY_REASON.name: "vLLM before 0.20 does not say why requests wait",
    names.EXTERNAL_PREFIX_CACHE_QUERIES.name: "vLLM before 0.11.1 has no KV-connector counters",
    names.EXTERNAL_PREFIX_CACHE_HITS.name: "vLLM before 0.11.1 has no KV-connector counters",
}
RESIDENCY = (names.KV_BLOCK_LIFETIME, names.KV_BLOCK_IDLE_BEFORE_EVICT, names.KV_BLOCK_REUSE_GAP)
RESIDENCY_OFF = (
    "KV residency metrics are off: start vLLM with --kv-cache-metrics (and "
    "--kv-cache-metrics-sample, default 0.01 of the blocks) to see evictions: how long KV "
    "blocks live, how long they sit idle before they are evicted, and how soon they are "
    "reused. Blocks evicted sooner than their conversations come back is the collapse seen "
    "from inside."
)


@dataclass
class Report:
    target: str
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # conditions of alerts that page, holding now (each a sentence naming the alert)
    paging: list[str] = field(default_factory=list)


@dataclass
class ExporterView:
    """What check reads from a running exporter's /metrics: the foresight series."""

    # (target, model_name, engine) -> tokens
    smallest_pools: dict[tuple[str, str, str], float] = field(default_factory=dict)
    # (target, model_name) -> summed over its engines
    pools: dict[tuple[str, str], float] = field(default_factory=dict)
    active: dict[tuple[str, str], float] = field(default_factory=dict)
    demand: dict[tuple[str, str], float] = field(default_factory=dict)
    model_active: dict[str, float] = field(default_factory=dict)
    model_demand: dict[str, float] = field(default_factory=dict)
    idle_seconds: float | None = None
    # (caller, model) -> cumulative (le, count) buckets, their sum, and declared tokens
    used: dict[tuple[str, str], list[tuple[float, float]]] = field(default_factory=dict)
    used_sum: dict[tuple[str, str], float] = field(default_factory=dict)
    declared: dict[tuple[str, str], float] = field(default_factory=dict)
    # caller -> prompt tokens of requests without cached_tokens, and of requests with it
    unreported: dict[str, float] = field(default_factory=dict)
    reported: dict[str, float] = field(default_factory=dict)
    # source ("engine", "proxy") -> TTFT observations: who timed the turns
    timed_by: dict[str, float] = field(default_factory=dict)
    # caller -> (state, source) -> le -> TTFT observations, summed over its models
    ttft: dict[str, dict[tuple[str, str], dict[float, float]]] = field(default_factory=dict)
    # (caller, model) -> the prompt-order counters, by their name after the prefix
    order: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    # the exporter's status model (GET /api/v1/status), as the status page shows it
    status: dict[str, Any] | None = None

    def smallest_pool(self, target: str, engine: str) -> float | None:
        found = [
            pool
            for (where, _model, rank), pool in self.smallest_pools.items()
            if where == target and rank == engine
        ]
        return min(found) if found else None


ORDER_PREFIX = "vllm_cache_prompt_order_"
# The exit status while a condition that pages holds (above 1, a problem, and 2, bad flags).
EXIT_PAGING = 3


def read_exporter(text: str) -> ExporterView:
    """The foresight series of an exporter's exposition. Pure."""
    view = ExporterView()
    for name, labels, value in Samples(text):
        where = (labels.get("target", ""), labels.get("model_name", ""))
        pair = (labels.get("caller", ""), labels.get("model", ""))
        if name == "vllm_cache_engine_kv_pool_min_tokens":
            view.smallest_pools[(where[0], where[1], labels.get("engine", ""))] = value
        elif name == "vllm_cache_engine_kv_pool_tokens":
            view.pools[where] = view.pools.get(where, 0.0) + value
        elif name == "vllm_cache_engine_conversations_active":
            view.active[where] = value
        elif name == "vllm_cache_engine_conversations_demand_tokens":
            view.demand[where] = value
        elif name == "vllm_cache_conversations_active":
            view.model_active[labels.get("model", "")] = value
        elif name == "vllm_cache_conversations_demand_tokens":
            view.model_demand[labels.get("model", "")] = value
        elif name == "vllm_cache_conversation_idle_window_seconds":
            view.idle_seconds = value
        elif name == "vllm_cache_completion_used_tokens_bucket":
            view.used.setdefault(pair, []).append((float(labels["le"]), value))
        elif name == "vllm_cache_completion_used_tokens_sum":
            view.used_sum[pair] = value
        elif name == "vllm_cache_completion_declared_tokens_total":
            view.declared[pair] = value
        elif name == "vllm_cache_unreported_prompt_tokens_total":
            view.unreported[pair[0]] = view.unreported.get(pair[0], 0.0) + value
        elif name == "vllm_cache_prompt_tokens_total":
            view.reported[pair[0]] = view.reported.get(pair[0], 0.0) + value
        elif name.startswith(ORDER_PREFIX) and name.endswith("_total"):
            view.order.setdefault(pair, {})[name[len(ORDER_PREFIX) : -6]] = value
        elif name == "vllm_cache_ttft_seconds_bucket":
            buckets = view.ttft.setdefault(pair[0], {}).setdefault(
                (labels.get("state", ""), labels.get("source", "")), {}
            )
            bound = float(labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value
        elif name == "vllm_cache_ttft_seconds_count":
            source = labels.get("source", "")
            view.timed_by[source] = view.timed_by.get(source, 0.0) + value
    return view


def main(args: argparse.Namespace) -> int:
    if not args.vllm_url:
        print(
            "vllm-cache-exporter check: --vllm.url is required (the vLLM server to read, "
            "e.g. --vllm.url http://127.0.0.1:8000)",
            file=sys.stderr,
        )
        return 2
    reports = asyncio.run(
        check_all(
            [metrics_url(url) for url in args.vllm_url],
            args.vllm_timeout,
            args.vllm_max_body_bytes,
            args.signals_admission_headroom,
            metrics_url(args.exporter_url) if args.exporter_url else "",
        )
    )
    for report in reports:
        print("\n".join(render(report)))
    if not args.exporter_url:
        print("note: " + advice.details_unknown_sentence())
        print("note: " + advice.per_request_metrics_unknown_sentence())
    if any(report.paging for report in reports):
        return EXIT_PAGING
    return 1 if any(report.problems for report in reports) else 0


async def check_all(
    urls: list[str], timeout: float, max_bytes: int, headroom: int = 0, exporter_url: str = ""
) -> list[Report]:
    async with aiohttp.ClientSession() as session:
        view: ExporterView | None = None
        exporter_report: Report | None = None
        if exporter_url:
            exporter_report = Report(f"exporter {redact_url(exporter_url)}")
            try:
                body = await fetch_body(session, exporter_url, timeout, max_bytes=max_bytes)
                view = read_exporter(body.decode("utf-8"))
            except (FetchError, UnicodeDecodeError, ValueError) as err:
                exporter_report.problems.append(
                    f"cannot read the exporter's /metrics: {redact_text(str(err))}"
                )
            if view is not None:
                view.status = await read_status(
                    session, status_url(exporter_url), timeout, max_bytes, exporter_report
                )
        reports = list(
            await asyncio.gather(
                *(check_one(session, url, timeout, max_bytes, headroom, view) for url in urls)
            )
        )
    if exporter_report is not None:
        if view is not None:
            describe_exporter(view, exporter_report, headroom)
        reports.append(exporter_report)
    return reports


def status_url(exporter_metrics_url: str) -> str:
    """The exporter's status model, beside its /metrics."""
    parts = urlsplit(exporter_metrics_url)
    base = parts.path.removesuffix("/metrics").rstrip("/")
    return urlunsplit((parts.scheme, parts.netloc, base + STATUS_ROUTE, "", ""))


async def read_status(
    session: aiohttp.ClientSession, url: str, timeout: float, max_bytes: int, report: Report
) -> dict[str, Any] | None:
    """The exporter's status model, or None with a note (an exporter older than the route)."""
    try:
        body = await fetch_body(session, url, timeout, max_bytes=max_bytes)
        data = json.loads(body)
    except (FetchError, ValueError) as err:
        report.notes.append(
            f"cannot read the exporter's status ({STATUS_ROUTE}): {redact_text(str(err))}; "
            "the hit ratios over the alerts' windows and the collapse are not checked."
        )
        return None
    return data if isinstance(data, dict) else None


async def check_one(
    session: aiohttp.ClientSession,
    url: str,
    timeout: float,
    max_bytes: int,
    headroom: int = 0,
    view: ExporterView | None = None,
) -> Report:
    report = Report(redact_url(url))
    try:
        body = await fetch_body(session, url, timeout, max_bytes=max_bytes)
        snapshot = await decode_and_parse(body)
    except FetchError as err:
        message = redact_text(str(err))
        hint = advice.url_hint(redact_url(url), message)
        report.problems.append(
            f"cannot read vLLM's /metrics ({err.reason}): {message}" + (f". {hint}" if hint else "")
        )
        return report
    describe(snapshot, report, headroom, view)
    return report


def describe_exporter(view: ExporterView, report: Report, headroom: int) -> None:
    """Live fit, declared vs used completions, prompt order and what the usage reports,
    from a running exporter. Pure."""
    _describe_fit(view, report, headroom)
    _describe_completions(view, report)
    _describe_order(view, report)
    _describe_reporting(view, report)
    _describe_ttft(view, report)
    if view.status is not None:
        _describe_status(view.status, report)
    if not (view.demand or view.model_demand or view.used or view.reported or view.unreported):
        report.lines.append("no conversations seen yet (send usage to it first).")


def _describe_fit(view: ExporterView, report: Report, headroom: int) -> None:
    """Do the live conversations of each engine fit its pool (and of models no engine
    serves by that name, how much they need)."""
    for where in sorted(view.demand):
        pool = view.pools.get(where)
        target, model_name = where
        if not pool:
            continue
        fit = advice.Fit(
            int(view.active.get(where, 0)), int(view.demand[where]), int(pool), headroom
        )
        sentence = f"{target} ({model_name}): {advice.fit_sentence(fit, view.idle_seconds)}"
        (report.problems if fit.overflows else report.lines).append(sentence)
    for model in sorted(view.model_demand):
        if not any(model == name for _target, name in view.demand):
            report.lines.append(
                advice.unattributed_sentence(
                    model, view.model_active.get(model, 0), view.model_demand[model]
                )
            )


def _describe_completions(view: ExporterView, report: Report) -> None:
    """Declared vs used completion tokens, per caller and model, from exact sums and counts
    (/metrics has no largest value: the charge is bounded by the buckets alone)."""
    for pair in sorted(view.used):
        figures = advice.completions(
            pair[0],
            pair[1],
            view.used[pair],
            view.used_sum.get(pair, 0.0),
            view.declared.get(pair, 0.0),
        )
        if figures is None:
            continue
        sentence = advice.completion_sentence(figures)
        (
            report.notes
            if figures.overstatement >= advice.OVERSTATEMENT_WORTH_SAYING
            else report.lines
        ).append(sentence)


def _describe_order(view: ExporterView, report: Report) -> None:
    """Callers whose prompts share their text but not its beginning."""
    for pair, counts in sorted(view.order.items()):
        flagged = counts.get("variable_top", 0.0)
        if flagged <= 0:
            continue
        order = advice.PromptOrder(
            pair[0],
            pair[1],
            int(counts.get("compared", 0.0)),
            int(flagged),
            counts.get("shared_bytes", 0.0) / flagged,
            counts.get("first_difference_bytes", 0.0) / flagged,
        )
        if order.worth_saying:
            report.notes.append(advice.prompt_order_sentence(order))


def _describe_reporting(view: ExporterView, report: Report) -> None:
    """Whether the usage reports cached tokens, and who timed the turns."""
    unreported = sorted(caller for caller, tokens in view.unreported.items() if tokens > 0)
    if unreported:
        report.problems.append(advice.not_reported_sentence(unreported))
    elif any(tokens > 0 for tokens in view.reported.values()):
        report.lines.append(
            "every caller's usage reports cached_tokens (--enable-prompt-tokens-details is on)."
        )
    if view.timed_by.get("engine", 0) > 0:
        report.lines.append(
            "vLLM times the turns itself (--enable-per-request-metrics is on): "
            "TTFT and queue wait are the engine's own."
        )
    elif view.timed_by.get("proxy", 0) > 0:
        report.notes.append(advice.per_request_metrics_off_sentence())


def _describe_ttft(view: ExporterView, report: Report) -> None:
    """Each caller's median TTFT of warm and cold turns since the exporter started: vLLM's
    own where it timed any, else the proxy's, saying which (the status page's figures)."""
    for caller in sorted(view.ttft):
        found = timing.medians(
            {key: sorted(buckets.items()) for key, buckets in view.ttft[caller].items()}
        )
        if found.source is not None:
            report.lines.append(advice.ttft_sentence(caller, found.source, found.warm, found.cold))


def _describe_status(data: dict[str, Any], report: Report) -> None:
    """Each (caller, model) pair's hit ratio, baseline and warm share over the alerts'
    windows, and the conditions that page: the status page's figures, from its model."""
    short = advice.duration(float(data.get("window_seconds", 0)))
    long = advice.duration(float(data.get("long_seconds", 0)))
    baseline = advice.duration(float(data.get("baseline_seconds", 0)))
    for caller in data.get("callers", []):
        for pair in caller.get("pairs", []):
            report.lines.append(
                f"{caller.get('caller')} on {pair.get('model')}: hit ratio "
                f"{_percent(pair.get('ratio_window'))} over the last {short} "
                f"({_percent(pair.get('ratio_long'))} over the last {long}), baseline "
                f"{_percent(pair.get('baseline'))} (p90 of the {long} ratio over the last "
                f"{baseline}), warm share {_percent(pair.get('warm_share_window'))} over the "
                f"last {short}."
            )
    for caller in data.get("callers", []):
        pairs = caller.get("pairs", [])
        for pair in pairs:
            line = prefill_sentence(caller.get("caller"), pair, long, len(pairs) > 1)
            if line:
                report.lines.append(line)
    hidden = data.get("callers_not_shown") or 0
    if hidden:
        report.lines.append(
            f"{hidden} more callers are counted: their hit ratios are in Prometheus "
            "(caller_model:vllm_cache_hit_ratio:*), this exporter's history keeps the "
            "--callers.detailed and --callers.allow ones."
        )
    for item in data.get("problems", []):
        if item.get("pages"):
            report.paging.append(f"{item.get('alert')}: {item.get('sentence')}")


def prefill_sentence(caller: object, pair: dict[str, Any], long: str, name_model: bool) -> str:
    """What the cache saved a pair and evictions cost it over the long window, in its model's
    prefill time (signals/prefill.py; the page's figures); "" without a measured rate."""
    saved, lost = pair.get("prefill_seconds_saved"), pair.get("prefill_seconds_lost")
    if not isinstance(saved, int | float):
        return ""
    who = f"{caller} on {pair.get('model')}" if name_model else f"{caller}"
    line = f"{who}: over the last {long} the cache saved it {prefill.minutes(saved)} of prefill"
    if isinstance(lost, int | float):
        return f"{line}; evictions cost it {prefill.minutes(lost)}."
    return f"{line} (what evictions cost it is counted under __other__, not per caller)."


def _percent(value: object) -> str:
    return advice.percent(float(value)) if isinstance(value, int | float) else "-"


def describe(
    snapshot: EngineSnapshot, report: Report, headroom: int = 0, view: ExporterView | None = None
) -> None:
    """Fill ``report`` from one parsed scrape. Pure, so it is tested without a network."""
    engines = sorted(snapshot.engines.values(), key=lambda v: (v.model_name, v.engine))
    report.lines.append(f"read {snapshot.lines} samples, {len(engines)} engine(s)")
    for values in engines:
        config = snapshot.cache_config_for(values.engine)
        label = f"{values.model_name or '(no model_name)'} engine {values.engine or '-'}"
        if config is None:
            report.lines.append(f"{label}: no vllm:cache_config_info")
        else:
            caching = config.enable_prefix_caching
            pool = config.pool_tokens
            usage = values.values.get(names.KV_USAGE.name)
            in_use = f" ({usage:.1%} in use)" if usage is not None else ""
            report.lines.append(
                f"{label}: prefix caching {'on' if caching else 'OFF'}, block "
                f"{config.block_size or '?'} tokens, KV pool "
                f"{f'{pool:,}' if pool else '?'} tokens{in_use}"
            )
            if pool:
                report.lines.append(
                    "  " + _pool_sentence(pool, report.target, values.engine, headroom, view)
                )
            granule = kvpool.granule(config)
            if kvpool.is_hybrid(config) and granule:
                report.lines.append(
                    "  "
                    + advice.hybrid_granule_sentence(granule, config.fields.get("mamba_block_size"))
                )
                report.notes.append(advice.hybrid_cpu_batching_sentence(label, granule))
            if caching is False:
                report.problems.append(advice.prefix_caching_off_sentence(label))
        queries = values.values.get(names.PREFIX_CACHE_QUERIES.name)
        hits = values.values.get(names.PREFIX_CACHE_HITS.name)
        if queries:
            report.lines.append(
                f"  prefix cache since vLLM started: {hits or 0:,.0f} of {queries:,.0f} "
                f"looked-up tokens were hits ({(hits or 0) / queries:.1%})"
            )
        elif queries == 0:
            report.lines.append("  prefix cache since vLLM started: no prompts looked up yet")
        preemptions = values.values.get(names.PREEMPTIONS.name)
        if preemptions:
            report.notes.append(
                advice.preemptions_sentence(label, preemptions, "since vLLM started")
            )
        describe_residency(values, label, report)
    if not any(snapshot.present.get(signal.name) for signal in RESIDENCY):
        report.notes.append(RESIDENCY_OFF)
    for signal in names.SIGNALS:
        if snapshot.present.get(signal.name) or signal in RESIDENCY:
            continue
        known = ", ".join(signal.sample_names[:2])
        if signal in REQUIRED:
            report.problems.append(advice.absent_sentence("vLLM", signal.name, known))
        else:
            reason = WHY_ABSENT.get(signal.name, "not exposed by this vLLM version")
            report.notes.append(f"no {signal.name} metric ({known}): {reason}.")
    if snapshot.invalid_samples:
        report.problems.append(
            f"{snapshot.invalid_samples} sample(s) had impossible values "
            "(NaN, negative, usage above 1) and were ignored."
        )


def _pool_sentence(
    pool: int, target: str, engine: str, headroom: int, view: ExporterView | None
) -> str:
    """The pool, the smallest one known (the exporter's memory across boots, when it has
    read this vLLM), and the admission budget under it."""
    smallest, source = pool, "in this one read"
    known = view.smallest_pool(target, engine) if view is not None else None
    if known is not None:
        smallest, source = min(pool, int(known)), "by the exporter since it started"
    return advice.pool_sentence(
        pool, smallest, source, headroom, admission_budget(smallest, headroom)
    )


def describe_residency(values: EngineValues, label: str, report: Report) -> None:
    """What the sampled evictions since vLLM started say: medians, and whether blocks are
    evicted before their conversations come back."""
    idle = values.histograms.get(names.KV_BLOCK_IDLE_BEFORE_EVICT.name)
    if idle is None:
        return
    if idle.count == 0:
        report.lines.append("  KV residency: no sampled block evicted since vLLM started")
        return
    lifetime = values.histograms.get(names.KV_BLOCK_LIFETIME.name)
    gap = values.histograms.get(names.KV_BLOCK_REUSE_GAP.name)
    idle_median = median(idle)
    parts = [
        f"{idle.count:,.0f} sampled block(s) evicted since vLLM started, median idle "
        f"before eviction {seconds(idle_median)}"
    ]
    if lifetime is not None and lifetime.count:
        parts.append(f"median lifetime {seconds(median(lifetime))}")
    gap_median = median(gap) if gap is not None and gap.count else None
    if gap_median is not None:
        parts.append(f"median gap between reuses {seconds(gap_median)}")
    report.lines.append("  KV residency: " + ", ".join(parts))
    if gap_median is not None and idle_median < gap_median:
        report.notes.append(
            f"{label}: KV blocks are evicted after {seconds(idle_median)} idle (median), "
            f"sooner than blocks are reused ({seconds(gap_median)} apart): conversations "
            "come back to find their prefix gone. The KV pool is too small for this "
            "traffic's concurrency and think time."
        )


def median(histogram: HistogramValue) -> float:
    """The median as Prometheus' histogram_quantile estimates it."""
    return advice.histogram_quantile(
        0.5, list(zip(histogram.bounds, histogram.cumulative, strict=True))
    )


def seconds(value: float) -> str:
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min"


def render(report: Report) -> Iterator[str]:
    yield report.target
    for line in report.lines:
        yield f"  {line}"
    for note in report.notes:
        yield f"  note: {note}"
    for problem in report.problems:
        yield f"  PROBLEM: {problem}"
    for condition in report.paging:
        yield f"  PAGE: {condition}"
    if report.paging:
        yield "  paging: an alert of critical severity has its condition true now"
    else:
        yield "  " + ("problems found" if report.problems else "OK")
