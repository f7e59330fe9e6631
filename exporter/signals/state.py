"""The one mutable object of the process: everything the metrics layer renders.

Readers write into it (engine snapshots, usage events); collectors only read it. It holds no
I/O handles and reads no clock: times are handed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from exporter.config import Config
from exporter.signals.engine import EngineState
from exporter.signals.usage import UsageState


class SignalsState:
    def __init__(self, config: Config, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.engine = EngineState(config.engine_targets)
        self.usage = UsageState(config, engine=self.engine, clock=clock)
