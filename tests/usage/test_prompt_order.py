"""The prompt-order memory and work are bounded: per (caller, model), in total, and per
request, filled to the worst case and measured; the digests depend on the process's key."""

from __future__ import annotations

import random
import re
import tracemalloc
from array import array
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.signals.order import (
    MAX_PRINTS,
    PRINTS_PER_PAIR,
    OrderTracker,
    common_prefix,
    compare,
)
from exporter.usage.tap.fingerprint import (
    ANCHORS,
    MAX_BLOCK_BYTES,
    MIN_BLOCK_BYTES,
    block_ends,
    fingerprint,
)
from exporter.values import PromptPrint

LIMITS = (Path(__file__).resolve().parents[2] / "docs" / "limits.md").read_text("utf-8")
KEY = bytes(16)
CAP = 32 * 1024  # --tap.prompt-order-bytes default


def worst_prompt(seed: int, size: int = CAP + 4 * MIN_BLOCK_BYTES) -> bytes:
    """An anchor exactly every MIN_BLOCK_BYTES: the most blocks a prompt can be cut into."""
    rng = random.Random(seed)
    letters = bytes.maketrans(bytes(range(256)), bytes(b"abcdefghij"[i % 10] for i in range(256)))
    piece = MIN_BLOCK_BYTES - 1
    return b"".join(
        rng.randbytes(piece).translate(letters) + b"." for _ in range(size // MIN_BLOCK_BYTES)
    )


def documented_kib(what: str) -> int:
    """'at most **N KiB** WHAT' as docs/limits.md states it."""
    match = re.search(r"at most \*\*([\d,]+) KiB\*\* " + re.escape(what), LIMITS)
    assert match, f"docs/limits.md states no bound for {what}"
    return int(match.group(1).replace(",", ""))


def test_a_print_holds_at_most_cap_over_min_block_blocks():
    body = worst_prompt(1)
    prompt = fingerprint(body, KEY, CAP)
    assert len(prompt.digests) == CAP // MIN_BLOCK_BYTES
    assert prompt.covered == CAP and prompt.length == len(body)


def test_a_400_kb_prompt_is_read_only_to_the_cap():
    body = b'{"prompt":"' + b"x" * 400_000 + b'"}'
    prompt = fingerprint(body[10:-1], KEY, CAP)
    assert prompt.covered == CAP
    assert len(prompt.digests) == CAP // MAX_BLOCK_BYTES  # no anchor: cut every max block
    assert prompt.length == 400_002


def test_memory_per_pair_and_in_total_stays_within_the_documented_bounds():
    """Each request's print is a new one made inside the measurement, as the tap makes one
    per request: what is measured is what the tracker keeps alive."""
    bodies = [worst_prompt(seed) for seed in range(12)]
    made = [fingerprint(body, KEY, CAP) for body in bodies]

    def print_of(index: int) -> PromptPrint:
        model = made[index % len(made)]
        return PromptPrint(array("Q", model.digests), array("I", model.ends), model.length)

    tracemalloc.start()
    try:
        tracker = OrderTracker()
        start = tracemalloc.get_traced_memory()[0]
        for index in range(PRINTS_PER_PAIR + 3):  # past the per-pair bound
            tracker.observe("one pair", print_of(index), 1000.0)
        per_pair = tracemalloc.get_traced_memory()[0] - start
        assert tracker.prints == PRINTS_PER_PAIR
        for pair in range(MAX_PRINTS // PRINTS_PER_PAIR + 8):  # past the total bound
            for index in range(PRINTS_PER_PAIR):
                tracker.observe(pair, print_of(pair + index), 1000.0)
        total = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert tracker.prints == MAX_PRINTS
    assert per_pair <= documented_kib("per (caller, model)") * 1024
    assert total <= documented_kib("in all") * 1024
    assert total >= 0.75 * documented_kib("in all") * 1024  # the fill did reach the bound


def test_prints_are_forgotten_past_the_window():
    body = worst_prompt(3)
    prompt = fingerprint(body, KEY, CAP)
    tracker = OrderTracker(window_seconds=60)
    assert tracker.observe("p", prompt, 1000.0) is None
    assert tracker.observe("p", prompt, 1061.0) is None  # the first one is gone
    found = tracker.observe("p", prompt, 1100.0)
    assert found is not None and found.prefix_bytes == prompt.covered
    assert tracker.prints == 2


def test_digests_depend_on_the_key():
    body = worst_prompt(4)
    mine = fingerprint(body, KEY, CAP)
    theirs = fingerprint(body, bytes(range(16)), CAP)
    assert set(mine.digests).isdisjoint(theirs.digests)
    assert list(mine.ends) == list(theirs.ends)  # blocks are cut by content, not by key
    assert compare(mine, theirs).shared_bytes == 0


def synthetic(digests: list[int], block: int = 600) -> PromptPrint:
    ends = array("I", range(block, block * (len(digests) + 1), block))
    return PromptPrint(array("Q", digests), ends, block * len(digests))


def test_a_request_is_judged_against_the_recent_one_it_shares_most_and_longest_with():
    """A fan-out member whose shared text comes first is silent even when an earlier
    request held the same blocks behind another top; the one behind another top, against
    requests that only share that text, is counted."""
    shared = list(range(100, 110))
    good = synthetic([*shared, 1])
    tracker = OrderTracker()
    tracker.observe("p", synthetic([7, *shared]), 1000.0)  # the same text, another top
    tracker.observe("p", synthetic([*shared, 2]), 1001.0)  # the same text first
    found = tracker.observe("p", good, 1002.0)
    assert found is not None and not found.variable_top
    assert found.prefix_bytes == found.shared_bytes == 10 * 600
    assert found.first_difference_bytes == 11 * 600

    tracker = OrderTracker()
    tracker.observe("q", synthetic([7, *shared]), 1000.0)
    found = tracker.observe("q", synthetic([8, *shared]), 1001.0)
    assert found is not None and found.variable_top
    assert (found.shared_bytes, found.prefix_bytes, found.first_difference_bytes) == (
        10 * 600,
        0,
        600,
    )


def test_the_common_prefix_is_found_to_the_block():
    digests = array("Q", range(64))
    for length in (0, 1, 31, 63, 64):
        other = array("Q", [*range(length), *(1000 + index for index in range(64 - length))])
        assert common_prefix(digests, other) == length
    assert common_prefix(digests, array("Q", range(10))) == 10


def block_ends_by_definition(data: bytes) -> list[int]:
    """The cut as documented, written plainly: each block ends after the first anchor that
    ends MIN_BLOCK_BYTES or more after its start, else MAX_BLOCK_BYTES after it."""
    ends = []
    start = 0
    while len(data) - start > MIN_BLOCK_BYTES:
        end = min(start + MAX_BLOCK_BYTES, len(data))
        for at in range(start + MIN_BLOCK_BYTES - 1, end):
            if data[at : at + 1] in ANCHORS:
                end = at + 1
                break
        ends.append(end)
        start = end
    if start < len(data):
        ends.append(len(data))
    return ends


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([*ANCHORS, b"x"]), st.integers(0, 2600)), max_size=40))
def test_blocks_are_cut_as_documented(runs: list[tuple[bytes, int]]) -> None:
    """Anchors dense, sparse, missing for a while or altogether: the cut that remembers
    where each anchor is next is the plain one."""
    data = b"".join(b"a" * length + anchor for anchor, length in runs)
    assert block_ends(data) == block_ends_by_definition(data)


def test_equal_blocks_have_equal_digests_and_others_differ():
    one, other = worst_prompt(5), worst_prompt(6)
    first, again = fingerprint(one, KEY, CAP), fingerprint(one, KEY, CAP)
    assert (first.digests, first.ends) == (again.digests, again.ends)
    spliced = fingerprint(one[:MIN_BLOCK_BYTES] + other[MIN_BLOCK_BYTES:], KEY, CAP)
    assert spliced.digests[0] == first.digests[0]
    assert set(spliced.digests[1:]).isdisjoint(first.digests)


def test_the_interpreter_hashes_bytes_with_a_keyed_siphash():
    """The digests are Python's own bytes hash: keyed SipHash on every build the image and
    CI run (CPython's default since 3.4), never the unkeyed FNV some odd builds choose."""
    import sys

    assert sys.hash_info.algorithm.startswith("siphash")
    assert sys.hash_info.hash_bits == 64
