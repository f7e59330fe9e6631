"""Helpers for the per-caller usage tests: a state with a fake clock, readers of its series."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from exporter.config import Config
from exporter.metrics import build_registry
from exporter.server import STATE_KEY, create_app
from exporter.signals.state import SignalsState
from exporter.wiring import signals_state
from tests.tap.conftest import start_tap, upstream  # noqa: F401 (the tap's fixtures, here too)


class FakeClock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_state(clock: FakeClock | None = None, **overrides: Any) -> SignalsState:
    """A SignalsState whose usage side reads the given fake clock."""
    return signals_state(Config(**overrides), clock=clock or FakeClock())


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value, 0.0 when the series does not exist (asserted separately)."""
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def requests(state: SignalsState, caller: str, state_name: str, model: str = "") -> float:
    return value(
        build_registry(state),
        "vllm_cache_requests_total",
        caller=caller,
        model=model,
        state=state_name,
    )


@pytest.fixture
def usage_client(aiohttp_client: Callable[..., Awaitable[TestClient]]):
    """Start the exporter app with config overrides; returns (client, SignalsState)."""

    async def start(**overrides: Any) -> tuple[TestClient, SignalsState]:
        config = dataclasses.replace(Config(), **overrides)
        state = make_state(**overrides)
        client = await aiohttp_client(create_app(config, state, initial_refresh=False))
        assert client.app[STATE_KEY] is state
        return client, state

    return start


def refused(state: SignalsState) -> dict[str, int]:
    """POST /v1/usage requests refused as a whole, by reason (those that happened)."""
    return {
        reason: count for reason, count in state.usage.ingest_requests_rejected.items() if count
    }
