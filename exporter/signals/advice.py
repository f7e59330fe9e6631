"""The foresight signals in plain words: one source for every sentence ``check``, the status
page and the demo say about pool fit, admission budgets and declared completions.

Pure: numbers in, sentences out. The numbers come from wherever the caller read them (a
vLLM's /metrics, an exporter's /metrics, the signals state), so the advice is the same
whichever surface shows it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# A caller whose declared max_tokens is at least this many times its median use is told so.
OVERSTATEMENT_WORTH_SAYING = 4.0


def tokens(count: float) -> str:
    return f"{count:,.0f}"


def pool_sentence(pool_tokens: int, smallest_pool_tokens: int, smallest_source: str,
                  headroom_tokens: int, budget_tokens: int) -> str:
    """The pool, the smallest one known, and the admission budget derived from it."""
    if smallest_pool_tokens < pool_tokens:
        smallest = (f"the smallest seen {smallest_source} is {tokens(smallest_pool_tokens)}, "
                    "and budgets go by the smallest")
    else:
        smallest = (f"the smallest known ({smallest_source}); read it over several boots, it "
                    "moves with free GPU memory")
    return (f"KV pool {tokens(pool_tokens)} tokens, {smallest}. Admission budget: "
            f"{tokens(budget_tokens)} tokens (gate by tokens, not requests: "
            f"max_concurrent_tokens {tokens(budget_tokens)}, {tokens(headroom_tokens)} under "
            f"the smallest pool).")


@dataclass(frozen=True)
class Fit:
    """Live conversations on one vLLM against its pool."""

    conversations: int
    demand_tokens: int
    pool_tokens: int
    headroom_tokens: int

    @property
    def ratio(self) -> float:
        return self.demand_tokens / self.pool_tokens if self.pool_tokens > 0 else math.inf

    @property
    def overflows(self) -> bool:
        """They cannot all stay cached: the condition of VllmCacheConversationsExceedKVPool."""
        return (self.conversations >= 2
                and self.demand_tokens > self.pool_tokens - self.headroom_tokens)


def fit_sentence(fit: Fit, idle_seconds: float | None = None) -> str:
    window = f" (a turn within {idle_seconds / 60:g} min)" if idle_seconds else ""
    head = (f"{fit.conversations} conversation(s) active{window} need "
            f"{tokens(fit.demand_tokens)} tokens of KV cache: {fit.ratio:.1%} of the "
            f"{tokens(fit.pool_tokens)}-token pool.")
    if fit.overflows:
        return (f"{head} They do not all fit: each turn will evict another conversation's "
                "prefix and the hit ratio will collapse. Gate admission by tokens or let "
                "fewer conversations share this engine.")
    if fit.conversations >= 2:
        room = fit.pool_tokens - fit.headroom_tokens - fit.demand_tokens
        return f"{head} They fit, with {tokens(room)} tokens to spare past the headroom."
    return f"{head} One conversation alone cannot be evicted by another."


@dataclass(frozen=True)
class Completions:
    """What one caller declared as max_tokens and what it used (tokens)."""

    caller: str
    model: str
    requests: int
    declared_mean: float
    used_p50: float
    used_p99: float

    @property
    def overstatement(self) -> float:
        return self.declared_mean / self.used_p50 if self.used_p50 > 0 else math.inf

    @property
    def advised_charge(self) -> int:
        """What an admission gate should charge for the completion: the used p99, never more
        than declared (rounded up to a whole 256 tokens)."""
        return min(int(self.declared_mean), int(math.ceil(self.used_p99 / 256.0)) * 256)


def completion_sentence(figures: Completions) -> str:
    head = (f"{figures.caller} on {figures.model}: {figures.requests} request(s) declared "
            f"max_tokens {tokens(figures.declared_mean)} on average and used "
            f"{tokens(figures.used_p50)} at the median, {tokens(figures.used_p99)} at p99")
    if figures.overstatement >= OVERSTATEMENT_WORTH_SAYING:
        return (f"{head}: a {figures.overstatement:.0f}x overstatement. An admission gate "
                f"that charges the declared figure holds a fraction of the conversations "
                f"it could: charge prompt + min(max_tokens, "
                f"{tokens(figures.advised_charge)}) instead.")
    return f"{head}: declared and used agree well enough to charge the declared figure."


def histogram_quantile(quantile: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets, the last
    one +Inf: linear within the bucket the rank falls in, the largest finite bound past it.
    NaN without observations."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return math.nan
    rank = quantile * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
