"""Text 0.0.4 and OpenMetrics 1.0.0 for our registry, byte for byte what client_python writes.

client_python's encoders (``prometheus_client.exposition.generate_latest`` and
``prometheus_client.openmetrics.exposition.generate_latest``) do Python-level work per sample
(a dict sort, a ``str.format`` per label, ``floatToGoString`` per value), which at many
callers held the event loop for most of a second per scrape (docs/performance.md). This
module writes the same bytes faster:

- A ``Format`` is one negotiated exposition: 0.0.4 text or OpenMetrics, with the client_python
  encoder ``choose_encoder`` picked for the request's ``Accept`` header kept as the reference
  (and the fallback). ``TEXT`` and ``OPENMETRICS`` are the plain ones.
- ``encode_families`` is a general encoder for any ``Metric`` (the engine and self series, and
  the small usage families), with client_python's rules. Text: counters get ``_total``,
  ``info`` becomes an ``_info`` gauge, ``unknown`` prints as ``untyped``,
  ``_created``/``_gsum``/``_gcount`` samples go to their own gauge family after the metric,
  HELP escapes ``\\`` and newline, timestamps print in milliseconds. OpenMetrics: names and
  types as they are, a ``# UNIT`` line when there is a unit, samples in their order, HELP also
  escapes ``"``, timestamps print as given, ``# EOF`` at the end. Both: labels sorted by name,
  label values escape ``\\``, ``"`` and newline, values formatted as ``floatToGoString`` does
  (``format_value``, with fast paths for the common cases).
- What we do not write ourselves goes to client_python, one family at a time: a family with a
  metric, sample or label name outside ``[a-zA-Z_][a-zA-Z0-9_]*`` (client_python's escaping
  and quoting of such names changed between releases), exemplars or native histograms. A
  whole request goes to client_python when it asks for what we do not write at all (a name
  escaping other than underscores or allow-utf-8, an OpenMetrics version other than 1.0.0).
  So the output follows the installed client_python release.
- A collector may offer ``render_slices(out, fmt)`` beside ``collect()``: a generator that
  appends the very lines ``encode_families(collect(), out, fmt)`` would, from cached label
  text, and yields between slices of its series (the per-caller collector does; see
  ``exporter.metrics.usage``). ``collect()`` stays the reference and serves
  ``registry.get_sample_value``.
- ``generate`` renders at once; ``render_pieces`` and ``generate_async`` render the same
  bytes slice by slice, giving the event loop a turn between slices (what /metrics uses).

client_python names used: ``exposition.choose_encoder``, ``exposition.generate_latest``,
``openmetrics.exposition.generate_latest``, ``utils.floatToGoString``, ``CollectorRegistry``,
``registry.Collector``, ``metrics_core.Metric`` (all present from 0.20 to 0.26).
``tests/test_exposition.py`` asserts byte equality with both client_python encoders.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from threading import Lock

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.exposition import generate_latest as text_reference
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_reference
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = [
    "OPENMETRICS",
    "TEXT",
    "ExporterRegistry",
    "Format",
    "choose_format",
    "encode_families",
    "escape_help",
    "escape_label_value",
    "format_value",
    "generate",
    "generate_async",
    "generate_openmetrics",
    "generate_text",
    "header",
    "openmetrics_header",
    "render_pieces",
    "render_slices",
]

_NEG_INF = -math.inf
_EXACT_INT = 2**53  # ints of smaller magnitude are exact as floats and repr as "N.0"

# generate_latest's renaming of types for the 0.0.4 text format: (name suffix, printed type)
_TEXT_TYPES = {
    "counter": ("_total", "counter"),
    "info": ("_info", "gauge"),
    "stateset": ("", "gauge"),
    "gaugehistogram": ("", "histogram"),
    "unknown": ("", "untyped"),
}
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")
_EOF = "# EOF\n"

# Name escapings (client_python >= 0.23, from the Accept header) under which a name matching
# _PLAIN prints unchanged, and so which our encoder writes. Before 0.23 there is no escaping.
# Not "values": client_python's OpenMetrics encoder rewrites even plain sample names under it.
_PLAIN_ESCAPINGS = frozenset({"underscores", "allow-utf-8"})
_PLAIN = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_plain_names: set[str] = set()


def _is_plain(name: str) -> bool:
    """Whether ``name`` prints unchanged under every client_python release and escaping."""
    if name in _plain_names:
        return True
    if _PLAIN.fullmatch(name) is None:
        return False
    if len(_plain_names) < 4096:  # names are few and fixed; bounded in case they are not
        _plain_names.add(name)
    return True


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


def header(name: str, documentation: str, metric_type: str) -> str:
    """The ``# HELP`` and ``# TYPE`` lines of a family in the 0.0.4 text format."""
    suffix, printed = _TEXT_TYPES.get(metric_type, ("", metric_type))
    exposed = name + suffix
    return f"# HELP {exposed} {escape_help(documentation)}\n# TYPE {exposed} {printed}\n"


def openmetrics_header(name: str, documentation: str, metric_type: str, unit: str = "") -> str:
    """The ``# HELP``, ``# TYPE`` and (with a unit) ``# UNIT`` lines of an OpenMetrics family."""
    lines = f"# HELP {name} {escape_label_value(documentation)}\n# TYPE {name} {metric_type}\n"
    if unit:
        lines += f"# UNIT {name} {unit}\n"
    return lines


class _Families:
    """Families already collected, as the registry-like object client_python encodes."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


@dataclass(frozen=True)
class Format:
    """One exposition format as negotiated for a request, and who writes it.

    ``reference`` is the client_python encoder for it (with the request's escaping and
    version): the bytes we match, and what writes what we do not (``ours`` false: all of it).
    ``key`` tells apart the bodies a cache may share.
    """

    openmetrics: bool
    content_type: str
    reference: Callable[[Collector], bytes]
    ours: bool
    key: tuple[str, ...]

    def header(self, name: str, documentation: str, metric_type: str, unit: str = "") -> str:
        if self.openmetrics:
            return openmetrics_header(name, documentation, metric_type, unit)
        return header(name, documentation, metric_type)

    def reference_family(self, metric: Metric) -> str:
        """One family as client_python writes it (without OpenMetrics' ``# EOF``)."""
        text = self.reference(_Families([metric])).decode("utf-8")
        if self.openmetrics and text.endswith(_EOF):
            text = text[: -len(_EOF)]
        return text


TEXT = Format(False, "text/plain; version=0.0.4; charset=utf-8", text_reference, True, ("text",))
OPENMETRICS = Format(
    True,
    "application/openmetrics-text; version=1.0.0; charset=utf-8",
    openmetrics_reference,
    True,
    ("openmetrics",),
)


def choose_format(accept_header: str) -> Format:
    """The format client_python's ``choose_encoder`` picks for ``Accept``, its content type.

    Our encoder writes it unless it asks for a name escaping we do not write or an
    OpenMetrics version other than 1.0.0; releases before 0.23 return the bare encoders.
    """
    encoder, content_type = choose_encoder(accept_header)
    function, keywords = encoder, {}
    if isinstance(encoder, partial) and not encoder.args:
        function, keywords = encoder.func, dict(encoder.keywords)
    escaping = keywords.pop("escaping", None)
    version = keywords.pop("version", None)
    if function is openmetrics_reference:
        ours = version in (None, "1.0.0")
        openmetrics = True
    else:
        ours = function is text_reference
        openmetrics = False
    ours = ours and not keywords and (escaping is None or escaping in _PLAIN_ESCAPINGS)
    key = (
        "openmetrics" if openmetrics else "text",
        content_type,
        str(escaping),
        str(version),
        "ours" if ours else "client_python",
    )
    return Format(openmetrics, content_type, encoder, ours, key)


def _writes_family(metric: Metric) -> bool:
    """Whether our encoder writes ``metric`` (plain names, no exemplar, no native histogram)."""
    if not _is_plain(metric.name):
        return False
    for sample in metric.samples:
        if sample.exemplar or getattr(sample, "native_histogram", None):
            return False
        if not _is_plain(sample.name):
            return False
        for label in sample.labels:
            if not _is_plain(label):
                return False
    return True


def _label_text(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    if len(labels) == 1:
        ((key, label_value),) = labels.items()
        return f'{{{key}="{escape_label_value(label_value)}"}}'
    return (
        "{"
        + ",".join([f'{key}="{escape_label_value(labels[key])}"' for key in sorted(labels)])
        + "}"
    )


def _encode_text_family(metric: Metric, out: list[str]) -> None:
    out.append(header(metric.name, metric.documentation, metric.type))
    extra: dict[str, list[str]] = {}
    base = metric.name
    om_names = {base + suffix: suffix for suffix in _OM_SUFFIXES}
    for sample in metric.samples:
        stamp = ""
        if sample.timestamp is not None:
            stamp = f" {int(float(sample.timestamp) * 1000):d}"
        line = f"{sample.name}{_label_text(sample.labels)} {format_value(sample.value)}{stamp}\n"
        suffix = om_names.get(sample.name)
        if suffix is None:
            out.append(line)
        else:
            extra.setdefault(suffix, []).append(line)
    for suffix, lines in sorted(extra.items()):
        out.append(header(base + suffix, metric.documentation, "gauge"))
        out.extend(lines)


def _encode_openmetrics_family(metric: Metric, out: list[str]) -> None:
    out.append(openmetrics_header(metric.name, metric.documentation, metric.type, metric.unit))
    for sample in metric.samples:
        stamp = "" if sample.timestamp is None else f" {sample.timestamp}"
        out.append(
            f"{sample.name}{_label_text(sample.labels)} {format_value(sample.value)}{stamp}\n"
        )


def encode_families(families: Iterable[Metric], out: list[str], fmt: Format = TEXT) -> None:
    """Append the exposition of ``families`` to ``out``, as ``fmt.reference`` would write it."""
    encode = _encode_openmetrics_family if fmt.openmetrics else _encode_text_family
    for metric in families:
        if _writes_family(metric):
            encode(metric, out)
        else:
            out.append(fmt.reference_family(metric))


class ExporterRegistry(CollectorRegistry):
    """A CollectorRegistry that also renders itself through ``generate``.

    It keeps its collectors in registration order (what ``collect()`` iterates) so that the
    encoder can ask each for ``render_slices`` rather than for metric families.
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


def render_slices(registry: ExporterRegistry, fmt: Format, out: list[str]) -> Iterator[None]:
    """Append ``registry``'s exposition to ``out``, yielding between slices of the work.

    Each collector is one slice unless it offers ``render_slices`` (then it slices itself).
    """
    for collector in registry.collectors():
        slices = getattr(collector, "render_slices", None)
        if slices is not None:
            yield from slices(out, fmt)
        else:
            encode_families(collector.collect(), out, fmt)
        yield
    if fmt.openmetrics:
        out.append(_EOF)


def _ours(registry: CollectorRegistry, fmt: Format) -> bool:
    return fmt.ours and isinstance(registry, ExporterRegistry)


def generate(registry: CollectorRegistry, fmt: Format = TEXT) -> bytes:
    """``fmt.reference(registry)``, the same bytes, rendered at once; fast for our registry."""
    if not _ours(registry, fmt):
        return fmt.reference(registry)
    out: list[str] = []
    for _ in render_slices(registry, fmt, out):  # type: ignore[arg-type]
        pass
    return "".join(out).encode("utf-8")


def generate_text(registry: CollectorRegistry) -> bytes:
    """client_python's ``generate_latest(registry)`` (0.0.4 text), same bytes."""
    return generate(registry, TEXT)


def generate_openmetrics(registry: CollectorRegistry) -> bytes:
    """client_python's ``openmetrics.exposition.generate_latest(registry)``, same bytes."""
    return generate(registry, OPENMETRICS)


async def _next_loop_turn() -> None:
    await asyncio.sleep(0)


async def render_pieces(
    registry: CollectorRegistry,
    fmt: Format = TEXT,
    pause: Callable[[], Awaitable[None]] = _next_loop_turn,
) -> list[bytes]:
    """``generate(registry, fmt)`` in slices, as encoded pieces, awaiting ``pause()`` between.

    Each slice's lines are joined and encoded before the pause, so no step touches the whole
    exposition on the event loop; joining the pieces (``generate_async``) or compressing them
    is left to a worker thread.

    Other tasks (usage ingest) run between slices, so they may change the state while it
    renders. What a body then holds: the per-caller series that existed when their
    collector began (one added later waits for the next scrape), each series' samples read
    together in one slice, so from one instant, and different series possibly from instants
    a few milliseconds apart; collectors without ``render_slices`` are read in one slice
    each. When nothing changes, the bytes equal ``generate``'s. A format we do not write is
    collected on the loop and encoded by client_python in a worker thread.
    """
    if not _ours(registry, fmt):
        families = list(registry.collect())
        return [await asyncio.to_thread(fmt.reference, _Families(families))]  # type: ignore[arg-type]
    out: list[str] = []
    pieces: list[bytes] = []
    for _ in render_slices(registry, fmt, out):  # type: ignore[arg-type]
        if out:
            pieces.append("".join(out).encode("utf-8"))
            out.clear()
        await pause()
    pieces.append("".join(out).encode("utf-8"))
    return pieces


async def generate_async(
    registry: CollectorRegistry,
    fmt: Format = TEXT,
    pause: Callable[[], Awaitable[None]] = _next_loop_turn,
) -> bytes:
    """``generate(registry, fmt)``, rendered by ``render_pieces``, joined in a worker thread
    (``bytes.join`` lets go of the GIL for large bodies)."""
    pieces = await render_pieces(registry, fmt, pause)
    if len(pieces) == 1:
        return pieces[0]
    return await asyncio.to_thread(b"".join, pieces)
