"""Why the field reports' prompt tokens missed the cache, as the miss-cause counters say:
each scenario played in virtual time and read back from the exporter's /metrics, its
usage POSTed to /v1/usage (``through_exporter``) or its traffic sent through the tap."""

from __future__ import annotations

import pytest

from exporter.config import Config
from exporter.engine.parse import parse
from exporter.metrics import build_registry
from exporter.metrics.exposition import generate_text
from exporter.signals.classify import CAUSES, EVICTED, GRANULE, NEW, ORDER, UNKNOWN
from exporter.sim import scenario as scenarios
from exporter.sim.client import HttpClient
from exporter.sim.clock import SimClock, run_virtual
from exporter.sim.driver import Driver
from exporter.sim.server import build_simulator, create_sim_app, start_site
from exporter.wiring import signals_state, tap_app
from tests.helpers import value
from tests.sim.conftest import played

HOST = "127.0.0.1"
TOKENS = "vllm_cache_missed_prompt_tokens_total"
REQUESTS = "vllm_cache_missed_requests_total"


def missed(text: str, caller: str, name: str = TOKENS) -> dict[str, float]:
    return {cause: value(text, name, caller=caller, cause=cause) or 0.0 for cause in CAUSES}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {cause: after[cause] - before[cause] for cause in CAUSES}


def uncached(text: str, caller: str) -> float:
    """What the causes must add up to: prompt - cached + unreported."""
    return sum(
        value(text, name, caller=caller) or 0.0
        for name in ("vllm_cache_prompt_tokens_total", "vllm_cache_unreported_prompt_tokens_total")
    ) - (value(text, "vllm_cache_cached_tokens_total", caller=caller) or 0.0)


async def test_two_agents_collapse_is_evicted_once_agent_b_arrives(through_exporter):
    """Alone, agent-a misses only its first read and each turn's tail; once agent-b arrives,
    most of agent-a's uncached prompt tokens are ones its previous turn had left reusable:
    evicted."""
    run = played("two-agents-collapse")
    events = [event for _, event in run.events]
    b_arrives = next(i for i, event in enumerate(events) if event["caller"] == "agent-b")
    alone, shared = await through_exporter(
        run.metrics_text, [events[:b_arrives], events[b_arrives:]]
    )
    before = missed(alone, "agent-a")
    assert before[EVICTED] == 0
    assert {cause for cause, count in before.items() if count} <= {NEW, GRANULE}
    after = delta(before, missed(shared, "agent-a"))
    share = after[EVICTED] / sum(after.values())
    print(f"two-agents-collapse, agent-a after agent-b arrives: evicted {share:.1%} of missed")
    assert share > 0.5, after
    for text in (alone, shared):
        for caller in ("agent-a", "agent-b"):
            assert sum(missed(text, caller).values()) == uncached(text, caller)


async def test_two_agents_fit_evicts_nothing(through_exporter):
    run = played("two-agents-fit")
    (text,) = await through_exporter(run.metrics_text, [[event for _, event in run.events]])
    for caller in ("agent-a", "agent-b"):
        counts = missed(text, caller)
        assert sum(counts.values()) == uncached(text, caller)
        print(f"two-agents-fit, {caller}: {counts}")
        assert counts[EVICTED] <= 0.01 * sum(counts.values()), counts
        requests = missed(text, caller, REQUESTS)
        assert requests[NEW] == 1 and requests[EVICTED] == 0


async def test_prefix_caching_off_is_caching_off(through_exporter):
    run = played("prefix-caching-off")
    (text,) = await through_exporter(run.metrics_text, [[event for _, event in run.events]])
    callers = {event["caller"] for _, event in run.events}
    for caller in callers:
        counts = missed(text, caller)
        avoidable = sum(counts.values()) - counts[GRANULE]
        print(f"prefix-caching-off, {caller}: {counts}")
        assert avoidable > 0 and counts["caching_off"] == avoidable
        assert sum(counts.values()) == uncached(text, caller)


async def test_fanout_order_over_usage_posts_is_not_read_as_evicted(through_exporter):
    """POST /v1/usage carries no prompt text: the task-first fan-out's lost share cannot be
    named order there. Each fan-out request is its own session's first turn: new, never
    evicted."""
    run = played("fanout-order")
    (text,) = await through_exporter(run.metrics_text, [[event for _, event in run.events]])
    counts = missed(text, "fanout-task-first")
    print(f"fanout-order over /v1/usage, fanout-task-first: {counts}")
    assert counts[EVICTED] == counts[ORDER] == 0
    assert counts[NEW] > 0.5 * sum(counts.values())
    assert sum(counts.values()) == uncached(text, "fanout-task-first")


def play_through_tap(name: str, session_header: str = "X-Session-Id") -> str:
    """The scenario's clients sent through the exporter's tap in front of the simulator, as
    the demo does (docs: fanout-order's demo), on a virtual-time loop: the sockets are real
    (loopback), the waits are jumps. Each request names its conversation in
    ``session_header`` (the tap's is X-Session-Id; another name: the tap sees none). The
    exporter's engine side reads the simulator once first (its block size, whether caching
    is on); returns the exporter's /metrics."""
    scenario = scenarios.load(name)

    async def main() -> str:
        clock = SimClock(1.0)
        sim = build_simulator(scenario.engine_config(), clock)
        sim_runner, sim_port = await start_site(create_sim_app(sim), HOST, 0)
        sim_base = f"http://{HOST}:{sim_port}"
        origin = 1_800_000_000.0

        def exporter_clock() -> float:
            return origin + clock.now()

        config = Config(
            vllm_url=(sim_base,),
            tap_listen_address=f"{HOST}:0",
            tap_upstream=sim_base,
            usage_new_series_hold=0.0,
        )
        state = signals_state(config, clock=exporter_clock)
        (target,) = state.engine.targets
        state.engine.record_success(
            target, parse(sim.render_metrics().decode()), 0.01, exporter_clock()
        )
        tap_runner, tap_port = await start_site(
            tap_app(config, state.usage, clock=exporter_clock), HOST, 0
        )
        client = HttpClient(f"http://{HOST}:{tap_port}", session_header=session_header)
        try:
            driver = Driver(
                scenario,
                client,
                _NoReporter(),
                clock,
                sim.config.served_model_name,
                wall_clock=exporter_clock,
            )
            stats = await driver.run()
            assert stats.errors == 0 and stats.requests > 0
        finally:
            await client.close()
            await tap_runner.cleanup()
            await sim_runner.cleanup()
        assert state.usage.events.get("tap") == stats.requests
        return generate_text(build_registry(state)).decode()

    return run_virtual(main())


class _NoReporter:
    """The tap records the traffic: the driver reports nothing itself."""

    def report(self, event: dict[str, object]) -> None:
        pass

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def fanout_through_tap() -> str:
    return play_through_tap("fanout-order")


def test_fanout_order_through_the_tap_is_order(fanout_through_tap):
    """The tap sees the prompts: the task-first fan-out's shared text sits behind each
    agent's task, so what it loses is order; the shared-first fan-out loses nothing to it."""
    text = fanout_through_tap
    counts = missed(text, "fanout-task-first")
    avoidable = sum(counts.values()) - counts[GRANULE]
    share = counts[ORDER] / avoidable
    print(f"fanout-order through the tap, fanout-task-first: {counts}; order {share:.1%}")
    assert share > 0.5, counts
    assert counts[EVICTED] == 0
    assert sum(counts.values()) == uncached(text, "fanout-task-first")
    shared_first = missed(text, "fanout-shared-first")
    print(f"fanout-order through the tap, fanout-shared-first: {shared_first}")
    assert shared_first[ORDER] == shared_first[EVICTED] == 0
    assert sum(shared_first.values()) == uncached(text, "fanout-shared-first")
    # each member its own session: what is not order is its first read, never evicted
    assert {cause for cause, count in counts.items() if count} <= {ORDER, NEW, GRANULE}


def test_two_agents_collapse_through_the_tap_is_evicted():
    """Through the tap, with each conversation named in X-Session-Id as the simulator's
    clients do: agent-a's turns are judged against its own previous one, and most of what it
    missed over the run (its first read and the time alone included) is evicted."""
    text = play_through_tap("two-agents-collapse")
    counts = missed(text, "agent-a")
    print(f"two-agents-collapse through the tap, agent-a: {counts}")
    assert sum(counts.values()) == uncached(text, "agent-a")
    assert counts[EVICTED] > 0.5 * sum(counts.values()), counts
    assert counts[UNKNOWN] == 0


def test_two_agents_collapse_through_the_tap_without_sessions_is_unknown():
    """Clients that name no conversation: through the tap each agent's turns share one key
    per caller, whose "previous turn" may not be theirs. The collapse is then the reader's
    unknown (send a session id to name it), never new, and never taken for an eviction it
    cannot prove."""
    text = play_through_tap("two-agents-collapse", session_header="X-Not-The-Taps")
    for caller in ("agent-a", "agent-b"):
        counts = missed(text, caller)
        print(f"two-agents-collapse through the tap, no sessions, {caller}: {counts}")
        assert sum(counts.values()) == uncached(text, caller)
        assert {cause for cause, count in counts.items() if count} == {UNKNOWN, GRANULE}
        assert counts[UNKNOWN] > 0.9 * sum(counts.values())
