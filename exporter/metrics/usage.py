"""Per-caller series: a public contract. Later work may add series here, never rename these.

Counters only: ratios (hit ratio, warm share) are PromQL over a window. Every (caller, model)
pair gets all ``state`` values of ``vllm_cache_requests_total`` from its first event on, so
``rate(...{state="cold"})`` reads 0 rather than "no data"; histograms exist per state only
once that state has a timed event, which keeps a 1,000-caller scrape small.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client.core import (
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from exporter import families
from exporter.metrics.exposition import (
    OPENMETRICS,
    TEXT,
    Format,
    encode_families,
    escape_label_value,
    format_value,
)
from exporter.signals.callers import OTHER
from exporter.signals.classify import CAUSES, STATES
from exporter.signals.usage import (
    ENGINE,
    PROXY,
    QUEUE_BUCKETS,
    TIMING_DROP_REASONS,
    TTFT_BUCKETS,
    Histogram,
    Series,
    TargetCounts,
    UsageState,
)

_TTFT_LE = [floatToGoString(b) for b in TTFT_BUCKETS] + ["+Inf"]
_QUEUE_LE = [floatToGoString(b) for b in QUEUE_BUCKETS] + ["+Inf"]

REQUESTS = families.REQUESTS
TTFT = families.TTFT_SECONDS
QUEUE = families.QUEUE_WAIT_SECONDS
# The per-caller families in exposition order: the requests by state, the counters read from
# one Series field each (families.PER_CALLER_COUNTERS), the two histograms.
PER_CALLER = (REQUESTS, *families.PER_CALLER_COUNTERS, TTFT, QUEUE)
# Blocks of a series' lines that hold its own strings (the histograms' are kept by them).
_COUNTER_BLOCKS = 1 + len(families.PER_CALLER_COUNTERS)
# A Series' values of those counters, in that order, in one call (attrgetter gives a tuple
# for two names or more; the table has three).
_COUNTER_FIELDS = [family.field for family in families.PER_CALLER_COUNTERS]
# Sample names, read once (a new series' label text is built from them).
_REQUESTS_TOTAL = REQUESTS.total
_COUNTER_TOTALS = [family.total for family in families.PER_CALLER_COUNTERS]
_TTFT_NAMES = (TTFT.bucket, TTFT.count, TTFT.sum)
_QUEUE_NAMES = (QUEUE.bucket, QUEUE.count, QUEUE.sum)
# The per-target counters of each pair (after the per-caller families): a pair's prompt and
# cached tokens on each vLLM target that served it.
TARGET_PROMPT = families.TARGET_PROMPT_TOKENS
TARGET_CACHED = families.TARGET_CACHED_TOKENS
PER_TARGET = (TARGET_PROMPT, TARGET_CACHED)
# The miss causes of each pair that has them (a detailed pair's, __other__'s), last: every
# cause a line, labels in name order (caller, cause, model).
MISSED_TOKENS = families.MISSED_PROMPT_TOKENS
MISSED_REQUESTS = families.MISSED_REQUESTS
PER_CAUSE = (MISSED_TOKENS, MISSED_REQUESTS)
_counter_values: Callable[[Series], tuple[int, ...]] = (
    operator.attrgetter(*_COUNTER_FIELDS)
    if len(_COUNTER_FIELDS) > 1
    else lambda series: (getattr(series, _COUNTER_FIELDS[0]),)
)


def _per_caller_families() -> list[Metric]:
    """The per-caller families, empty, in exposition order."""
    return [
        families.histogram(family)
        if family.type == families.HISTOGRAM
        else families.counter(family)
        for family in PER_CALLER
    ]


# HELP and TYPE lines of the per-caller and per-target families, in each format, built once.
_TEXT_HEADERS = tuple(
    TEXT.header(family.name, family.help, family.type)
    for family in (*PER_CALLER, *PER_TARGET, *PER_CAUSE)
)
_OPENMETRICS_HEADERS = tuple(
    OPENMETRICS.header(family.name, family.help, family.type, family.unit)
    for family in (*PER_CALLER, *PER_TARGET, *PER_CAUSE)
)

# Series rendered between two turns of the event loop (a series is up to SERIES_PER_PAIR
# samples: every state timed by both sources), so that no slice holds the loop for long.
SERIES_PER_SLICE = 32
# A series whose lines are reused (unchanged since the last render) costs about this much
# less than one rendered anew: so many of them make one slice's worth of work.
REUSED_PER_RENDERED = 64
# Series' (or histograms') lines of one family joined in one slice at the end (a few MB at
# most).
SERIES_PER_PIECE = 256
# A (caller, model, target) row rendered anew costs this many of the units a slice counts
# (REUSED_PER_RENDERED a series): about 1,024 of them make a slice.
WORK_PER_TARGET_ROW = 2
# A pair's miss causes rendered anew cost as many of those units (14 lines, 7 target rows').
WORK_PER_CAUSES = 14


def _histogram(
    samples: list[Sample],
    family: families.Family,
    labels: dict[str, str],
    hist: Histogram,
    les: list[str],
) -> None:
    """Append one histogram's _bucket, _count and _sum samples (cumulative buckets)."""
    bucket = family.bucket
    running = 0
    for le, count in zip(les, hist.counts, strict=True):
        running += count
        samples.append(Sample(bucket, {**labels, "le": le}, running))
    samples.append(Sample(family.count, labels, running))
    samples.append(Sample(family.sum, labels, hist.total))


class _HistogramText:
    """One histogram series' line prefixes (``{head}{le}{tail}`` is a bucket's), and its
    lines as last rendered with the histogram, count and sum they were rendered from."""

    __slots__ = ("head", "tail", "count", "sum", "hist", "observed", "total", "lines")

    def __init__(self, names: tuple[str, str, str], caller: str, rest: str) -> None:
        # Labels print sorted by name: caller, le, model, source, state.
        bucket, count, total = names
        self.head = f'{bucket}{{{caller},le="'
        self.tail = f'",{rest}}} '
        self.count = f"{count}{{{caller},{rest}}} "
        self.sum = f"{total}{{{caller},{rest}}} "
        self.hist: Histogram | None = None
        self.observed = -1
        self.total = 0.0
        self.lines = ""


class SeriesLines(NamedTuple):
    """One series' lines in each per-caller family: the requests' (one string), each
    per-caller counter's (a string each, in families.PER_CALLER_COUNTERS' order), the
    TTFT and queue-wait histograms' (a string per histogram, the one its _HistogramText
    keeps), the per-target prompt and cached tokens' (one string each, every target of
    the pair), and the missed tokens' and requests' by cause (one string each, empty for a
    pair without them)."""

    requests: str
    counters: tuple[str, ...]
    ttft: list[str]
    queue: list[str]
    target_prompt: str
    target_cached: str
    missed_tokens: str
    missed_requests: str


class _SeriesText:
    """A (caller, model) series' escaped label text, built once (label values never change),
    and its sample lines as last rendered, reused while the series has not changed.

    A series changes only when an event is counted into it, and every such event adds one to
    exactly one of its ``requests`` counts (``UsageState.record_events``): their sum is the
    series' version (not __other__'s: see ``render_slices``). Lines are reused only once the
    series and every histogram in it are shown (past the new-series hold), since a held one
    renders zeros whatever its version.
    """

    __slots__ = (
        "requests",
        "counters",
        "ttft",
        "queue",
        "targets",
        "causes",
        "_caller",
        "_model",
        "series",
        "version",
        "lines",
    )

    def __init__(self, caller: str, model: str) -> None:
        self._caller = f'caller="{escape_label_value(caller)}"'
        self._model = f'model="{escape_label_value(model)}"'
        pair = f"{self._caller},{self._model}"
        self.requests = [f'{_REQUESTS_TOTAL}{{{pair},state="{state}"}} ' for state in STATES]
        self.counters = [f"{total}{{{pair}}} " for total in _COUNTER_TOTALS]
        self.ttft: dict[tuple[str, str], _HistogramText] = {}  # by (state, source)
        self.queue: dict[str, _HistogramText] = {}  # by source
        # by target label: the prompt and cached counters' line prefixes
        self.targets: dict[str, tuple[str, str]] = {}
        # the missed tokens' and requests' line prefixes, a cause each (built when needed)
        self.causes: tuple[list[str], list[str]] | None = None
        # The lines of each per-caller family (the histograms' empty when the series has
        # none), the series object and the version they were rendered from; None until
        # reusable.
        self.series: Series | None = None
        self.version = -1
        self.lines = SeriesLines("", (), [], [], "", "", "", "")

    def ttft_text(self, state: str, source: str) -> _HistogramText:
        text = self.ttft.get((state, source))
        if text is None:
            text = self.ttft[(state, source)] = _HistogramText(
                _TTFT_NAMES, self._caller, f'{self._model},source="{source}",state="{state}"'
            )
        return text

    def target_text(self, target: str) -> tuple[str, str]:
        text = self.targets.get(target)
        if text is None:
            labels = f'{self._caller},{self._model},target="{escape_label_value(target)}"'
            text = self.targets[target] = (
                f"{TARGET_PROMPT.total}{{{labels}}} ",
                f"{TARGET_CACHED.total}{{{labels}}} ",
            )
        return text

    def cause_text(self) -> tuple[list[str], list[str]]:
        if self.causes is None:
            tokens, requests = (
                [
                    f'{family.total}{{{self._caller},cause="{cause}",{self._model}}} '
                    for cause in CAUSES
                ]
                for family in PER_CAUSE
            )
            self.causes = (tokens, requests)
        return self.causes

    def queue_text(self, source: str) -> _HistogramText:
        text = self.queue.get(source)
        if text is None:
            text = self.queue[source] = _HistogramText(
                _QUEUE_NAMES, self._caller, f'{self._model},source="{source}"'
            )
        return text


def _histogram_lines(out: list[str], text: _HistogramText, hist: Histogram, les: list[str]) -> None:
    """Append one histogram's lines; reused while its observations and sum are unchanged
    (every observation adds one to a bucket; a held histogram is a different object)."""
    counts = hist.counts
    observed = sum(counts)
    if text.hist is hist and text.observed == observed and text.total == hist.total:
        out.append(text.lines)
        return
    head, tail = text.head, text.tail
    lines: list[str] = []
    running = 0
    for le, count in zip(les, counts, strict=True):
        running += count
        if running < 1_000_000:  # format_value's int fast path (counts are ints), inlined
            lines.append(f"{head}{le}{tail}{running}.0\n")
        else:
            lines.append(f"{head}{le}{tail}{format_value(running)}\n")
    lines.append(f"{text.count}{format_value(running)}\n")
    lines.append(f"{text.sum}{format_value(hist.total)}\n")
    text.lines = "".join(lines)
    text.hist, text.observed, text.total = hist, observed, hist.total
    out.append(text.lines)


# What a series still held at zero shows (see UsageSettings.new_series_hold).
_ZERO_COUNTS = dict.fromkeys(STATES, 0)
_ZERO_CAUSES = dict.fromkeys(CAUSES, 0)
_ZERO_TTFT = Histogram(TTFT_BUCKETS)
_ZERO_QUEUE = Histogram(QUEUE_BUCKETS)
_HELD = Series()


def _shown(series: Series, now: float) -> Series:
    """The series, or all zeros while it is still held (its histograms are decided alone)."""
    return _HELD if series.shown_from > now else series


def _shown_histogram(hist: Histogram, zero: Histogram, now: float) -> Histogram:
    return zero if hist.shown_from > now else hist


def _ttft_histograms(series: Series, state: str) -> Iterator[tuple[str, Histogram]]:
    """(source, histogram) of one state, in exposition order (engine before proxy)."""
    hist = series.engine_ttft.get(state)
    if hist is not None:
        yield ENGINE, hist
    hist = series.ttft.get(state)
    if hist is not None:
        yield PROXY, hist


def _queue_histograms(series: Series) -> Iterator[tuple[str, Histogram]]:
    if series.engine_queue is not None:
        yield ENGINE, series.engine_queue
    if series.queue is not None:
        yield PROXY, series.queue


def _target_counts(counts: TargetCounts, now: float) -> tuple[int, int]:
    """A target entry's (prompt, cached) tokens as shown: zeros while it is held."""
    if counts.shown_from > now:
        return 0, 0
    return counts.prompt_tokens, counts.cached_tokens


def _fully_shown(series: Series, now: float) -> bool:
    """Whether the series and every histogram and target entry in it are past the
    new-series hold."""
    if series.shown_from > now:
        return False
    if series.miss is not None and series.miss.shown_from > now:
        return False
    for counts in series.targets.values():
        if counts.shown_from > now:
            return False
    for hists in (
        series.ttft.values(),
        series.engine_ttft.values(),
        (series.queue, series.engine_queue),
    ):
        for hist in hists:
            if hist is not None and hist.shown_from > now:
                return False
    return True


# SeriesLines without the Python-level __new__ a NamedTuple call runs (once per series).
_lines = tuple.__new__


def _series_lines(text: _SeriesText, real: Series, now: float) -> SeriesLines:
    """One series' lines in each per-caller family, as shown at ``now``."""
    fmt_value = format_value
    series = _shown(real, now)
    counts = series.requests
    requests = "".join(
        [
            f"{prefix}{fmt_value(counts[state])}\n"
            for prefix, state in zip(text.requests, STATES, strict=True)
        ]
    )
    ttft: list[str] = []
    queue: list[str] = []
    engine_ttft, proxy_ttft = real.engine_ttft, real.ttft
    if proxy_ttft or engine_ttft:
        for state in STATES:  # as _ttft_histograms, inlined: once per series
            hist = engine_ttft.get(state)
            if hist is not None:
                _histogram_lines(
                    ttft,
                    text.ttft_text(state, ENGINE),
                    _shown_histogram(hist, _ZERO_TTFT, now),
                    _TTFT_LE,
                )
            hist = proxy_ttft.get(state)
            if hist is not None:
                _histogram_lines(
                    ttft,
                    text.ttft_text(state, PROXY),
                    _shown_histogram(hist, _ZERO_TTFT, now),
                    _TTFT_LE,
                )
    if real.queue is not None or real.engine_queue is not None:
        for source, hist in _queue_histograms(real):
            _histogram_lines(
                queue, text.queue_text(source), _shown_histogram(hist, _ZERO_QUEUE, now), _QUEUE_LE
            )
    # A tuple of strings, which the garbage collector stops tracking (a list it would walk at
    # every collection: one more per series, thousands per render).
    counters = tuple(
        [
            f"{prefix}{fmt_value(counted)}\n"  # as many prefixes as values
            for prefix, counted in zip(text.counters, _counter_values(series))  # noqa: B905
        ]
    )
    target_prompt = target_cached = ""
    targets = real.targets
    if targets:
        prompt_lines: list[str] = []
        cached_lines: list[str] = []
        for target in sorted(targets):
            prompt_prefix, cached_prefix = text.target_text(target)
            prompt_tokens, cached_tokens = _target_counts(targets[target], now)
            prompt_lines.append(f"{prompt_prefix}{fmt_value(prompt_tokens)}\n")
            cached_lines.append(f"{cached_prefix}{fmt_value(cached_tokens)}\n")
        target_prompt, target_cached = "".join(prompt_lines), "".join(cached_lines)
    missed_tokens = missed_requests = ""
    miss = real.miss
    if miss is not None:
        tokens_text, requests_text = text.cause_text()
        held = miss.shown_from > now or real.shown_from > now
        tokens, requests_by_cause = (
            (_ZERO_CAUSES, _ZERO_CAUSES) if held else (miss.tokens, miss.requests)
        )
        missed_tokens = "".join(
            [
                f"{prefix}{fmt_value(tokens[cause])}\n"
                for prefix, cause in zip(tokens_text, CAUSES, strict=True)
            ]
        )
        missed_requests = "".join(
            [
                f"{prefix}{fmt_value(requests_by_cause[cause])}\n"
                for prefix, cause in zip(requests_text, CAUSES, strict=True)
            ]
        )
    return _lines(
        SeriesLines,
        (
            requests,
            counters,
            ttft,
            queue,
            target_prompt,
            target_cached,
            missed_tokens,
            missed_requests,
        ),
    )


class UsageCollector:
    def __init__(self, usage: UsageState) -> None:
        self.usage = usage
        # Label text per (caller, model) series; bounded like the series (never removed).
        self._text: dict[tuple[str, str], _SeriesText] = {}
        self._retired = usage.retired

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def kept_characters(self) -> int:
        """Characters of the lines kept for reuse: at most the per-caller part of one body
        (each kept string is a series' or a histogram's lines as last rendered)."""
        kept = 0
        for text in self._text.values():
            kept += len(text.lines.requests) + sum(len(line) for line in text.lines.counters)
            kept += len(text.lines.target_prompt) + len(text.lines.target_cached)
            kept += len(text.lines.missed_tokens) + len(text.lines.missed_requests)
            for hists in (text.ttft.values(), text.queue.values()):
                kept += sum(len(hist.lines) for hist in hists)
        return kept

    def collect(self) -> Iterator[Metric]:
        """The reference rendering (registry.get_sample_value, client_python's encoders, tests)."""
        usage = self.usage
        metrics = _per_caller_families()
        requests, counters = metrics[0], metrics[1:_COUNTER_BLOCKS]
        ttft, queue = metrics[_COUNTER_BLOCKS:]
        counted = list(zip(counters, families.PER_CALLER_COUNTERS, strict=True))
        target_prompt, target_cached = (families.counter(family) for family in PER_TARGET)
        missed_tokens, missed_requests = (families.counter(family) for family in PER_CAUSE)

        # Samples are appended directly rather than through add_metric(): at 1,000 callers
        # that is ~80,000 samples per scrape, and add_metric's per-call copies were a quarter
        # of the render time (bench/bench_render.py).
        now = usage.now()
        for (caller, model), real in sorted(usage.series.items()):
            pair = {"caller": caller, "model": model}
            series = _shown(real, now)
            counts = series.requests
            for state in STATES:
                requests.samples.append(
                    Sample(
                        REQUESTS.total,
                        {"caller": caller, "model": model, "state": state},
                        counts[state],
                    )
                )
            for metric, family in counted:
                metric.samples.append(Sample(family.total, pair, getattr(series, family.field)))
            for state in STATES:
                for source, hist in _ttft_histograms(real, state):
                    _histogram(
                        ttft.samples,
                        TTFT,
                        {"caller": caller, "model": model, "state": state, "source": source},
                        _shown_histogram(hist, _ZERO_TTFT, now),
                        _TTFT_LE,
                    )
            for source, hist in _queue_histograms(real):
                _histogram(
                    queue.samples,
                    QUEUE,
                    {"caller": caller, "model": model, "source": source},
                    _shown_histogram(hist, _ZERO_QUEUE, now),
                    _QUEUE_LE,
                )
            for target, entry in sorted(real.targets.items()):
                labels = {"caller": caller, "model": model, "target": target}
                prompt_tokens, cached_tokens = _target_counts(entry, now)
                target_prompt.samples.append(Sample(TARGET_PROMPT.total, labels, prompt_tokens))
                target_cached.samples.append(Sample(TARGET_CACHED.total, labels, cached_tokens))
            miss = real.miss
            if miss is not None:
                held = miss.shown_from > now or real.shown_from > now
                for cause in CAUSES:
                    labels = {"caller": caller, "model": model, "cause": cause}
                    missed_tokens.samples.append(
                        Sample(MISSED_TOKENS.total, labels, 0 if held else miss.tokens[cause])
                    )
                    missed_requests.samples.append(
                        Sample(MISSED_REQUESTS.total, labels, 0 if held else miss.requests[cause])
                    )
        yield from metrics
        yield target_prompt
        yield target_cached
        yield missed_tokens
        yield missed_requests
        yield from self._other_families()

    def render_text(self, out: list[str]) -> None:
        """Append exactly what ``encode_families(self.collect(), out)`` would, faster."""
        for _ in self.render_slices(out, TEXT):
            pass

    def render_openmetrics(self, out: list[str]) -> None:
        """Append exactly what ``encode_families(self.collect(), out, OPENMETRICS)`` would."""
        for _ in self.render_slices(out, OPENMETRICS):
            pass

    def render_slices(
        self, out: list[str], fmt: Format, series_per_slice: int | None = None
    ) -> Iterator[None]:
        """Append what ``encode_families(self.collect(), out, fmt)`` would, in slices.

        The per-caller families are written from cached label text (one f-string per
        sample; their sample lines are the same in both formats, only the HELP and TYPE
        lines differ); the small families go through the general encoder. A series that has
        not changed since the last render reuses its lines (see ``_SeriesText``), so a scrape
        costs in proportion to the series that changed, plus joining. Yields after every
        ``series_per_slice`` (default ``SERIES_PER_SLICE``) series rendered anew
        (``REUSED_PER_RENDERED`` reused ones count as one): the caller may let other tasks
        change the state meanwhile. The series rendered are those that existed when it
        began (a snapshot of the keys, sorted); each one's samples are read together, within
        one slice; the small families are read at the end.
        """
        usage = self.usage
        cache = self._text
        if len(cache) > len(usage.series) or self._retired != usage.retired:
            cache.clear()  # series gone, or a series' histograms (signals/usage.py _retire)
            self._retired = usage.retired
        # One string per series and family (a histogram's lines joined): few objects to hand
        # over and free at the end, where one per line would cost tens of milliseconds at
        # thousands of series; kept strings are shared, never copied, between renders.
        requests: list[str] = []
        counters: list[tuple[str, ...]] = []  # per series, transposed at the end
        ttft: list[str] = []
        queue: list[str] = []
        target_prompt: list[str] = []
        target_cached: list[str] = []
        missed_tokens: list[str] = []
        missed_requests: list[str] = []
        per_slice = series_per_slice or SERIES_PER_SLICE
        keys = sorted(usage.series)
        now = usage.now()
        work = 0  # series rendered anew count 1, reused ones 1/REUSED_PER_RENDERED
        for key in keys:
            real = usage.series.get(key)
            if real is None:  # series are never removed today; a removed one is skipped
                continue
            text = cache.get(key)
            if text is None:
                text = cache[key] = _SeriesText(*key)
            counts = real.requests
            version = sum(counts.values())
            if text.version == version and text.series is real:
                lines = text.lines
                work += 1
            else:
                lines = _series_lines(text, real, now)
                # __other__'s histograms also count the observations of callers outside the
                # detailed set, which change none of its requests: never reused whole (each
                # histogram's lines still are, while unchanged).
                if _fully_shown(real, now) and key[0] != OTHER:
                    text.series, text.version, text.lines = real, version, lines
                work += REUSED_PER_RENDERED + WORK_PER_TARGET_ROW * len(real.targets)
                if real.miss is not None:
                    work += WORK_PER_CAUSES
            (
                series_requests,
                series_counters,
                series_ttft,
                series_queue,
                prompts,
                cached,
                tokens_by_cause,
                requests_by_cause,
            ) = lines
            requests.append(series_requests)
            counters.append(series_counters)
            ttft.extend(series_ttft)
            queue.extend(series_queue)
            if prompts:
                target_prompt.append(prompts)
                target_cached.append(cached)
            if tokens_by_cause:
                missed_tokens.append(tokens_by_cause)
                missed_requests.append(requests_by_cause)
            if work >= per_slice * REUSED_PER_RENDERED:
                work = 0
                yield
        yield
        headers = _OPENMETRICS_HEADERS if fmt.openmetrics else _TEXT_HEADERS
        piece = SERIES_PER_PIECE
        # Per family: a series' counter lines are read from the tuples by one C-level zip.
        by_family = list(zip(*counters, strict=True)) or [() for _ in families.PER_CALLER_COUNTERS]
        blocks = (
            requests,
            *by_family,
            ttft,
            queue,
            target_prompt,
            target_cached,
            missed_tokens,
            missed_requests,
        )
        for head, family_blocks in zip(headers, blocks, strict=True):
            out.append(head)
            for start in range(0, len(family_blocks), piece):
                out.append("".join(family_blocks[start : start + piece]))
                yield
        encode_families(self._other_families(), out, fmt)

    def _other_families(self) -> Iterator[Metric]:
        usage = self.usage
        granularity = families.gauge(families.GRANULARITY_TOKENS)
        for model, value, source in usage.granularities():
            granularity.add_metric([model, source], float(value))

        events = families.counter(families.USAGE_EVENTS)
        for reader, count in sorted(usage.events.items()):
            events.add_metric([reader], count)
        rejected = families.counter(families.USAGE_EVENTS_REJECTED)
        now = usage.now()
        shown_from = usage.rejected_shown_from
        for (reader, reason), count in sorted(usage.rejected.items()):
            held = shown_from.get((reader, reason), 0.0) > now
            rejected.add_metric([reader, reason], 0 if held else count)
        last = families.gauge(families.USAGE_LAST_EVENT_TIMESTAMP_SECONDS)
        for reader, when in sorted(usage.last_event_time.items()):
            last.add_metric([reader], when)
        refused = families.counter(families.USAGE_INGEST_REQUESTS_REJECTED)
        for reason, count in sorted(usage.ingest_requests_rejected.items()):
            refused.add_metric([reason], count)
        overflowed = families.counter(families.CALLERS_OVERFLOWED)
        overflowed.add_metric([], usage.callers_overflowed)
        folded = families.counter(families.CALLERS_FOLDED)
        folded.add_metric([], usage.series_folded)
        targets_overflowed = families.counter(families.TARGETS_OVERFLOWED)
        targets_overflowed.add_metric([], usage.targets_overflowed)

        yield granularity
        yield events
        yield rejected
        yield last
        yield refused
        yield overflowed
        yield folded
        yield targets_overflowed
        yield from self._retry_families()

    def _retry_families(self) -> Iterator[Metric]:
        """Timings left out of counted events, and the memory of ids for retried copies."""
        usage = self.usage
        dropped = families.counter(families.USAGE_TIMINGS_DROPPED)
        for reader in sorted(usage.events):
            for reason in TIMING_DROP_REASONS:
                dropped.add_metric([reader, reason], usage.timings_dropped.get((reader, reason), 0))
        remembered = families.gauge(families.USAGE_IDS_REMEMBERED)
        forgotten = families.counter(families.USAGE_IDS_FORGOTTEN_EARLY)
        for kind, keys in (("event_id", usage.event_ids), ("idempotency_key", usage.batch_keys)):
            remembered.add_metric([kind], len(keys))
            forgotten.add_metric([kind], keys.forgotten_early)
        yield dropped
        yield remembered
        yield forgotten
