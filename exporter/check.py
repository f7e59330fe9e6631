"""``vllm-cache-exporter check``: one look at a vLLM's /metrics, in plain words.

The field reports' worst hours went to things one read of /metrics shows: prefix caching
silently off (the hybrid default in older vLLM), a renamed counter that a dashboard read as a
reassuring 0, a KV pool too small for the conversations it has to hold. This command reads
each vLLM once through the exporter's own engine reader and says what it finds, before any
Prometheus or Grafana is set up. Exit status: 0 nothing wrong, 1 a problem found, 2 bad flags.

It also says how many tokens of conversation fit: the pool, the smallest pool it can know of,
the admission budget under it; and, given ``--exporter.url`` (a running exporter, which has
seen the usage and every vLLM boot since it started), whether the live conversations fit and
what each caller declares against what it uses. The sentences come from
``exporter.signals.advice``, shared with the other surfaces that say the same.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from exporter.config import metrics_url
from exporter.engine import names
from exporter.engine.fetch import FetchError, decode_and_parse, fetch_body
from exporter.redaction import redact_text, redact_url
from exporter.signals import advice
from exporter.signals.foresight import admission_budget
from exporter.values import EngineSnapshot

# Signals whose absence breaks the cache signals (a problem), and those that only exist in
# newer vLLM releases (a note).
REQUIRED = (names.PREFIX_CACHE_QUERIES, names.PREFIX_CACHE_HITS, names.PREEMPTIONS,
            names.KV_USAGE, names.CACHE_CONFIG)
WHY_ABSENT = {
    names.PROMPT_TOKENS_CACHED.name: "vLLM before 0.16 has no vllm:prompt_tokens_cached_total",
}


@dataclass
class Report:
    target: str
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


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
    # (caller, model) -> cumulative (le, count) buckets, and declared tokens
    used: dict[tuple[str, str], list[tuple[float, float]]] = field(default_factory=dict)
    declared: dict[tuple[str, str], float] = field(default_factory=dict)

    def smallest_pool(self, target: str, engine: str) -> float | None:
        found = [pool for (where, _model, rank), pool in self.smallest_pools.items()
                 if where == target and rank == engine]
        return min(found) if found else None


def read_exporter(text: str) -> ExporterView:
    """The foresight series of an exporter's exposition. Pure."""
    view = ExporterView()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            where = (labels.get("target", ""), labels.get("model_name", ""))
            pair = (labels.get("caller", ""), labels.get("model", ""))
            name = sample.name
            if name == "vllm_cache_engine_kv_pool_min_tokens":
                view.smallest_pools[(where[0], where[1], labels.get("engine", ""))] = \
                    sample.value
            elif name == "vllm_cache_engine_kv_pool_tokens":
                view.pools[where] = view.pools.get(where, 0.0) + sample.value
            elif name == "vllm_cache_engine_conversations_active":
                view.active[where] = sample.value
            elif name == "vllm_cache_engine_conversations_demand_tokens":
                view.demand[where] = sample.value
            elif name == "vllm_cache_conversations_active":
                view.model_active[labels.get("model", "")] = sample.value
            elif name == "vllm_cache_conversations_demand_tokens":
                view.model_demand[labels.get("model", "")] = sample.value
            elif name == "vllm_cache_conversation_idle_window_seconds":
                view.idle_seconds = sample.value
            elif name == "vllm_cache_completion_used_tokens_bucket":
                view.used.setdefault(pair, []).append((float(labels["le"]), sample.value))
            elif name == "vllm_cache_completion_declared_tokens_total":
                view.declared[pair] = sample.value
    return view


def main(args: argparse.Namespace) -> int:
    if not args.vllm_url:
        print("vllm-cache-exporter check: --vllm.url is required (the vLLM server to read, "
              "e.g. --vllm.url http://127.0.0.1:8000)", file=sys.stderr)
        return 2
    reports = asyncio.run(check_all([metrics_url(url) for url in args.vllm_url],
                                    args.vllm_timeout, args.vllm_max_body_bytes,
                                    args.signals_admission_headroom,
                                    metrics_url(args.exporter_url) if args.exporter_url
                                    else ""))
    for report in reports:
        print("\n".join(render(report)))
    return 1 if any(report.problems for report in reports) else 0


async def check_all(urls: list[str], timeout: float, max_bytes: int,
                    headroom: int = 0, exporter_url: str = "") -> list[Report]:
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
                    f"cannot read the exporter's /metrics: {redact_text(str(err))}")
        reports = list(await asyncio.gather(*(
            check_one(session, url, timeout, max_bytes, headroom, view) for url in urls)))
    if exporter_report is not None:
        if view is not None:
            describe_exporter(view, exporter_report, headroom)
        reports.append(exporter_report)
    return reports


async def check_one(session: aiohttp.ClientSession, url: str, timeout: float,
                    max_bytes: int, headroom: int = 0,
                    view: ExporterView | None = None) -> Report:
    report = Report(redact_url(url))
    try:
        body = await fetch_body(session, url, timeout, max_bytes=max_bytes)
        snapshot = await decode_and_parse(body)
    except FetchError as err:
        report.problems.append(f"cannot read vLLM's /metrics ({err.reason}): "
                               f"{redact_text(str(err))}")
        return report
    describe(snapshot, report, headroom, view)
    return report


def describe_exporter(view: ExporterView, report: Report, headroom: int) -> None:
    """Live fit and declared vs used completions, from a running exporter. Pure."""
    for where in sorted(view.demand):
        pool = view.pools.get(where)
        target, model_name = where
        if not pool:
            continue
        fit = advice.Fit(int(view.active.get(where, 0)), int(view.demand[where]), int(pool),
                         headroom)
        sentence = f"{target} ({model_name}): {advice.fit_sentence(fit, view.idle_seconds)}"
        (report.problems if fit.overflows else report.lines).append(sentence)
    for model in sorted(view.model_demand):
        if not any(model == name for _target, name in view.demand):
            report.lines.append(
                f"{model}: {view.model_active.get(model, 0):,.0f} conversation(s) active need "
                f"{view.model_demand[model]:,.0f} tokens of KV cache (not attributed to one "
                "vLLM: compare with the pools of the vLLMs serving it).")
    for pair in sorted(view.used):
        buckets = view.used[pair]
        requests = max(count for _le, count in buckets)
        if requests <= 0:
            continue
        figures = advice.Completions(
            pair[0], pair[1], int(requests), view.declared.get(pair, 0.0) / requests,
            advice.histogram_quantile(0.5, buckets), advice.histogram_quantile(0.99, buckets))
        sentence = advice.completion_sentence(figures)
        (report.notes if figures.overstatement >= advice.OVERSTATEMENT_WORTH_SAYING
         else report.lines).append(sentence)
    if not (view.demand or view.model_demand or view.used):
        report.lines.append("no conversations seen yet (send usage to it first).")


def describe(snapshot: EngineSnapshot, report: Report, headroom: int = 0,
             view: ExporterView | None = None) -> None:
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
                f"{f'{pool:,}' if pool else '?'} tokens{in_use}")
            if pool:
                report.lines.append("  " + _pool_sentence(pool, report.target, values.engine,
                                                          headroom, view))
            if caching is False:
                report.problems.append(
                    f"{label}: prefix caching is off, so every turn re-reads its whole prompt. "
                    "Start vLLM with --enable-prefix-caching (hybrid models default to off "
                    "in older vLLM).")
        queries = values.values.get(names.PREFIX_CACHE_QUERIES.name)
        hits = values.values.get(names.PREFIX_CACHE_HITS.name)
        if queries:
            report.lines.append(
                f"  prefix cache since vLLM started: {hits or 0:,.0f} of {queries:,.0f} "
                f"looked-up tokens were hits ({(hits or 0) / queries:.1%})")
        elif queries == 0:
            report.lines.append("  prefix cache since vLLM started: no prompts looked up yet")
        preemptions = values.values.get(names.PREEMPTIONS.name)
        if preemptions:
            report.notes.append(
                f"{label}: {preemptions:,.0f} preemption(s) since vLLM started: at times more "
                "concurrent context than the KV pool holds, and preempted requests are "
                "recomputed.")
    for signal in names.SIGNALS:
        if snapshot.present.get(signal.name):
            continue
        known = ", ".join(signal.sample_names[:2])
        if signal in REQUIRED:
            report.problems.append(
                f"vLLM exposes no {signal.name} metric under any known name ({known}): the "
                "exporter will show it as absent, and a dashboard querying it reads nothing "
                "(or a misleading 0). Is this vLLM, with stats logging on (no "
                "--disable-log-stats)?")
        else:
            reason = WHY_ABSENT.get(signal.name, "not exposed by this vLLM version")
            report.notes.append(f"no {signal.name} metric ({known}): {reason}.")
    if snapshot.invalid_samples:
        report.problems.append(f"{snapshot.invalid_samples} sample(s) had impossible values "
                               "(NaN, negative, usage above 1) and were ignored.")


def _pool_sentence(pool: int, target: str, engine: str, headroom: int,
                   view: ExporterView | None) -> str:
    """The pool, the smallest one known (the exporter's memory across boots, when it has
    read this vLLM), and the admission budget under it."""
    smallest, source = pool, "in this one read"
    known = view.smallest_pool(target, engine) if view is not None else None
    if known is not None:
        smallest, source = min(pool, int(known)), "by the exporter since it started"
    return advice.pool_sentence(pool, smallest, source, headroom,
                                admission_budget(smallest, headroom))


def render(report: Report) -> Iterator[str]:
    yield report.target
    for line in report.lines:
        yield f"  {line}"
    for note in report.notes:
        yield f"  note: {note}"
    for problem in report.problems:
        yield f"  PROBLEM: {problem}"
    yield ("  hint: per-request cached tokens cannot be seen from /metrics: start vLLM with "
           "--enable-prompt-tokens-details so your proxy sees them.")
    yield "  " + ("problems found" if report.problems else "OK")
