"""Learn a model's cache granularity from the cached counts its responses report.

vLLM only ever reports whole granules as cached (every count a hybrid Qwen3.8 returned was a
multiple of 2,048; the CPU build's are multiples of 32), so the greatest common divisor of
the non-zero counts converges on the granule, usually within a handful of requests. A
sliding window (the last 64 to 128 samples) lets it follow a reconfigured engine, and the
value is only adopted once the gcd has held for ``min_agreeing`` samples and is at least
``min_granularity`` tokens: a couple of coincidental multiples (4,096 and 8,192) must not
pass for the granule, and a gcd that collapses to a few tokens means the counts are not
block-aligned at all (another engine, or a proxy that rewrites usage), in which case the
configured or block-size value is better.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

DEFAULT_WINDOW = 64
DEFAULT_MIN_AGREEING = 8
DEFAULT_MIN_GRANULARITY = 16


@dataclass(slots=True)
class ModelSamples:
    window: deque[int]
    gcd: int = 0
    agreeing: int = 0  # consecutive samples over which ``gcd`` did not change
    since_full_gcd: int = 0  # samples since the gcd was last computed over the whole window
    # How many more samples may take the common case (a multiple of ``gcd`` once it has held
    # for ``min_agreeing``: nothing changes but the counts) before the window has turned
    # over; 0 while the gcd has not held long enough.
    quick_left: int = 0

    def take_quickly(self, cached_tokens: int) -> None:
        """The common case of ``GranularityLearner.observe`` (``quick_left`` and the gcd
        dividing ``cached_tokens`` checked by the caller)."""
        self.window.append(cached_tokens)
        self.since_full_gcd += 1
        self.agreeing += 1
        self.quick_left -= 1


class GranularityLearner:
    def __init__(self, window: int = DEFAULT_WINDOW, min_agreeing: int = DEFAULT_MIN_AGREEING,
                 min_granularity: int = DEFAULT_MIN_GRANULARITY) -> None:
        self.window = window
        self.min_agreeing = min_agreeing
        self.min_granularity = min_granularity
        # Read directly by UsageState.record_rows on the hot path, which takes the common
        # case itself (``ModelSamples.quick_left``).
        self.samples_by_model: dict[str, ModelSamples] = {}
        self.learned_by_model: dict[str, int] = {}

    def observe(self, model: str, cached_tokens: int) -> None:
        """Fold in one reported cached count (zeros carry no information and are skipped)."""
        if cached_tokens <= 0:
            return
        samples = self.samples_by_model.get(model)
        if samples is None:
            samples = self.samples_by_model[model] = ModelSamples(deque(maxlen=self.window))
        if samples.quick_left and cached_tokens % samples.gcd == 0:
            # The common case once learned: the sample keeps the gcd, which stays adopted
            # (or stays too small to adopt) as it was.
            samples.take_quickly(cached_tokens)
            return
        window = samples.window
        window.append(cached_tokens)
        samples.since_full_gcd += 1
        # A new sample can only lower the gcd, so it is folded in cheaply; samples leaving the
        # window can raise it, so once the window has turned over the gcd is recomputed over
        # it. The learned value thus reflects the last ``window`` to ``2 * window`` samples.
        if samples.since_full_gcd >= self.window:
            gcd = math.gcd(*window)
            samples.since_full_gcd = 0
        else:
            gcd = math.gcd(samples.gcd, cached_tokens)
        if gcd == samples.gcd:
            samples.agreeing += 1
        else:
            samples.gcd = gcd
            samples.agreeing = 1
        # The common case is open while the sample after next still falls before the window
        # turns over (``since_full_gcd`` reaching ``window``).
        samples.quick_left = max(0, self.window - 1 - samples.since_full_gcd) \
            if samples.agreeing >= self.min_agreeing and gcd else 0
        if samples.agreeing >= self.min_agreeing and gcd >= self.min_granularity:
            self.learned_by_model[model] = gcd
        else:
            self.learned_by_model.pop(model, None)

    def learned(self, model: str) -> int | None:
        """The adopted granularity for ``model``, or None while there is no agreement."""
        return self.learned_by_model.get(model)


# vLLM's block sizes are powers of two (16 and 32 dense, 2,048 on hybrid align mode), so
# until G is known from any source the largest power of two dividing this request's own cached
# count, capped at the largest common hybrid block, is the best single-request estimate.
PROVISIONAL_MAX = 2048


def provisional_granularity(cached_tokens: int | None) -> int:
    """G for one request while nothing better is known (not exported, not learned from).

    A cached count is a whole number of granules, so G divides it; taking the largest
    power-of-two divisor errs towards a coarser G (a lenient "warm") only when the count
    happens to be a multiple of a larger power of two, where G = 1 would call every full
    hit on a block-aligned cache "partial".
    """
    if not cached_tokens or cached_tokens < 0:
        return 1
    return min(cached_tokens & -cached_tokens, PROVISIONAL_MAX)
