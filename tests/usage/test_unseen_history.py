"""Several exporters behind one stream: a turn whose cached tokens this exporter's memory of
the conversation cannot explain is counted (``vllm_cache_unseen_history_requests_total``,
per model), so a split that is not sticky by session shows instead of being misread."""

from __future__ import annotations

from exporter.metrics import build_registry
from exporter.values import UsageEvent
from tests.usage.conftest import FakeClock, make_state, value

# One conversation of five turns: each prompt is the last context plus 1,000 new tokens, and
# all but the new part is cached (whole 16-token blocks). The granule is vLLM's block size
# (--signals.granularity 16); before the exporter knows it, a provisional one as large as the
# counts seen keeps it from calling anything unseen.
TURNS = [(10_000, 0), (11_500, 10_496), (13_000, 11_488), (14_500, 12_992), (16_000, 14_496)]


def turn(prompt: int, cached: int, session: str | None = "s1", caller: str = "a") -> UsageEvent:
    return UsageEvent(caller, "qwen", prompt, cached, 500, session=session)


def counts(state) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    registry = build_registry(state)
    return (
        value(registry, "vllm_cache_conversation_turns_total", model="qwen"),
        value(registry, "vllm_cache_unseen_history_requests_total", model="qwen"),
    )


def test_one_exporter_that_sees_every_turn_counts_none_unseen() -> None:
    state = make_state(FakeClock(), signals_granularity=16)
    for prompt, cached in TURNS:
        state.usage.record(turn(prompt, cached), "http")
    assert counts(state) == (5, 0)


def test_a_split_by_request_shows_on_both_exporters() -> None:
    """Round robin over two exporters: every turn after the first follows one the exporter
    did not see, so its cache holds more than the exporter's memory explains."""
    first, second = (
        make_state(FakeClock(), signals_granularity=16),
        make_state(FakeClock(), signals_granularity=16),
    )
    for index, (prompt, cached) in enumerate(TURNS):
        (first if index % 2 == 0 else second).usage.record(turn(prompt, cached), "http")
    assert counts(first) == (3, 2)  # turns 3 and 5
    assert counts(second) == (2, 2)  # turn 2 (a conversation it never saw) and turn 4


def test_a_shared_prefix_is_not_unseen_history() -> None:
    """A fan-out's sub-agents, each its own session, share the caller's 2,400-token prefix:
    a conversation never seen may cache what any conversation on the model holds (another
    caller's too: a system prompt, a chat template). A conversation without session id, its
    completion unreported, explains whatever it caches."""
    state = make_state(FakeClock(), signals_granularity=16)
    state.usage.record(turn(3_000, 0, session="agent-0", caller="fan"), "http")
    for agent in range(1, 6):
        state.usage.record(turn(3_100, 2_400, session=f"agent-{agent}", caller="fan"), "http")
    state.usage.record(UsageEvent("b", "qwen", 5_000, 0, None), "http")
    state.usage.record(UsageEvent("b", "qwen", 6_000, 5_600, None), "http")
    assert counts(state) == (8, 0)
    # Another caller's first conversation sharing that prefix is explained too...
    state.usage.record(turn(3_100, 2_400, session="x", caller="other"), "http")
    assert counts(state) == (9, 0)
    # ...but not one that found more cached than any conversation on the model ever held.
    state.usage.record(turn(9_000, 8_000, session="y", caller="other"), "http")
    assert counts(state) == (10, 1)
