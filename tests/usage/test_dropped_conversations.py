"""Issue 32, "ten thousand callers": more live conversations than --signals.conversations-max.

A conversation the bound drops loses its previous turn. Its next turn was judged as a first
one, so a warm follow-up whose new tokens pass the warm tail read as partial (46% of true warm
turns on a platform of 20,000 live conversations at 10,000). Now the drop is counted, its
next turn is ``unknown`` (its tokens still counted), and the default holds such a platform;
what a conversation and a dropped one's fingerprint cost is measured against docs/limits.md.
"""

from __future__ import annotations

import gc
import math
import re
import tracemalloc
import uuid
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.metrics import build_registry
from exporter.signals.classify import COLD, PARTIAL, STATES, UNKNOWN, WARM, classify
from exporter.signals.foresight import (
    DEFAULT_MAX_CONVERSATIONS,
    ConversationTracker,
    ForesightSettings,
    conversation_key,
)
from exporter.values import RecentKeys, UsageEvent
from tests.usage.conftest import FakeClock, make_state, value

LIMITS = (Path(__file__).resolve().parents[2] / "docs" / "limits.md").read_text("utf-8")
G = 16  # --signals.granularity: the rule's arithmetic below is in granules of 16
FIRST, NEW_TOKENS = 10_000, 3_000  # a turn adds 3,000 tokens: past the warm tail (2 x 16)


def cached_after(prompt: int) -> int:
    """What a warm follow-up of a turn of ``prompt`` tokens finds cached: every whole granule
    of it, its last token excluded."""
    return (prompt - 1) // G * G


def turn(name: str, number: int, cached: int | None = None, **fields: object) -> UsageEvent:
    """Turn ``number`` (0: the first) of conversation ``name``: each one 3,000 tokens longer,
    finding the previous one cached (warm) unless told otherwise."""
    prompt = FIRST + number * NEW_TOKENS
    if cached is None:
        cached = cached_after(prompt - NEW_TOKENS) if number else 0
    return UsageEvent("agent", "qwen", prompt, cached, 300, session=name, **fields)  # type: ignore[arg-type]


def totals(state) -> dict[str, float]:  # type: ignore[no-untyped-def]
    registry = build_registry(state)
    labels = {"caller": "agent", "model": "qwen"}
    out = {
        name: value(registry, f"vllm_cache_{name}_total", **labels)
        for name in ("prompt_tokens", "cached_tokens")
    }
    for state_name in STATES:
        out[state_name] = value(registry, "vllm_cache_requests_total", state=state_name, **labels)
    for name in ("conversations_dropped", "dropped_conversation_turns"):
        out[name] = value(registry, f"vllm_cache_{name}_total")
    out["turns"] = value(registry, "vllm_cache_conversation_turns_total", model="qwen")
    out["unseen"] = value(registry, "vllm_cache_unseen_history_requests_total", model="qwen")
    out["active"] = value(registry, "vllm_cache_conversations_active", model="qwen")
    return out


def test_the_rule_misreads_a_warm_follow_up_taken_for_a_first_turn():
    """Why a dropped conversation's next turn cannot be judged: the same turn is warm after
    its previous one and partial as a first turn."""
    follow_up = turn("s", 2)
    previous = FIRST + NEW_TOKENS
    assert classify(follow_up.prompt_tokens, follow_up.cached_tokens, G, previous) == WARM
    assert classify(follow_up.prompt_tokens, follow_up.cached_tokens, G) == PARTIAL


def test_dropped_active_conversations_are_counted_and_their_next_turns_are_unknown():
    cap, extra = 50, 20
    state = make_state(signals_granularity=G, signals_conversations_max=cap)
    usage = state.usage
    names = [f"s{index}" for index in range(cap + extra)]
    for name in names:  # each active (a warm follow-up), then the next one's turn
        assert usage.record(turn(name, 0), "http") == COLD
        assert usage.record(turn(name, 1), "http") == WARM
    before = totals(state)
    assert len(usage.conversations) == cap
    assert before["conversations_dropped"] == extra  # the first `extra`, all active
    assert before["dropped_conversation_turns"] == 0
    assert before[WARM] == cap + extra and before[PARTIAL] == before[UNKNOWN] == 0

    dropped = names[:extra]
    for name in dropped:  # their third turn: warm, but its previous turn is lost
        assert usage.record(turn(name, 2), "http") == UNKNOWN
    after = totals(state)
    assert after["dropped_conversation_turns"] == extra
    assert after[UNKNOWN] == extra
    for state_name in (WARM, PARTIAL, COLD):
        assert after[state_name] == before[state_name], state_name
    # Their tokens count as any turn's: the hit ratio stays exact.
    third = turn("x", 2)
    assert after["prompt_tokens"] - before["prompt_tokens"] == extra * third.prompt_tokens
    assert after["cached_tokens"] - before["cached_tokens"] == extra * third.cached_tokens
    # Not held against a memory the exporter no longer has, nor a follow-up it can judge.
    assert after["turns"] == before["turns"] and after["unseen"] == 0
    assert sum(series.followups for series in usage.series.values()) == cap + extra
    # Not in any TTFT of a classified state either (an unknown one is its own series).
    timed = turn("s0", 3, ttft_seconds=0.5)
    assert usage.record(timed, "http") == WARM  # s0 is known again
    usage.record(turn(names[extra], 2, ttft_seconds=7.0), "http")  # dropped meanwhile
    series = usage.series[("agent", "qwen")]
    assert set(series.ttft) == {WARM, UNKNOWN}
    assert series.ttft[UNKNOWN].total == 7.0 and series.ttft[WARM].total == 0.5
    # Each came back as a conversation: counted as active again (and when dropped again).
    assert totals(state)["active"] == cap

    # A conversation never seen is judged as today: a first turn.
    assert usage.record(turn("new", 0), "http") == COLD
    assert usage.record(turn("new-warm-from-a-shared-prefix", 1), "http") == PARTIAL
    # A turn of a dropped one whose prompt holds no granule is short, as any such turn.
    short = usage.record(UsageEvent("agent", "qwen", 10, 0, session=names[extra + 1]), "http")
    assert short == "short"


def test_with_more_live_conversations_than_the_bound_no_warm_turn_reads_partial():
    """More live conversations than the bound (740 against 500) taking turns in rounds, as
    on the issue's platform: every conversation is dropped before its next turn, most before
    they are active. Up to half the bound more than it, the dropped ones' keys are all
    still held: no warm turn is ever misread, and the drops show."""
    live, cap = 740, 500
    state = make_state(signals_granularity=G, signals_conversations_max=cap)
    usage = state.usage
    for number in range(4):
        for index in range(live):
            usage.record(turn(f"s{index}", number), "http")
    counts = totals(state)
    assert counts[PARTIAL] == 0 and counts[WARM] == 0
    assert counts[COLD] == live  # the first turns
    assert counts[UNKNOWN] == 3 * live == counts["dropped_conversation_turns"]
    # Dropped before their second turn, they were no demand yet (the first round's, and the
    # first `cap` drops of the second); recalled, they are, and their drops count.
    assert counts["conversations_dropped"] == 3 * live - cap
    assert len(usage.conversations.forgotten) <= cap


def test_the_fingerprints_stay_within_their_bound():
    """Filled far past it (a session id per request: none ever comes back), the memory of
    dropped conversations holds at most the bound, and the newest half of it at least."""
    cap = 64
    state = make_state(signals_conversations_max=cap)
    usage = state.usage
    forgotten = usage.conversations.forgotten
    for index in range(20 * cap):
        usage.record(UsageEvent("agent", "qwen", 1_000, 0, session=f"r{index}"), "http")
        assert len(forgotten) <= cap
    assert len(forgotten) >= cap // 2
    assert forgotten.forgotten_early > 0  # it did overflow
    # The newest half of the dropped ones (the newest `cap` are still tracked) is still
    # told apart from new conversations.
    newest_dropped = range(19 * cap - cap // 2, 19 * cap)
    for index in newest_dropped:
        key = conversation_key("agent", "qwen", f"r{index}")
        assert key not in usage.conversations.by_key
        assert forgotten.get(key, 0.0) is not None, index


def test_past_the_fingerprint_bound_a_turn_is_judged_as_a_first_one_again():
    """The fingerprints' overflow, as documented: the oldest half goes, and those
    conversations' next turns are judged as first turns (here: a warm follow-up as partial)."""
    cap = 8
    state = make_state(signals_granularity=G, signals_conversations_max=cap)
    usage = state.usage
    for index in range(cap + 2 * cap):  # 16 dropped: two generations of 4 and more
        usage.record(turn(f"s{index}", 0), "http")
        usage.record(turn(f"s{index}", 1), "http")
    assert usage.record(turn("s0", 2), "http") == PARTIAL  # its key was let go
    assert usage.record(turn(f"s{2 * cap - 1}", 2), "http") == UNKNOWN  # a recent drop


def test_a_conversation_dropped_once_idle_or_ended_by_a_restart_leaves_no_key():
    clock = FakeClock()
    state = make_state(clock, signals_conversations_max=2, signals_conversation_idle=600.0)
    usage = state.usage
    usage.record(turn("idle", 0), "http")
    usage.record(turn("idle", 1), "http")
    clock.now += 601
    usage.record(turn("a", 0), "http")
    usage.record(turn("b", 0), "http")  # drops "idle", no longer live
    assert len(usage.conversations.forgotten) == 0
    assert usage.conversations.dropped_active == 0
    ended = usage.conversations.by_key[conversation_key("agent", "qwen", "a")]
    ended.prompt_tokens, ended.ended = None, True  # what end_on_target does
    usage.record(turn("c", 0), "http")  # drops "a"
    assert len(usage.conversations.forgotten) == 0


def test_the_default_holds_twenty_thousand_live_conversations_without_a_drop():
    """The issue's platform: 20,000 conversations live at once, each taking warm turns in
    rounds. The default bound keeps every one: nothing dropped, every follow-up warm."""
    assert DEFAULT_MAX_CONVERSATIONS >= 100_000
    state = make_state(signals_granularity=G)
    usage = state.usage
    live = 20_000
    sessions = [str(uuid.UUID(int=index)) for index in range(live)]
    for number in range(3):
        for session in sessions:
            usage.record(turn(session, number), "http")
    counts = totals(state)
    assert counts["conversations_dropped"] == counts["dropped_conversation_turns"] == 0
    assert counts[WARM] == 2 * live and counts[PARTIAL] == counts[UNKNOWN] == 0
    assert counts["active"] == live


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, int, list[tuple[int, int, str]]]:
    """(bound, live conversations, turns): within the fingerprints' guarantee (at most half
    the bound more live conversations than it) as often as beyond it (up to three times)."""
    cap = draw(st.integers(2, 24))
    beyond = draw(st.booleans())
    live = cap + draw(st.integers(0, 2 * cap if beyond else cap // 2))
    turn = st.tuples(
        st.integers(0, live - 1),  # which conversation
        st.integers(1, 4_000),  # new tokens
        st.sampled_from(("all", "none", "some")),  # what it found cached
    )
    return cap, live, draw(st.lists(turn, min_size=3 * live, max_size=300))


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_a_turn_is_judged_as_with_unbounded_memory_or_unknown(workload):
    """Against a reference that never forgets: a new conversation's turn gets the
    reference's state; a known one's the reference's or ``unknown``, and while no more than
    half the bound more conversations than it are live, nothing else (beyond, the keys of
    the dropped ones overflow). Tokens are counted exactly; the memory holds its bounds."""
    cap, live, turns = workload
    state = make_state(signals_granularity=G, signals_conversations_max=cap)
    usage = state.usage
    previous: dict[str, int] = {}  # the reference: every conversation's last prompt
    prompt_sum = cached_sum = 0
    unknown = 0
    for which, new_tokens, found in turns:
        name = f"s{which}"
        before = previous.get(name)
        prompt = (before or 0) + new_tokens
        reusable = cached_after(before) if before else cached_after(prompt)
        cached = {"all": reusable, "none": 0, "some": reusable // 2 // G * G}[found]
        expected = classify(prompt, cached, G, before)
        got = usage.record(UsageEvent("agent", "qwen", prompt, cached, session=name), "http")
        if got != expected:
            assert before is not None, "a new conversation is judged as with full memory"
            if got != UNKNOWN:  # a misread: only once the keys of the dropped overflow
                assert live - cap > cap // 2, (name, got, expected)
        unknown += got == UNKNOWN
        previous[name] = prompt
        prompt_sum += prompt
        cached_sum += cached
        assert len(usage.conversations) <= cap
        assert len(usage.conversations.forgotten) <= cap
    # With every cached count reported, only a dropped conversation's turn is unknown (or
    # short, when its own prompt holds no granule).
    assert unknown <= usage.conversations.dropped_turns
    series = usage.series[("agent", "qwen")]
    assert (series.prompt_tokens, series.cached_tokens) == (prompt_sum, cached_sum)


# ---- what it costs --------------------------------------------------------------------------


def documented(what: str, unit: str) -> float:
    """'**N UNIT** WHAT' as docs/limits.md states it."""
    match = re.search(r"\*\*([\d,.]+) " + unit + r"\*\* " + re.escape(what), LIMITS)
    assert match, f"docs/limits.md states no {unit} for {what!r}"
    return float(match.group(1).replace(",", ""))


def fresh(text: str) -> str:
    """A new str object, as the decoder makes one per event."""
    return (text + "!")[:-1]


def names(index: int, longest: bool) -> tuple[str, str, str]:
    """(caller, model, session) of conversation ``index``: realistic (a 36-character UUID
    session), or of the longest form the ingest lets through (256 four-byte characters)."""
    if longest:
        tail = f"{index:08d}"  # among four-byte characters, each is four bytes too
        return (
            fresh("\U0001f600" * 248 + tail),
            fresh("\U0001f916" * 256),
            "\U0001f601" * 248 + tail,
        )
    return (
        fresh(f"team-{index % 300:03d}-agent"),
        fresh(("Qwen/Qwen3-30B-A3B-Instruct-2507", "meta-llama/Llama-3.1-8B")[index % 2]),
        f"{index:08x}-7d3c-4b1a-9f2e-{index:012x}",
    )


def fill(tracker: ConversationTracker, start: int, count: int, longest: bool) -> None:
    """``count`` new active conversations (a first turn and its follow-up), as ``_record``
    keeps them, until the fingerprints would begin a new generation."""
    by_key, forgotten = tracker.by_key, tracker.forgotten
    room = tracker.max_conversations - 1 - tracker.drop_batch
    for index in range(start, start + count):
        if len(by_key) == tracker.max_conversations and len(forgotten) > room:
            break  # one more batch of drops would let the older half of the keys go
        caller, model, session = names(index, longest)
        key = conversation_key(caller, model, session)
        for number in range(2):
            prompt = 20_000 + 3_000 * number + index % 977
            when = 1e9 + index / 1_000  # a new float, as decoded
            event = UsageEvent(caller, model, prompt, 0, 300, session=session, time=when)
            tracker.keep(key, by_key.pop(key, None), event, "qwen", 1e9 + 100)


# Measured at a quarter of the default: dicts grow in powers of two, so a quarter of the
# entries sits in tables a quarter the size, at the same bytes per entry (and 4x faster
# under tracemalloc, which makes every allocation slow).
SCALE = 4


def test_a_conversation_and_a_fingerprint_cost_what_docs_limits_says():
    """Filled with active conversations, then with as many more, which drops every one while
    recent, up to the most fingerprints held at once (the dict grown by the churn too): the
    tracker at its worst. Names of the longest form cost what realistic ones do: the key is
    their hash, the model name is shared."""
    cap = DEFAULT_MAX_CONVERSATIONS // SCALE
    for longest in (False, True):
        gc.collect()
        tracemalloc.start()
        try:
            start = tracemalloc.get_traced_memory()[0]
            tracker = ConversationTracker(ForesightSettings(max_conversations=cap))
            fill(tracker, 0, cap, longest)
            full = tracemalloc.get_traced_memory()[0] - start
            fill(tracker, cap, cap, longest)
            gc.collect()
            worst = tracemalloc.get_traced_memory()[0] - start
        finally:
            tracemalloc.stop()
        assert len(tracker) == cap
        assert len(tracker.forgotten) >= cap - 1 - tracker.drop_batch
        assert tracker.dropped_active == len(tracker.forgotten)
        assert full <= documented("a conversation", "bytes") * cap, (longest, full / cap)
        assert full * SCALE <= documented("at 100,000", "MB") * 1e6
        worst_mb = worst * SCALE / 1e6
        assert worst_mb <= documented("with the conversations", "MB"), (longest, worst_mb)


def test_a_fingerprint_costs_what_docs_limits_says():
    cap = DEFAULT_MAX_CONVERSATIONS // SCALE
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        forgotten = RecentKeys(cap, math.inf)  # what ConversationTracker keeps them in
        for index in range(cap):
            forgotten.put(conversation_key(*names(index, False)), True, 1e9)
        used = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert len(forgotten) == cap
    assert used <= documented("each", "bytes") * cap, used / cap
    assert used * SCALE <= documented("at 100,000 in all", "MB") * 1e6
