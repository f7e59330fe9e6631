"""``vllm-cache-exporter check``: one look at a vLLM's /metrics, in plain words.

The field reports' worst hours went to things one read of /metrics shows: prefix caching
silently off (the hybrid default in older vLLM), a renamed counter that a dashboard read as a
reassuring 0, a KV pool too small for the conversations it has to hold. This command reads
each vLLM once through the exporter's own engine reader and says what it finds, before any
Prometheus or Grafana is set up. Exit status: 0 nothing wrong, 1 a problem found, 2 bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp

from exporter.config import metrics_url
from exporter.engine import names
from exporter.engine.fetch import FetchError, decode_and_parse, fetch_body
from exporter.redaction import redact_text, redact_url
from exporter.values import EngineSnapshot, EngineValues, HistogramValue

# Signals whose absence breaks the cache signals (a problem), and those that only exist in
# newer vLLM releases or with a flag (a note).
REQUIRED = (names.PREFIX_CACHE_QUERIES, names.PREFIX_CACHE_HITS, names.PREEMPTIONS,
            names.KV_USAGE, names.CACHE_CONFIG)
WHY_ABSENT = {
    names.PROMPT_TOKENS_CACHED.name: "vLLM before 0.16 has no vllm:prompt_tokens_cached_total",
    names.PROMPT_TOKENS_BY_SOURCE.name: "vLLM before 0.16 does not split prompt tokens by "
                                        "source",
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
    "from inside.")


@dataclass
class Report:
    target: str
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def main(args: argparse.Namespace) -> int:
    if not args.vllm_url:
        print("vllm-cache-exporter check: --vllm.url is required (the vLLM server to read, "
              "e.g. --vllm.url http://127.0.0.1:8000)", file=sys.stderr)
        return 2
    reports = asyncio.run(check_all([metrics_url(url) for url in args.vllm_url],
                                    args.vllm_timeout, args.vllm_max_body_bytes))
    for report in reports:
        print("\n".join(render(report)))
    return 1 if any(report.problems for report in reports) else 0


async def check_all(urls: list[str], timeout: float, max_bytes: int) -> list[Report]:
    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(check_one(session, url, timeout, max_bytes)
                                           for url in urls)))


async def check_one(session: aiohttp.ClientSession, url: str, timeout: float,
                    max_bytes: int) -> Report:
    report = Report(redact_url(url))
    try:
        body = await fetch_body(session, url, timeout, max_bytes=max_bytes)
        snapshot = await decode_and_parse(body)
    except FetchError as err:
        report.problems.append(f"cannot read vLLM's /metrics ({err.reason}): "
                               f"{redact_text(str(err))}")
        return report
    describe(snapshot, report)
    return report


def describe(snapshot: EngineSnapshot, report: Report) -> None:
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
        describe_residency(values, label, report)
    if not any(snapshot.present.get(signal.name) for signal in RESIDENCY):
        report.notes.append(RESIDENCY_OFF)
    for signal in names.SIGNALS:
        if snapshot.present.get(signal.name) or signal in RESIDENCY:
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
    parts = [f"{idle.count:,.0f} sampled block(s) evicted since vLLM started, median idle "
             f"before eviction {seconds(idle_median)}"]
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
            "traffic's concurrency and think time.")


def median(histogram: HistogramValue) -> float:
    """The median as Prometheus' histogram_quantile estimates it: linear within the bucket
    (the highest finite bound when it falls in the +Inf bucket)."""
    rank = histogram.count / 2
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(histogram.bounds, histogram.cumulative, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


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
    yield ("  hint: per-request cached tokens cannot be seen from /metrics: start vLLM with "
           "--enable-prompt-tokens-details so your proxy sees them.")
    yield "  " + ("problems found" if report.problems else "OK")
