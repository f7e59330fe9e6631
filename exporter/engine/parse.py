"""Parse a vLLM /metrics body (Prometheus text 0.0.4) into an EngineSnapshot.

A purpose-built scanner rather than prometheus_client's parser: it looks at the handful of
sample names the exporter reads and only checks the shape of every other line, which makes a
1,000-sample scrape several times cheaper (bench/bench_parse.py). Like Prometheus, it rejects
the whole body on a malformed line: half a scrape is worse than none.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Container, Iterator
from itertools import pairwise

from exporter.engine import names
from exporter.values import (
    OTHER_LABEL_VALUE,
    SPLITS,
    CacheConfig,
    EngineSnapshot,
    EngineValues,
    HistogramValue,
    Split,
)

_WANTED = names.wanted_sample_names()
# Buckets one histogram may have. vLLM's largest default family has 22 bounds plus +Inf
# (and --custom-histogram-buckets lists are typed by hand); a histogram past this is dropped
# and its samples counted as invalid, so one target cannot make the exporter serve
# thousands of series per engine.
MAX_HISTOGRAM_BUCKETS = 64

Found = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value)
RowKey = tuple[str, str]  # (model_name, engine)


class ParseError(ValueError):
    def __init__(self, line_number: int, reason: str) -> None:
        super().__init__(f"line {line_number}: {reason}")
        self.line_number = line_number
        self.reason = reason


def _parse_labels(text: str, start: int, line_number: int) -> tuple[dict[str, str], int]:
    """Parse ``{a="b",...}`` starting at ``text[start] == '{'``; return labels and end index."""
    simple = _simple_labels(text, start)
    if simple is not None:
        return simple
    return _parse_labels_escaped(text, start, line_number)


def _simple_labels(text: str, start: int) -> tuple[dict[str, str], int] | None:
    """The label set as prometheus_client writes it (``{a="b",c="d"}``, no escapes, no
    spaces), or None for the general parser. Without a backslash every ``"`` delimits a value,
    so the first ``"}`` closes the set and ``",`` ends each value but the last."""
    close = text.find('"}', start)
    if close < 0:
        return None
    inner = text[start + 1:close]
    if "\\" in inner:
        return None
    labels: dict[str, str] = {}
    for pair in inner.split('",'):
        key, sep, value = pair.partition('="')
        if not sep or '"' in value or not key or not (key[0].isalpha() or key[0] == "_") \
                or not key.replace("_", "a").isalnum():
            return None
        labels[key] = value
    return labels, close + 2


def _parse_labels_escaped(text: str, start: int,
                          line_number: int) -> tuple[dict[str, str], int]:
    labels: dict[str, str] = {}
    i = start + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t":
            i += 1
        if i < n and text[i] == "}":
            return labels, i + 1
        eq = text.find("=", i)
        if eq < 0:
            raise ParseError(line_number, "unterminated label set")
        key = text[i:eq].strip()
        if not key or not (key[0].isalpha() or key[0] == "_"):
            raise ParseError(line_number, f"bad label name {key!r}")
        i = eq + 1
        if i >= n or text[i] != '"':
            raise ParseError(line_number, f"label {key} value is not quoted")
        i += 1
        chars: list[str] = []
        while True:
            j = text.find('"', i)
            k = text.find("\\", i)
            if j < 0:
                raise ParseError(line_number, "unterminated label value")
            if 0 <= k < j:
                chars.append(text[i:k])
                if k + 1 >= n:
                    raise ParseError(line_number, "unterminated escape")
                escaped = text[k + 1]
                chars.append({"n": "\n", "\\": "\\", '"': '"'}.get(escaped, "\\" + escaped))
                i = k + 2
                continue
            chars.append(text[i:j])
            i = j + 1
            break
        labels[key] = "".join(chars)
        while i < n and text[i] in " \t":
            i += 1
        if i < n and text[i] == ",":
            i += 1
            continue
        if i < n and text[i] == "}":
            return labels, i + 1
        raise ParseError(line_number, "expected ',' or '}' in label set")


def _parse_value(raw: str, line_number: int) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ParseError(line_number, f"bad sample value {raw[:40]!r}") from None


def _name_end(line: str) -> int:
    brace = line.find("{")
    space = line.find(" ")
    if brace < 0:
        return space
    if space < 0:
        return brace
    return min(brace, space)


class Samples:
    """Every sample of a text exposition (0.0.4, or OpenMetrics without exemplars) as
    (name, labels, value), in order, when iterated; with ``wanted``, only the samples of
    those names, every other line checked for shape only. Iterating raises ParseError on any
    malformed sample line, and on a body without samples; then ``lines`` is the number of
    sample lines. The label dicts of equal label sets are shared: read-only."""

    def __init__(self, text: str, wanted: Container[str] | None = None) -> None:
        self.text = text
        self.wanted = wanted
        self.lines = 0

    def __iter__(self) -> Iterator[tuple[str, dict[str, str], float]]:
        wanted = self.wanted
        # Label sets repeat within a body (every family of an engine, every histogram with
        # the same buckets): each distinct one is parsed once.
        labels_seen: dict[str, dict[str, str]] = {}
        line_count = 0
        for line_number, line in enumerate(self.text.split("\n"), start=1):
            if not line or line[0] == "#":
                continue
            line = line.strip()
            if not line or line[0] == "#":
                continue
            line_count += 1
            end = _name_end(line)
            if end <= 0:
                raise ParseError(line_number, "not a sample line")
            name = line[:end]
            if wanted is not None and name not in wanted:
                # Shape check only: the last field must be a number (value or timestamp).
                first = name[0]
                if not (first.isalpha() or first in "_:"):
                    raise ParseError(line_number, f"bad metric name {name[:40]!r}")
                _parse_value(line.rsplit(None, 1)[-1], line_number)
                continue
            if line[end] == "{":
                labels, rest_at = _labels_once(line, end, line_number, labels_seen)
            else:
                labels, rest_at = {}, end
            rest = line[rest_at:].split()
            if not rest or len(rest) > 2:
                raise ParseError(line_number, "expected a value after the labels")
            yield name, labels, _parse_value(rest[0], line_number)
        self.lines = line_count
        if line_count == 0:
            raise ParseError(0, "no samples in body")


def parse(text: str) -> EngineSnapshot:
    """Parse a vLLM exposition body. Raises ParseError on any malformed sample line."""
    found: Found = defaultdict(list)
    scan = Samples(text, _WANTED)
    for name, labels, value in scan:
        found[name].append((labels, value))
    return _resolve(found, scan.lines)


def _labels_once(line: str, start: int, line_number: int,
                 labels_seen: dict[str, dict[str, str]]) -> tuple[dict[str, str], int]:
    """The label set at ``line[start]``, parsed only the first time this body has it."""
    close = line.find('"}', start) + 2
    seen = labels_seen.get(line[start:close]) if close > 1 else None
    if seen is not None:
        return seen, close
    labels, rest_at = _parse_labels(line, start, line_number)
    if rest_at == close:
        labels_seen[line[start:close]] = labels
    return labels, rest_at


def _row_key(labels: dict[str, str]) -> RowKey:
    return labels.get("model_name", ""), labels.get("engine", "")


class _Resolver:
    """Turns the samples found into per-(model_name, engine) values, dropping (and counting)
    impossible ones."""

    def __init__(self, found: Found) -> None:
        self.found = found
        self.engines: dict[RowKey, EngineValues] = {}
        self.present: dict[str, bool] = {}
        self.invalid = 0

    def slot(self, labels: dict[str, str]) -> EngineValues:
        key = _row_key(labels)
        values = self.engines.get(key)
        if values is None:
            values = self.engines[key] = EngineValues(model_name=key[0], engine=key[1])
        return values

    def first_found(self, candidates: tuple[str, ...]) -> str | None:
        return next((name for name in candidates if name in self.found), None)

    def valid(self, signal: names.Signal, value: float) -> bool:
        """Whether a value is possible; an impossible one is counted."""
        if _possible(signal, value):
            return True
        self.invalid += 1
        return False

    def created(self, sample_name: str) -> list[tuple[dict[str, str], float]]:
        created = names.created_name(sample_name)
        if created is None:
            return []
        return [(labels, value) for labels, value in self.found.get(created, [])
                if math.isfinite(value)]

    # ---- plain values (one number per engine) ------------------------------------------

    def plain(self, signal: names.Signal) -> None:
        sample_name = self.first_found(signal.sample_names)
        if sample_name is None:
            return
        self.present[signal.name] = True
        for labels, value in self.found[sample_name]:
            if self.valid(signal, value):
                values = self.slot(labels).values
                values[signal.name] = values.get(signal.name, 0.0) + value
        for labels, value in self.created(sample_name):
            self.slot(labels).created[signal.name] = value

    def cached_from_sources(self) -> None:
        """vllm:prompt_tokens_cached where only its by-source split exists."""
        signal = names.PROMPT_TOKENS_CACHED
        if self.present.get(signal.name):
            return
        by_source = self.first_found(names.PROMPT_TOKENS_BY_SOURCE.sample_names)
        if by_source is None:
            return
        self.present[signal.name] = True
        for labels, value in self.found[by_source]:
            # An impossible value is counted once, by the split's own reading.
            if labels.get("source") in names.CACHED_SOURCES and _possible(signal, value):
                values = self.slot(labels).values
                values[signal.name] = values.get(signal.name, 0.0) + value

    # ---- splits (one number per engine and label value) ----------------------------------

    def split(self, signal: names.Signal) -> None:
        sample_name = self.first_found(signal.sample_names)
        if sample_name is None:
            return
        self.present[signal.name] = True
        split = SPLITS[signal.name]
        for labels, value in self.found[sample_name]:
            if self.valid(signal, value):
                by_value = self.slot(labels).splits.setdefault(signal.name, {})
                shown = _shown_label_value(split, labels.get(split.label, ""))
                by_value[shown] = by_value.get(shown, 0.0) + value
        for labels, value in self.created(sample_name):
            shown = _shown_label_value(split, labels.get(split.label, ""))
            created = self.slot(labels).split_created.setdefault(signal.name, {})
            # Several values folded into "other": the newest creation marks a restart.
            created[shown] = max(value, created.get(shown, value))

    # ---- histograms ----------------------------------------------------------------------

    def histogram(self, signal: names.Signal) -> None:
        family = next((name for name in signal.sample_names
                       if name + "_bucket" in self.found or name + "_count" in self.found), None)
        if family is None:
            return
        self.present[signal.name] = True
        rows: dict[RowKey, _HistogramSamples] = {}
        for suffix in ("_bucket", "_sum", "_count"):
            for labels, value in self.found.get(family + suffix, []):
                row = rows.setdefault(_row_key(labels), _HistogramSamples())
                row.add(suffix, labels.get("le"), value)
        for key, row in rows.items():
            histogram = row.resolve()
            if histogram is None:
                self.invalid += row.lines
                continue
            self.slot({"model_name": key[0], "engine": key[1]}).histograms[signal.name] = \
                histogram
        for labels, value in self.found.get(family + "_created", []):
            values = self.engines.get(_row_key(labels))
            if values is not None and signal.name in values.histograms and math.isfinite(value):
                values.created[signal.name] = value

    # ---- cache configuration -------------------------------------------------------------

    def cache_configs(self) -> dict[str, CacheConfig]:
        configs: dict[str, CacheConfig] = {}
        for labels, _value in self.found.get(names.CACHE_CONFIG.sample_names[0], []):
            self.present[names.CACHE_CONFIG.name] = True
            engine = labels.get("engine", "")
            configs[engine] = CacheConfig(engine=engine, fields=dict(labels))
        return configs


def _possible(signal: names.Signal, value: float) -> bool:
    if not math.isfinite(value) or value < 0:
        return False
    return not (signal is names.KV_USAGE and value > 1.0)


def _shown_label_value(split: Split, raw: str) -> str:
    return raw if raw in split.known else OTHER_LABEL_VALUE


class _HistogramSamples:
    """The _bucket, _sum and _count samples of one engine's histogram, summed over any labels
    other than model_name, engine and le (several API-server processes, say)."""

    def __init__(self) -> None:
        self.buckets: dict[float, float] = {}
        self.sum = 0.0
        self.count: float | None = None
        self.lines = 0
        self.broken = False

    def add(self, suffix: str, le: str | None, value: float) -> None:
        self.lines += 1
        if not math.isfinite(value) or value < 0:
            self.broken = True
            return
        if suffix == "_sum":
            self.sum += value
        elif suffix == "_count":
            self.count = (self.count or 0.0) + value
        else:
            bound = _bound(le)
            if bound is None:
                self.broken = True
                return
            self.buckets[bound] = self.buckets.get(bound, 0.0) + value

    def resolve(self) -> HistogramValue | None:
        """The histogram, or None when it cannot be one: a bad bound or value, no +Inf
        bucket, more than MAX_HISTOGRAM_BUCKETS buckets, counts that fall as the bound
        grows, or a count other than the +Inf bucket's."""
        if self.broken or self.count is None or not self.buckets:
            return None
        bounds = tuple(sorted(self.buckets))
        if bounds[-1] != math.inf or len(bounds) > MAX_HISTOGRAM_BUCKETS:
            return None
        cumulative = tuple(self.buckets[bound] for bound in bounds)
        if any(later < earlier for earlier, later in pairwise(cumulative)):
            return None
        if not math.isclose(self.count, cumulative[-1], rel_tol=1e-9, abs_tol=1e-9):
            return None
        return HistogramValue(bounds, cumulative, self.sum)


def _bound(le: str | None) -> float | None:
    if le is None:
        return None
    try:
        bound = float(le)
    except ValueError:
        return None
    return bound if bound == math.inf or math.isfinite(bound) else None


def _resolve(found: Found, lines: int) -> EngineSnapshot:
    resolver = _Resolver(found)
    for signal in names.SAMPLE_VALUE_SIGNALS:
        resolver.plain(signal)
    resolver.cached_from_sources()
    for signal in names.SPLIT_SIGNALS:
        resolver.split(signal)
    for signal in names.HISTOGRAM_SIGNALS:
        resolver.histogram(signal)
    cache_configs = resolver.cache_configs()
    present = resolver.present
    for signal in names.SIGNALS:
        present.setdefault(signal.name, False)
    return EngineSnapshot(engines=resolver.engines, cache_configs=cache_configs, present=present,
                          invalid_samples=resolver.invalid, lines=lines)
