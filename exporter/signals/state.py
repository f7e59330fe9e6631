"""The one mutable object of the process: everything the metrics layer renders.

Readers write into it (engine snapshots, usage events) through the callables they are
handed; collectors only read it. It holds no I/O handles and reads no clock: times are
handed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from exporter.signals.engine import EngineState
from exporter.signals.usage import UsageSettings, UsageState


class SignalsState:
    def __init__(
        self,
        targets: Sequence[str] = (),
        usage: UsageSettings | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = EngineState(tuple(targets))
        self.usage = UsageState(usage or UsageSettings(), engine=self.engine, clock=clock)
