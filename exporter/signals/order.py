"""Prompt order: requests that share most of their text but not its beginning.

vLLM's prefix cache reuses a prompt from its first token only. A fan-out whose agents put
the shared text first gets it from the cache for every agent after the first; the same text
behind a per-agent part, or behind a timestamp, is read again by each one ("one varying
character at position zero throws the whole thing away"). Nothing in the hit ratio says
why; the prompts do. The tap hands each request's ``PromptPrint`` (keyed digests of its
blocks, never text), and this module compares it with the recent prints of the same caller
and model:

- the common prefix: the leading run of equal block digests (blocks are cut from the
  start by content, so equal leading blocks mean equal leading text), in bytes;
- the shared text: the bytes of the blocks the two prints have in common, wherever they sit.

A request *shares text but not its beginning* when the recent print sharing most with it
(the most blocks in common, then the longest common prefix) shares at least
``MIN_SHARED_BYTES`` and ``SHARED_FRACTION`` of what was fingerprinted, and the common
prefix covers less than ``PREFIX_FRACTION`` of that shared text. The first difference is
where the first differing block ends: the variable part sits before it.
A good layout (shared text first) and unrelated prompts are both silent.

Bounded: ``PRINTS_PER_PAIR`` prints per (caller, model) label pair, none older than the
window, ``MAX_PRINTS`` in all (the least recently used pair gives up its oldest first). A
print holds at most ``max_bytes / MIN_BLOCK_BYTES`` blocks of 12 bytes each. Pure: times are
handed in.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass

from exporter.values import PromptPrint

DEFAULT_WINDOW_SECONDS = 300.0
# Recent requests of one (caller, model) a request is compared with: a fan-out's width and
# then some.
PRINTS_PER_PAIR = 8
# Prints kept in all, whatever the number of pairs.
MAX_PRINTS = 1024
# "Shares most of its text": at least this much, in bytes of the prompt as sent (about a
# KV block of a large-block model, and far more than a common greeting), ...
MIN_SHARED_BYTES = 1024
# ... and at least this share of what was fingerprinted.
SHARED_FRACTION = 0.5
# "But not its beginning": the common prefix covers less than this share of the shared text.
PREFIX_FRACTION = 0.5


@dataclass(frozen=True)
class Comparison:
    """A request against the recent print that shares most with it (bytes)."""

    shared_bytes: int
    prefix_bytes: int
    first_difference_bytes: int  # the end of the first block that differs
    covered_bytes: int  # what the request's print covers

    @property
    def variable_top(self) -> bool:
        """Shares most of its text with a recent request, but not its beginning."""
        return (
            self.shared_bytes >= MIN_SHARED_BYTES
            and self.shared_bytes >= SHARED_FRACTION * self.covered_bytes
            and self.prefix_bytes < PREFIX_FRACTION * self.shared_bytes
        )


def compare(new: PromptPrint, old: PromptPrint) -> Comparison:
    """``new`` against ``old``. The shared bytes are counted over ``old``'s blocks: a block
    found in both is the same bytes, so of the same length."""
    return _measure(new, old, set(new.digests), common_prefix(new.digests, old.digests))


def common_prefix(mine: array, theirs: array) -> int:
    """How many leading digests two prints have in common: a binary search over slices, so
    the comparisons run in C, a few per print whatever its length."""
    low, high = 0, min(len(mine), len(theirs))
    if mine[:high] == theirs[:high]:
        return high
    while high - low > 1:  # mine[:low] equal, mine[:high] not
        middle = (low + high) // 2
        if mine[:middle] == theirs[:middle]:
            low = middle
        else:
            high = middle
    return low


def _measure(new: PromptPrint, old: PromptPrint, found: set[int], prefix_blocks: int) -> Comparison:
    shared = 0
    start = 0
    for digest, end in zip(old.digests, old.ends, strict=True):
        if digest in found:
            shared += end - start
        start = end
    ends = new.ends
    prefix = ends[prefix_blocks - 1] if prefix_blocks else 0
    first_difference = ends[prefix_blocks] if prefix_blocks < len(ends) else prefix
    return Comparison(min(shared, new.covered), prefix, first_difference, new.covered)


@dataclass(slots=True)
class _Kept:
    when: float
    print: PromptPrint


class OrderTracker:
    """The recent prints per (caller, model) label pair, and the comparison of each new one."""

    def __init__(
        self,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        per_pair: int = PRINTS_PER_PAIR,
        max_prints: int = MAX_PRINTS,
    ) -> None:
        self.window_seconds = window_seconds
        self.per_pair = max(1, per_pair)
        self.max_prints = max(1, max_prints)
        self._pairs: OrderedDict[Hashable, deque[_Kept]] = OrderedDict()
        self.prints = 0

    def observe(self, pair: Hashable, prompt: PromptPrint, when: float) -> Comparison | None:
        """Compare the request with the recent ones of its (caller, model) label pair (one
        key per pair: the caller hands in the same object for the same pair); None when
        there is nothing recent to compare with. Then keep its print."""
        kept = self._pairs.get(pair)
        if kept is None:
            kept = self._pairs[pair] = deque()
        else:
            self._pairs.move_to_end(pair)
        horizon = when - self.window_seconds
        while kept and kept[0].when < horizon:
            kept.popleft()
            self.prints -= 1
        best: Comparison | None = None
        if prompt.ends:
            best = self._best(prompt, kept, when)
        kept.append(_Kept(when, prompt))
        self.prints += 1
        if len(kept) > self.per_pair:
            kept.popleft()
            self.prints -= 1
        self._bound()
        return best

    def _best(self, prompt: PromptPrint, kept: deque[_Kept], when: float) -> Comparison | None:
        """The comparison with the recent print sharing the most blocks (then the longest
        common prefix): candidates ranked by C-level set and slice operations, the bytes
        measured for the chosen one only."""
        digests = set(prompt.digests)
        chosen: tuple[int, int, PromptPrint] | None = None
        for other in kept:
            if abs(other.when - when) > self.window_seconds:
                continue  # out-of-order times: too far apart all the same
            theirs = other.print.digests
            rank = (len(digests.intersection(theirs)), common_prefix(prompt.digests, theirs))
            if chosen is None or rank > chosen[:2]:
                chosen = (*rank, other.print)
        if chosen is None:
            return None
        return _measure(prompt, chosen[2], digests, chosen[1])

    def _bound(self) -> None:
        while self.prints > self.max_prints:
            pair, oldest = next(iter(self._pairs.items()))
            oldest.popleft()
            self.prints -= 1
            if not oldest:
                del self._pairs[pair]

    @property
    def pairs(self) -> int:
        return len(self._pairs)
