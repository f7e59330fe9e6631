"""Text exposition format 0.0.4 for our registry, byte for byte what client_python writes.

``prometheus_client.exposition.generate_latest`` spends ~8 µs per sample (a dict sort, a
``str.format`` per label, ``floatToGoString`` per value), which at 1,000 callers (~78,000
samples) held the event loop for most of a second per scrape. This module writes the same
bytes faster:

- ``encode_families`` is a general encoder for any ``Metric`` (the engine and self series,
  and the small usage families), with ``generate_latest``'s rules: counters get ``_total``,
  ``info`` becomes a ``_info`` gauge, labels are sorted by name, label values escape ``\\``,
  ``"`` and newline, HELP escapes ``\\`` and newline, ``_created``/``_gsum``/``_gcount``
  samples go to their own gauge family after the metric, values are formatted as
  ``floatToGoString`` does (``format_value``, with fast paths for the common cases).
- A collector may offer ``render_text(out)`` beside ``collect()``: it appends the very lines
  ``encode_families(collect())`` would, from cached label text (the per-caller collector does;
  see ``exporter.metrics.usage``). ``collect()`` stays the reference and serves
  ``registry.get_sample_value`` and the OpenMetrics encoder.

``tests/test_exposition.py`` asserts byte equality with ``generate_latest`` over the engine
fixtures, hostile label values, every state and odd floats, plus a hypothesis property.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from threading import Lock

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import (
    UNDERSCORES,
    escape_label_name,
    escape_metric_name,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["ExporterRegistry", "encode_families", "escape_help", "escape_label_value",
           "format_value", "generate_text", "header"]

_NEG_INF = -math.inf
_EXACT_INT = 2 ** 53  # ints of smaller magnitude are exact as floats and repr as "N.0"

# generate_latest's renaming of types for the 0.0.4 text format: (name suffix, printed type)
_TEXT_TYPES = {
    "counter": ("_total", "counter"),
    "info": ("_info", "gauge"),
    "stateset": ("", "gauge"),
    "gaugehistogram": ("", "histogram"),
    "unknown": ("", "untyped"),
}
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")


def format_value(value: float) -> str:
    """``floatToGoString(value)``, without its Python-level work for the common cases.

    An int below 1e6 (and above -2**53) is exact as a float whose repr is ``"N.0"``; a float
    below 1e6 that is not NaN or -Inf is printed by ``floatToGoString`` as its repr (Go only
    switches to an exponent sooner for positive values of 1e6 and more). Everything else
    (large values, NaN, infinities, bools, float subclasses) goes through client_python.
    """
    kind = type(value)
    if kind is int:
        if -_EXACT_INT < value < 1_000_000:  # type: ignore[operator]
            return f"{value}.0"
    elif kind is float and _NEG_INF < value < 1e6:
        return repr(value)
    return floatToGoString(value)


def escape_label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


_metric_names: dict[str, str] = {}
_label_names: dict[str, str] = {}


def _memoized(cache: dict[str, str], escape, name: str) -> str:
    """Escaped names are few and fixed: escape each once (bounded, in case they are not)."""
    escaped = cache.get(name)
    if escaped is None:
        escaped = escape(name, UNDERSCORES)
        if len(cache) < 4096:
            cache[name] = escaped
    return escaped


def _metric_name(name: str) -> str:
    return _memoized(_metric_names, escape_metric_name, name)


def _label_name(name: str) -> str:
    return _memoized(_label_names, escape_label_name, name)


def header(name: str, documentation: str, metric_type: str) -> str:
    """The ``# HELP`` and ``# TYPE`` lines of a family, as ``generate_latest`` prints them."""
    suffix, printed = _TEXT_TYPES.get(metric_type, ("", metric_type))
    exposed = _metric_name(name + suffix)
    return f"# HELP {exposed} {escape_help(documentation)}\n# TYPE {exposed} {printed}\n"


def _sample_line(name: str, labels: dict[str, str], value: float,
                 timestamp: object) -> str:
    if labels:
        if len(labels) == 1:
            ((key, label_value),) = labels.items()
            text = f'{{{_label_name(key)}="{escape_label_value(label_value)}"}}'
        else:
            text = "{" + ",".join([f'{_label_name(key)}="{escape_label_value(labels[key])}"'
                                   for key in sorted(labels)]) + "}"
    else:
        text = ""
    stamp = ""
    if timestamp is not None:
        stamp = f" {int(float(timestamp) * 1000):d}"  # type: ignore[arg-type]
    return f"{_metric_name(name)}{text} {format_value(value)}{stamp}\n"


def encode_families(families: Iterable[Metric], out: list[str]) -> None:
    """Append the text exposition of ``families`` to ``out``, as ``generate_latest`` would."""
    for metric in families:
        out.append(header(metric.name, metric.documentation, metric.type))
        extra: dict[str, list[str]] = {}
        base = metric.name
        om_names = {base + suffix: suffix for suffix in _OM_SUFFIXES}
        for sample in metric.samples:
            line = _sample_line(sample.name, sample.labels, sample.value, sample.timestamp)
            suffix = om_names.get(sample.name)
            if suffix is None:
                out.append(line)
            else:
                extra.setdefault(suffix, []).append(line)
        for suffix, lines in sorted(extra.items()):
            out.append(header(base + suffix, metric.documentation, "gauge"))
            out.extend(lines)


def _render(collector: Collector, out: list[str]) -> None:
    fast = getattr(collector, "render_text", None)
    if fast is not None:
        fast(out)
    else:
        encode_families(collector.collect(), out)


class ExporterRegistry(CollectorRegistry):
    """A CollectorRegistry that also renders itself through ``generate_text``.

    It keeps its collectors in registration order (what ``collect()`` iterates) so that the
    text encoder can ask each for ``render_text`` rather than for metric families.
    """

    def __init__(self) -> None:
        super().__init__(auto_describe=False)
        self._ordered: list[Collector] = []
        self._ordered_lock = Lock()

    def set_target_info(self, labels: dict[str, str] | None) -> None:
        if labels:
            raise ValueError("ExporterRegistry does not serve target_info")
        super().set_target_info(labels)

    def register(self, collector: Collector) -> None:
        super().register(collector)
        with self._ordered_lock:
            self._ordered.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        with self._ordered_lock:
            self._ordered.remove(collector)

    def collectors(self) -> list[Collector]:
        with self._ordered_lock:
            return list(self._ordered)


def generate_text(registry: CollectorRegistry) -> bytes:
    """``generate_latest(registry)``, same bytes; fast for an ``ExporterRegistry``."""
    if not isinstance(registry, ExporterRegistry):
        return generate_latest(registry)
    out: list[str] = []
    for collector in registry.collectors():
        _render(collector, out)
    return "".join(out).encode("utf-8")
