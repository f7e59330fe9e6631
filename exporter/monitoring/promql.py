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
