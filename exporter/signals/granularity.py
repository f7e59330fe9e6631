"""Learn a model's cache granularity from the cached counts its responses report.

vLLM only ever reports whole granules as cached (every count a hybrid Qwen3.8 returned was a
multiple of 2,048; the CPU build's are multiples of 32; real hybrid models on vLLM 0.32 gave
2,048, 384 and 640), so the greatest common divisor of the non-zero counts converges on the
granule, usually within a handful of requests. Granules are whatever vLLM sized them to, not
powers of two. A sliding window (the last 64 to 128 samples) lets it follow a reconfigured
engine, and the value is only adopted once the gcd has held for ``min_agreeing`` samples and
is at least ``min_granularity`` tokens: a couple of coincidental multiples (4,096 and 8,192)
must not pass for the granule, and a gcd that collapses to a few tokens means the counts are
not block-aligned at all (another engine, or a proxy that rewrites usage), in which case the
configured or block-size value is better.

One stray count must not undo what the rest agree on (a proxy that once reports a count of
its own, a request served elsewhere under the same model name): a count that breaks an
adopted gcd is set aside, once per window; a second one within the window is folded in with
it (the counts really changed, or are not aligned). Before anything is adopted, a count that
would collapse the gcd below ``min_granularity`` is set aside the same way when the other
counts of the window still agree on a granule.
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
    # A count left out of ``gcd`` since it was last computed over the whole window (0: none).
    stray: int = 0


class GranularityLearner:
    def __init__(
        self,
        window: int = DEFAULT_WINDOW,
        min_agreeing: int = DEFAULT_MIN_AGREEING,
        min_granularity: int = DEFAULT_MIN_GRANULARITY,
    ) -> None:
        self.window = window
        self.min_agreeing = min_agreeing
        self.min_granularity = min_granularity
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
            samples.window.append(cached_tokens)
            samples.since_full_gcd += 1
            samples.agreeing += 1
            samples.quick_left -= 1
            return
        window = samples.window
        window.append(cached_tokens)
        samples.since_full_gcd += 1
        gcd, stray = samples.gcd, samples.stray
        agrees = True
        # A new sample can only lower the gcd, so it is folded in cheaply; samples leaving the
        # window can raise it, so once the window has turned over the gcd is recomputed over
        # it. The learned value thus reflects the last ``window`` to ``2 * window`` samples.
        if samples.since_full_gcd >= self.window:
            gcd, stray = self._robust_gcd(window)
            samples.since_full_gcd = 0
        elif gcd and cached_tokens % gcd == 0:
            pass  # the common case, while it is not open yet: the gcd holds
        elif not stray and gcd >= self.min_granularity and samples.agreeing >= self.min_agreeing:
            stray, agrees = cached_tokens, False  # set aside: the adopted gcd holds
        else:  # a second stray, or nothing adopted yet: fold it in (and any set aside)
            gcd, stray = math.gcd(gcd, stray, cached_tokens), 0
            if gcd < self.min_granularity:
                gcd, stray = self._robust_gcd(window)
        samples.stray = stray
        if gcd != samples.gcd:
            samples.gcd = gcd
            samples.agreeing = 1
        elif agrees:
            samples.agreeing += 1
        # The common case is open while the sample after next still falls before the window
        # turns over (``since_full_gcd`` reaching ``window``).
        samples.quick_left = (
            max(0, self.window - 1 - samples.since_full_gcd)
            if samples.agreeing >= self.min_agreeing and gcd
            else 0
        )
        if samples.agreeing >= self.min_agreeing and gcd >= self.min_granularity:
            self.learned_by_model[model] = gcd
        else:
            self.learned_by_model.pop(model, None)

    def _robust_gcd(self, window: deque[int]) -> tuple[int, int]:
        """(gcd, count left out) of a window: the gcd of every count, unless one count alone
        brings it under ``min_granularity`` while the others agree on at least that; then the
        gcd of the others, and that count."""
        counts = list(window)
        whole = math.gcd(*counts)
        if whole >= self.min_granularity or len(counts) < 2:
            return whole, 0
        # gcd of all but one, for each one: prefix and suffix gcds, one pass each way.
        prefix = [0] * (len(counts) + 1)
        for index, count in enumerate(counts):
            prefix[index + 1] = math.gcd(prefix[index], count)
        suffix = 0
        best, left_out = whole, 0
        for index in range(len(counts) - 1, -1, -1):
            others = math.gcd(prefix[index], suffix)
            if others > best:
                best, left_out = others, counts[index]
            suffix = math.gcd(suffix, counts[index])
        if best < self.min_granularity:
            return whole, 0
        return best, left_out

    def provisional(self, model: str) -> int:
        """G for a request while nothing better is known (not exported): the coarsest granule
        every count of this model seen so far is a whole number of (their gcd, this request's
        included), else 1. It errs towards a coarser G, a lenient "warm", and narrows to the
        granule as counts arrive; G = 1 would call every full hit on a block-aligned cache
        "partial"."""
        samples = self.samples_by_model.get(model)
        if samples is None or samples.gcd < self.min_granularity:
            return 1
        return samples.gcd

    def learned(self, model: str) -> int | None:
        """The adopted granularity for ``model``, or None while there is no agreement."""
        return self.learned_by_model.get(model)
