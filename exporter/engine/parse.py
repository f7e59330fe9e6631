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
from dataclasses import dataclass, field
from itertools import pairwise

from exporter.engine import names
from exporter.values import (
    ABOVE_ONE,
    BAD_HISTOGRAM,
    CACHE_CONFIG_KEYS,
    ENGINE_CAP,
    MAX_SAMPLE_VALUE,
    MODEL_NAME_CAP,
    NEGATIVE,
    NOT_FINITE,
    OTHER_LABEL_VALUE,
    ROW_CAP,
    SPLITS,
    TOO_LARGE,
    TOO_LONG,
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
# The largest sample value believed (MAX_SAMPLE_VALUE), why a sample is dropped
# (PARSE_INVALID_REASONS) and why one is folded (FOLD_REASONS): exporter/values.py, which the
# carrier (exporter/signals/engine.py) reads too.

# Caps on the label values a vLLM sends that become label values of ours, per target (what
# the first reads admit stays admitted while the exporter runs). vLLM labels each series
# with its one served model name and one engine per data-parallel rank; a value past a cap
# is folded into OVERFLOW_VALUE, its samples summed there and counted in
# vllm_cache_engine_samples_folded_total by ``reason``:
OVERFLOW_VALUE = "__other__"  # as the usage side folds callers (exporter/signals/callers.py)
MAX_LABEL_VALUE_CHARS = 128  # a longer model_name, engine or cache_config_info value: too_long
MAX_MODEL_NAMES = 4  # distinct model_name values: model_name_cap
MAX_ENGINES = 32  # distinct engine values (each a row of cache_config_info too): engine_cap
# Distinct (model_name, engine) rows, OVERFLOW_VALUE's own aside: row_cap, the row then
# (OVERFLOW_VALUE, OVERFLOW_VALUE). 33 rows x (17 counter and 7 histogram tracks) stay
# inside the carrier's track bounds (exporter/signals/engine.py), so no track is forgotten.
MAX_ROWS = 32
# Labels of one cache_config_info row kept (vLLM 0.32 has 37): the allow-listed ones
# (values.CACHE_CONFIG_KEYS) first, then the others in the order sent.
MAX_CONFIG_LABELS = 64

Found = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value)
RowKey = tuple[str, str]  # (model_name, engine)


class ParseError(ValueError):
    def __init__(self, line_number: int, reason: str) -> None:
        super().__init__(f"line {line_number}: {reason}")
        self.line_number = line_number
        self.reason = reason


class LabelCaps:
    """The model_name and engine values, and the rows, one target's reads may show: the
    first ones seen, up to the caps above. One per target, kept across its reads (so a row
    keeps its label values from scrape to scrape); a fresh one bounds a single read."""

    def __init__(
        self,
        max_model_names: int = MAX_MODEL_NAMES,
        max_engines: int = MAX_ENGINES,
        max_rows: int = MAX_ROWS,
        max_chars: int = MAX_LABEL_VALUE_CHARS,
    ) -> None:
        self.max_model_names = max_model_names
        self.max_engines = max_engines
        self.max_rows = max_rows
        self.max_chars = max_chars
        self.model_names: set[str] = set()
        self.engines: set[str] = set()
        self.rows: set[RowKey] = set()

    def value(
        self, raw: str, admitted: set[str], cap: int, cap_reason: str
    ) -> tuple[str, str | None]:
        """The label value shown for ``raw``, and the fold reason when it is not ``raw``."""
        if raw in admitted:
            return raw, None
        if len(raw) > self.max_chars:
            return OVERFLOW_VALUE, TOO_LONG
        if raw == OVERFLOW_VALUE:
            return raw, None
        if len(admitted) >= cap:
            return OVERFLOW_VALUE, cap_reason
        admitted.add(raw)
        return raw, None

    def engine(self, raw: str) -> tuple[str, str | None]:
        return self.value(raw, self.engines, self.max_engines, ENGINE_CAP)

    def config_value(self, raw: str) -> tuple[str, str | None]:
        return (OVERFLOW_VALUE, TOO_LONG) if len(raw) > self.max_chars else (raw, None)

    def row(self, labels: dict[str, str]) -> tuple[RowKey, str | None]:
        """The row a sample's labels are counted in, and why it is not their own, if not."""
        model, model_reason = self.value(
            labels.get("model_name", ""), self.model_names, self.max_model_names, MODEL_NAME_CAP
        )
        engine, engine_reason = self.engine(labels.get("engine", ""))
        key = (model, engine)
        reason = model_reason or engine_reason
        if key in self.rows or key == (OVERFLOW_VALUE, OVERFLOW_VALUE):
            return key, reason
        if len(self.rows) >= self.max_rows:
            return (OVERFLOW_VALUE, OVERFLOW_VALUE), reason or ROW_CAP
        self.rows.add(key)
        return key, reason


@dataclass
class EngineRead:
    """One parsed read: the snapshot, and what of it was dropped or folded, by reason."""

    snapshot: EngineSnapshot
    invalid: dict[str, int] = field(default_factory=dict)  # reason -> samples dropped
    folded: dict[str, int] = field(default_factory=dict)  # reason -> samples folded


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
    inner = text[start + 1 : close]
    if "\\" in inner:
        return None
    labels: dict[str, str] = {}
    for pair in inner.split('",'):
        key, sep, value = pair.partition('="')
        if (
            not sep
            or '"' in value
            or not key
            or not (key[0].isalpha() or key[0] == "_")
            or not key.replace("_", "a").isalnum()
        ):
            return None
        labels[key] = value
    return labels, close + 2


def _parse_labels_escaped(text: str, start: int, line_number: int) -> tuple[dict[str, str], int]:
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
        self.line_number = 0  # of the sample last yielded

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
            self.line_number = line_number
            yield name, labels, _parse_value(rest[0], line_number)
        self.lines = line_count
        if line_count == 0:
            raise ParseError(0, "no samples in body")


def parse(text: str) -> EngineSnapshot:
    """Parse a vLLM exposition body. Raises ParseError on any malformed sample line."""
    return read(text).snapshot


def read(text: str, caps: LabelCaps | None = None) -> EngineRead:
    """Parse a vLLM exposition body, its label values held to ``caps`` (a fresh LabelCaps:
    this read's alone). Raises ParseError on any malformed sample line, and, as Prometheus
    does, on a sample the exporter reads that comes twice with the same labels: summed, the
    copies would show hits above queries, and the next honest read a false restart."""
    found: Found = defaultdict(list)
    scan = Samples(text, _WANTED)
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    canonical: dict[int, frozenset[tuple[str, str]]] = {}  # label sets are shared: id -> set
    for name, labels, value in scan:
        label_set = canonical.get(id(labels))
        if label_set is None:
            label_set = canonical[id(labels)] = frozenset(labels.items())
        if (name, label_set) in seen:
            shown = ",".join(f'{key}="{val[:40]}"' for key, val in sorted(labels.items()))
            raise ParseError(
                scan.line_number, f"duplicate sample for timestamp: {name}{{{shown[:200]}}}"
            )
        seen.add((name, label_set))
        found[name].append((labels, value))
    return _resolve(found, scan.lines, caps or LabelCaps())


def _labels_once(
    line: str, start: int, line_number: int, labels_seen: dict[str, dict[str, str]]
) -> tuple[dict[str, str], int]:
    """The label set at ``line[start]``, parsed only the first time this body has it."""
    close = line.find('"}', start) + 2
    seen = labels_seen.get(line[start:close]) if close > 1 else None
    if seen is not None:
        return seen, close
    labels, rest_at = _parse_labels(line, start, line_number)
    if rest_at == close:
        labels_seen[line[start:close]] = labels
    return labels, rest_at


class _Resolver:
    """Turns the samples found into per-(model_name, engine) values, dropping (and counting)
    impossible ones, and folding (and counting) label values past the caps."""

    def __init__(self, found: Found, caps: LabelCaps) -> None:
        self.found = found
        self.caps = caps
        self.engines: dict[RowKey, EngineValues] = {}
        self.present: dict[str, bool] = {}
        self.invalid: dict[str, int] = {}
        self.folded: dict[str, int] = {}
        self._rows: dict[int, tuple[RowKey, str | None]] = {}  # id(labels) -> row, reason

    def key(self, labels: dict[str, str], count: bool = True) -> RowKey:
        """The row of a sample (its label sets are shared, so each is looked up once); a
        folded sample is counted when ``count``."""
        known = self._rows.get(id(labels))
        if known is None:
            known = self._rows[id(labels)] = self.caps.row(labels)
        if count and known[1] is not None:
            self.fold(known[1])
        return known[0]

    def fold(self, reason: str, samples: int = 1) -> None:
        self.folded[reason] = self.folded.get(reason, 0) + samples

    def drop(self, reason: str, samples: int = 1) -> None:
        self.invalid[reason] = self.invalid.get(reason, 0) + samples

    def slot(self, labels: dict[str, str], count: bool = True) -> EngineValues:
        return self.slot_at(self.key(labels, count))

    def slot_at(self, key: RowKey) -> EngineValues:
        values = self.engines.get(key)
        if values is None:
            values = self.engines[key] = EngineValues(model_name=key[0], engine=key[1])
        return values

    def first_found(self, candidates: tuple[str, ...]) -> str | None:
        return next((name for name in candidates if name in self.found), None)

    def valid(self, signal: names.Signal, value: float) -> bool:
        """Whether a value is possible; an impossible one is counted."""
        reason = _impossible(signal, value)
        if reason is None:
            return True
        self.drop(reason)
        return False

    def created(self, sample_name: str) -> list[tuple[dict[str, str], float]]:
        created = names.created_name(sample_name)
        if created is None:
            return []
        return [
            (labels, value) for labels, value in self.found.get(created, []) if math.isfinite(value)
        ]

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
            created = self.slot(labels, count=False).created
            # Several rows folded into one: the newest creation marks a restart.
            created[signal.name] = max(value, created.get(signal.name, value))

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
            # An impossible value is counted once, by the split's own reading; so is a fold.
            if labels.get("source") in names.CACHED_SOURCES and _impossible(signal, value) is None:
                values = self.slot(labels, count=False).values
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
            created = self.slot(labels, count=False).split_created.setdefault(signal.name, {})
            # Several values folded into "other": the newest creation marks a restart.
            created[shown] = max(value, created.get(shown, value))

    # ---- histograms ----------------------------------------------------------------------

    def histogram(self, signal: names.Signal) -> None:
        family = next(
            (
                name
                for name in signal.sample_names
                if name + "_bucket" in self.found or name + "_count" in self.found
            ),
            None,
        )
        if family is None:
            return
        self.present[signal.name] = True
        rows: dict[RowKey, _HistogramSamples] = {}
        for suffix in ("_bucket", "_sum", "_count"):
            for labels, value in self.found.get(family + suffix, []):
                row = rows.setdefault(self.key(labels), _HistogramSamples())
                row.add(suffix, labels.get("le"), value)
        for key, row in rows.items():
            histogram = row.resolve()
            if histogram is None:
                self.drop(row.reason or BAD_HISTOGRAM, row.lines)
                continue
            self.slot_at(key).histograms[signal.name] = histogram
        for labels, value in self.found.get(family + "_created", []):
            values = self.engines.get(self.key(labels, count=False))
            if values is not None and signal.name in values.histograms and math.isfinite(value):
                values.created[signal.name] = max(value, values.created.get(signal.name, value))

    # ---- cache configuration -------------------------------------------------------------

    def cache_configs(self) -> dict[str, CacheConfig]:
        """One configuration per engine, at most MAX_CONFIG_LABELS of its labels, each value
        at most MAX_LABEL_VALUE_CHARS; an engine folded into OVERFLOW_VALUE has none (several
        engines' pools do not add up to one)."""
        configs: dict[str, CacheConfig] = {}
        for labels, _value in self.found.get(names.CACHE_CONFIG.sample_names[0], []):
            self.present[names.CACHE_CONFIG.name] = True
            engine, reason = self.caps.engine(labels.get("engine", ""))
            if reason is not None:
                self.fold(reason)
                continue
            fields = {}
            # The allow-listed keys, then others as they come (exporter/signals/kvpool.py
            # reads a few more), MAX_CONFIG_LABELS in all.
            keys = [key for key in CACHE_CONFIG_KEYS if key in labels]
            keys += [key for key in labels if key not in CACHE_CONFIG_KEYS][
                : max(MAX_CONFIG_LABELS - len(keys), 0)
            ]
            for key in keys:
                fields[key], reason = self.caps.config_value(labels[key])
                if reason is not None:
                    self.fold(reason)
            configs[engine] = CacheConfig(engine=engine, fields=fields)
        return configs


def _impossible(signal: names.Signal, value: float) -> str | None:
    """Why a value cannot be one of this signal, or None when it can."""
    if not math.isfinite(value):
        return NOT_FINITE
    if value < 0:
        return NEGATIVE
    if value > MAX_SAMPLE_VALUE:
        return TOO_LARGE
    if signal is names.KV_USAGE and value > 1.0:
        return ABOVE_ONE
    return None


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
        self.reason: str | None = None  # why it is broken, when a sample says

    def add(self, suffix: str, le: str | None, value: float) -> None:
        self.lines += 1
        if not math.isfinite(value) or value < 0 or value > MAX_SAMPLE_VALUE:
            self.broken = True
            self.reason = self.reason or (
                TOO_LARGE if value > MAX_SAMPLE_VALUE else NEGATIVE if value < 0 else NOT_FINITE
            )
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


def _resolve(found: Found, lines: int, caps: LabelCaps) -> EngineRead:
    resolver = _Resolver(found, caps)
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
    snapshot = EngineSnapshot(
        engines=resolver.engines,
        cache_configs=cache_configs,
        present=present,
        invalid_samples=sum(resolver.invalid.values()),
        lines=lines,
    )
    return EngineRead(snapshot, resolver.invalid, resolver.folded)
