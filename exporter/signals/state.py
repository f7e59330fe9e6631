"""The one mutable object of the process: everything the metrics layer renders.

Readers write into it (engine snapshots, usage events) through the callables they are
handed; collectors only read it. It holds no I/O handles and reads no clock: times are
handed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from exporter.signals import foresight
from exporter.signals.engine import EngineState, TargetState
from exporter.signals.usage import UsageSettings, UsageState


class SignalsState:
    def __init__(
        self,
        targets: Sequence[str] = (),
        usage: UsageSettings | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = EngineState(tuple(targets), on_restart=self.engine_restarted)
        self.usage = UsageState(usage or UsageSettings(), engine=self.engine, clock=clock)

    def engine_restarted(self, target: TargetState, at: float | None, read_at: float) -> None:
        """A vLLM restarted: the conversations it held end (``foresight.end_on_target``).

        Those last seen before the restart end: by its ``_created`` time when the engine
        gave one between the previous read and this one (``at``), else every one seen before
        this read (a turn that came back between the restart and the read is ended too, and
        counts again from its next turn). The usage clock may not be the reader's (the demo
        runs it faster), so the restart is placed as long before the usage clock's now as it
        was before the read."""
        now = self.usage.now()
        before = now if at is None else now - max(0.0, read_at - at)
        foresight.end_on_target(self.usage.conversations, self.engine, target.shown, before)
