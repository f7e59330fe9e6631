"""The demo's story: what changes, in plain words, as it happens, with the scenario time it
happened at.

Fed the same status model as the status page (``signals.status``) at every look, it says
what is new since the last look: a caller's first warm stretch, a caller's arrival, the live
conversations' fit in the pool (and the moment they stop fitting), each problem as it
appears (a collapse, with who and since when) and as it clears, the advice a scenario is
there to show (once, when it first appears), and the loop back to the start, which the demo
plays as a restart of its simulated vLLM (so that a climbing hit ratio is not taken for a
recovery, and what was wrong before the restart is not announced as cured when it leaves
the window: the restart ended it). The sentences are ``signals.advice``'s, the
same ``check`` and the page use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exporter.signals import advice
from exporter.signals.status import Status

# A caller counts as warm once its hit ratio over the window reaches this.
WARM_RATIO = 0.8
# Problems the story tells through its own lines (the fit) rather than as problems.
TOLD_OTHERWISE = frozenset({"overflow"})
# Advice the story tells once, when it first appears: what a scenario is there to show
# (prompt order in fanout-order, declared against used completions in max-tokens-overstated).
# Its figures move with every request, so it is not told again.
TOLD_ADVICE = frozenset({"prompt_order", "completions"})


@dataclass(frozen=True)
class Line:
    scenario_seconds: float
    kind: str  # warm, arrival, fit, overflow, restart, a problem's or advice's kind, cleared
    sentence: str

    def render(self) -> str:
        return f"[{clock(self.scenario_seconds)}] {self.sentence}"


@dataclass
class Story:
    """Remembers what it already told; ``look`` returns the new lines, oldest first.

    ``origin`` is the exporter's time at scenario second 0 (the demo runs the exporter on a
    clock that moves at the scenario's speed, so the difference is scenario seconds).
    """

    origin: float
    told_warm: set[str] = field(default_factory=set)
    callers: set[str] = field(default_factory=set)
    fits: dict[tuple[str, str], tuple[int, bool]] = field(default_factory=dict)
    problems: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    advised: set[tuple[str, str]] = field(default_factory=set)
    iterations: int = 0
    # Problems told before the last restart: they leave the window in silence.
    before_restart: set[tuple[str, str]] = field(default_factory=set)

    def at(self, when: float) -> float:
        return when - self.origin

    def look(self, status: Status, iterations: int = 0) -> list[Line]:
        lines: list[Line] = []
        now = self.at(status.now)
        if iterations > self.iterations:
            self.iterations = iterations
            lines.append(Line(now, "restart", restart_sentence()))
            self.before_restart = set(self.problems)
            self.fits.clear()  # the new loop's conversations are told afresh
        self._callers(status, lines)
        self._fits(status, now, lines)
        self._problems(status, now, lines)
        self._advice(status, now, lines)
        lines.sort(key=lambda line: line.scenario_seconds)
        return lines

    def _callers(self, status: Status, lines: list[Line]) -> None:
        for view in sorted(status.callers, key=lambda view: view.first_seen):
            if view.caller not in self.callers:
                if self.callers:
                    lines.append(
                        Line(
                            self.at(view.first_seen),
                            "arrival",
                            advice.arrival_sentence(view.caller, len(self.callers) + 1),
                        )
                    )
                self.callers.add(view.caller)
            if (
                view.caller not in self.told_warm
                and view.ratio_window is not None
                and view.ratio_window >= WARM_RATIO
                and view.requests["warm"] > 0
            ):
                self.told_warm.add(view.caller)
                lines.append(
                    Line(
                        self.at(status.now),
                        "warm",
                        advice.warm_sentence(view.caller, view.ratio_window, status.window_seconds),
                    )
                )

    def _fits(self, status: Status, now: float, lines: list[Line]) -> None:
        for engine in status.engines:
            for fit in engine.fits:
                key = (engine.target, fit.model_name)
                shape = (fit.fit.conversations, fit.fit.overflows)
                if fit.fit.conversations == 0 or self.fits.get(key) == shape:
                    continue
                self.fits[key] = shape
                lines.append(Line(now, "overflow" if fit.fit.overflows else "fit", fit.sentence))

    def _problems(self, status: Status, now: float, lines: list[Line]) -> None:
        current = {item.key: item for item in status.problems if item.kind not in TOLD_OTHERWISE}
        for key, item in current.items():
            if key in self.before_restart:
                continue  # the previous loop's, still in the window: the restart ended it
            told = self.problems.get(key)
            if told is not None and set(item.callers) <= set(told):
                continue
            self.problems[key] = tuple(dict.fromkeys((*(told or ()), *item.callers)))
            when = self.at(item.since) if item.since is not None else now
            lines.append(Line(max(0.0, when), item.kind, item.sentence))
        for key in [key for key in self.problems if key not in current]:
            callers = self.problems.pop(key)
            if key in self.before_restart:
                self.before_restart.discard(key)
                continue  # not a recovery: it ended with the restart, already told
            kind, where = key
            sentence = (
                advice.recovered_sentence(list(callers))
                if kind == "collapse"
                else f"No longer: {kind.replace('_', ' ')} ({where})."
            )
            lines.append(Line(now, "cleared", sentence))

    def _advice(self, status: Status, now: float, lines: list[Line]) -> None:
        for item in status.advice:
            if item.kind in TOLD_ADVICE and item.key not in self.advised:
                self.advised.add(item.key)
                lines.append(Line(now, item.kind, f"note: {item.sentence}"))


def restart_sentence() -> str:
    return (
        "vLLM restarts (the demo loops as a restart: counters from 0, the cache empty) and "
        "the scenario starts again. The conversations it held are over: their demand leaves "
        "the fit at once. The new conversations' first turns are cold, then warm: a hit "
        "ratio climbing now is this restart, not a recovery, and what was wrong before it "
        "ended with it."
    )


def clock(seconds: float) -> str:
    minutes, secs = divmod(int(max(0.0, seconds)), 60)
    return f"{minutes:d}:{secs:02d}"
