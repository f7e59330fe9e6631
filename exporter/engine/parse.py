"""Parse a vLLM /metrics body (Prometheus text 0.0.4) into an EngineSnapshot.

A purpose-built scanner rather than prometheus_client's parser: it looks at the handful of
sample names the exporter reads and only checks the shape of every other line, which makes a
1,000-sample scrape several times cheaper (bench/bench_parse.py). Like Prometheus, it rejects
the whole body on a malformed line: half a scrape is worse than none.
"""

from __future__ import annotations

import math
from collections import defaultdict

from exporter.engine import names
from exporter.values import CacheConfig, EngineSnapshot, EngineValues

_WANTED = names.wanted_sample_names()


class ParseError(ValueError):
    def __init__(self, line_number: int, reason: str) -> None:
        super().__init__(f"line {line_number}: {reason}")
        self.line_number = line_number
        self.reason = reason


def _parse_labels(text: str, start: int, line_number: int) -> tuple[dict[str, str], int]:
    """Parse ``{a="b",...}`` starting at ``text[start] == '{'``; return labels and end index."""
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


def parse(text: str) -> EngineSnapshot:
    """Parse an exposition body. Raises ParseError on any malformed sample line."""
    found: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    line_count = 0
    for line_number, line in enumerate(text.split("\n"), start=1):
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
        if name not in _WANTED:
            # Shape check only: the last field must be a number (value or timestamp).
            first = name[0]
            if not (first.isalpha() or first in "_:"):
                raise ParseError(line_number, f"bad metric name {name[:40]!r}")
            _parse_value(line.rsplit(None, 1)[-1], line_number)
            continue
        if line[end] == "{":
            labels, rest_at = _parse_labels(line, end, line_number)
        else:
            labels, rest_at = {}, end
        rest = line[rest_at:].split()
        if not rest or len(rest) > 2:
            raise ParseError(line_number, "expected a value after the labels")
        found[name].append((labels, _parse_value(rest[0], line_number)))
    if line_count == 0:
        raise ParseError(0, "no samples in body")
    return _resolve(found, line_count)


def _resolve(found: dict[str, list[tuple[dict[str, str], float]]], lines: int) -> EngineSnapshot:
    engines: dict[tuple[str, str], EngineValues] = {}
    present: dict[str, bool] = {}
    invalid = 0

    def slot(labels: dict[str, str]) -> EngineValues:
        key = (labels.get("model_name", ""), labels.get("engine", ""))
        values = engines.get(key)
        if values is None:
            values = engines[key] = EngineValues(model_name=key[0], engine=key[1])
        return values

    def valid(signal: names.Signal, value: float) -> bool:
        if not math.isfinite(value) or value < 0:
            return False
        if signal is names.KV_USAGE and value > 1.0:
            return False
        return True

    for signal in names.SAMPLE_VALUE_SIGNALS:
        sample_name = next((n for n in signal.sample_names if n in found), None)
        if sample_name is None:
            continue
        present[signal.name] = True
        for labels, value in found[sample_name]:
            if not valid(signal, value):
                invalid += 1
                continue
            values = slot(labels).values
            values[signal.name] = values.get(signal.name, 0.0) + value
        created = names.created_name(sample_name)
        for labels, value in found.get(created, []) if created else []:
            if math.isfinite(value):
                slot(labels).created[signal.name] = value

    if not present.get(names.PROMPT_TOKENS_CACHED.name):
        by_source = next((n for n in names.PROMPT_TOKENS_BY_SOURCE if n in found), None)
        if by_source is not None:
            present[names.PROMPT_TOKENS_CACHED.name] = True
            for labels, value in found[by_source]:
                if labels.get("source") not in names.CACHED_SOURCES:
                    continue
                if not valid(names.PROMPT_TOKENS_CACHED, value):
                    invalid += 1
                    continue
                values = slot(labels).values
                key = names.PROMPT_TOKENS_CACHED.name
                values[key] = values.get(key, 0.0) + value

    cache_configs: dict[str, CacheConfig] = {}
    for labels, _value in found.get(names.CACHE_CONFIG.sample_names[0], []):
        present[names.CACHE_CONFIG.name] = True
        engine = labels.get("engine", "")
        cache_configs[engine] = CacheConfig(engine=engine, fields=dict(labels))
    for signal in names.SIGNALS:
        present.setdefault(signal.name, False)
    return EngineSnapshot(engines=engines, cache_configs=cache_configs, present=present,
                          invalid_samples=invalid, lines=lines)
