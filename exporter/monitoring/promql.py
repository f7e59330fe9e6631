"""Small PromQL builders shared by the rule, alert and dashboard generators.

They exist so that the selector and the aggregation labels are spelled in exactly one place:
a rule that forgot the selector would mix another job's series into a ratio, and one that
dropped a group label would sum two clusters into one.
"""

from __future__ import annotations

from exporter.monitoring.config import MonitoringConfig

CLASSIFIED_STATES = ("warm", "partial", "cold")  # states that say something about the cache


class PromQL:
    def __init__(self, config: MonitoringConfig) -> None:
        self.config = config

    def sel(self, *matchers: str) -> str:
        """``{<selector>, <matchers>}``."""
        parts = [self.config.selector.strip()] if self.config.selector.strip() else []
        parts.extend(matchers)
        return "{" + ", ".join(parts) + "}"

    def labels(self, *level: str) -> tuple[str, ...]:
        """Group labels followed by the level's own labels, without repeats."""
        return tuple(dict.fromkeys((*self.config.group_labels, *level)))

    def by(self, *level: str) -> str:
        return "by (" + ", ".join(self.labels(*level)) + ")"

    def on(self, *level: str) -> str:
        return "on (" + ", ".join(self.labels(*level)) + ")"

    def dedup(self, expr: str) -> str:
        """``expr`` (the exporter's own series, or a function of them) with the copies an HA
        pair of Prometheus servers made folded into one: ``max without (<replica_labels>)``.
        Every sum of the exporter's series goes through it, so a store holding both replicas'
        copies (a central Prometheus fed by remote write, VictoriaMetrics) does not double it;
        where the label is absent it changes nothing."""
        if not self.config.replica_labels:
            return expr
        return f"max without ({', '.join(self.config.replica_labels)}) ({expr})"

    def sum_by(self, level: tuple[str, ...], expr: str) -> str:
        """``sum by (<group labels>, <level>) (<dedup(expr)>)``: the one way the exporter's
        own series are summed."""
        return f"sum {self.by(*level)} ({self.dedup(expr)})"

    @staticmethod
    def window_suffix(window: str) -> str:
        return "rate" + window

    @staticmethod
    def states_matcher(states: tuple[str, ...] = CLASSIFIED_STATES) -> str:
        return 'state=~"' + "|".join(states) + '"'


def number(value: float) -> str:
    """A threshold as PromQL and YAML readers expect it: 0.5, 100, 1e-05 never."""
    if float(value).is_integer():
        return str(int(value))
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return text


# --- the shared expressions ---------------------------------------------------------------
# Rules and dashboards build every ratio from these, so a guard is written once: a ``> 0``
# denominator makes an idle window yield no sample instead of NaN or a fake 0, and
# ``(numerator or denominator * 0)`` makes an absent numerator (a caller that never had a
# warm turn) an honest 0 for every label set the denominator has.


def guarded(denominator: str) -> str:
    """A denominator that drops its zero samples."""
    return f"({denominator} > 0)"


def over(numerator: str, denominator: str) -> str:
    """numerator / denominator, no sample where the denominator is 0."""
    return f"{numerator}\n/\n{guarded(denominator)}"


def ratio(numerator: str, denominator: str) -> str:
    """numerator / denominator where the numerator may be absent: 0 then, never a gap."""
    return f"(\n  {numerator}\n  or\n  {denominator} * 0\n)\n/\n{guarded(denominator)}"


def hit_ratio(cached: str, prompt: str) -> str:
    """The token hit ratio: cached (or hit) tokens over prompt (or looked-up) tokens, both
    already summed rates over the same labels."""
    return ratio(cached, prompt)


def warm_share(warm: str, classified: str) -> str:
    """The share of warm turns among the classified ones (warm, partial, cold): short,
    unknown and error turns say nothing about the cache and are out of the denominator."""
    return ratio(warm, classified)


def share(part: str, whole: str) -> str:
    """A part of a whole that is always at least the part (unreported of all prompt tokens)."""
    return over(part, whole)
