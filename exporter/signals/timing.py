"""Whose time to first token a person is shown: vLLM's own where it timed the turns, else the
proxy's, and which one it is.

vLLM times a request itself when it runs with ``--enable-per-request-metrics`` (the
``source="engine"`` series: from scheduling to the first token). Without it the only TTFT is
the proxy's (``source="proxy"``: the proxy's clock less its own admission wait), which still
holds the time the request waited in vLLM's scheduler queue. The two are never added up
(signals/usage.py keeps them apart; so do the recording rules), and the same choice is made
wherever TTFT is shown: the status page, ``check --exporter.url``, and the
VllmCacheWarmTTFTCollapse alert (``source="engine" or ignoring (source) source!="engine"``,
exporter/monitoring/alerts.py).

Pure: buckets in, figures out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exporter.signals.advice import histogram_quantile
from exporter.signals.classify import COLD, WARM
from exporter.signals.usage import ENGINE, PROXY

# cumulative (upper bound, count) buckets, the last +Inf
Buckets = Sequence[tuple[float, float]]


def pick(counts: Mapping[str, float]) -> str | None:
    """The source to show from the turns each one timed: vLLM's own if it timed any, else
    the proxy's if it did, else None (nothing timed)."""
    if counts.get(ENGINE, 0.0) > 0:
        return ENGINE
    if counts.get(PROXY, 0.0) > 0:
        return PROXY
    return None


@dataclass(frozen=True)
class Medians:
    """One caller's median TTFT of its warm and of its cold turns, from one source."""

    source: str | None
    warm: float | None
    cold: float | None


def medians(buckets: Mapping[tuple[str, str], Buckets]) -> Medians:
    """From (state, source) -> cumulative buckets (one caller's, over its models): the
    medians as ``histogram_quantile`` reads them, both from the source ``pick`` chooses over
    the warm and cold turns."""
    counts: dict[str, float] = {}
    for (state, measured_by), timed in buckets.items():
        if state in (WARM, COLD) and timed:
            counts[measured_by] = counts.get(measured_by, 0.0) + max(count for _le, count in timed)
    source = pick(counts)
    if source is None:
        return Medians(None, None, None)
    return Medians(
        source, _median(buckets.get((WARM, source))), _median(buckets.get((COLD, source)))
    )


def _median(cumulative: Buckets | None) -> float | None:
    if not cumulative:
        return None
    value = histogram_quantile(0.5, cumulative)
    return None if math.isnan(value) else value


def cumulative(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[float, float]]:
    """Per-bucket counts (the last one above the largest bound) as cumulative buckets."""
    out, running = [], 0
    for bound, count in zip((*bounds, math.inf), counts, strict=True):
        running += count
        out.append((bound, float(running)))
    return out


def add(
    into: dict[tuple[str, str], list[tuple[float, float]]], key: tuple[str, str], buckets: Buckets
) -> None:
    """Sum ``buckets`` into ``into[key]`` bucket by bucket (the same bounds: one caller's
    models, whose histograms share them)."""
    known = into.get(key)
    if known is None:
        into[key] = sorted(buckets)
        return
    by_bound = dict(known)
    for bound, count in buckets:
        by_bound[bound] = by_bound.get(bound, 0.0) + count
    into[key] = sorted(by_bound.items())
