"""Warm / partial / cold / short per request, aware of the cache's block boundaries.

A flat "hit ratio above 90%" bar misjudges real traffic: vLLM caches whole granules (blocks
of 16-32 tokens on dense models; on hybrid models, where the recurrent state is only
checkpointed at block boundaries, whatever block vLLM sized to hold one state page: 2,048,
384, 640, ~800, no power of two implied), never caches the last prompt token, and a warm
turn of a conversation re-reads its new tokens plus the tail granule of the previous turn.
So the bar is set per request, from what that request *could* have reused:

    n = prompt_tokens, c = cached_tokens, G = granularity, K = warm tail granules
    R = floor((n - 1) / G) * G                      (whole granules, last token excluded)
    if the previous turn p of the same conversation is known and p < n:
        R = min(R, floor((p - 1) / G) * G)         (only the previous turn can be cached)
    R = max(R, c)                                   (never below what was actually cached)
    R < G           -> short   (nothing reusable; never a cache failure)
    c unknown       -> unknown
    c == 0          -> cold
    c >= R - K * G  -> warm
    otherwise       -> partial

See docs/metrics.md for the worked cases and why K defaults to 2.
"""

from __future__ import annotations

WARM = "warm"
PARTIAL = "partial"
COLD = "cold"
SHORT = "short"
UNKNOWN = "unknown"
ERROR = "error"
# Every value of the ``state`` label, in exposition order.
STATES = (WARM, PARTIAL, COLD, SHORT, UNKNOWN, ERROR)


def reusable_bound(
    prompt_tokens: int,
    cached_tokens: int | None,
    granularity: int,
    previous_prompt_tokens: int | None = None,
) -> int:
    """The reusable bound R of the module docstring (granularity at least 1): whole granules
    before the last token, no more than the previous turn's when it is known and shorter,
    never below what was cached. The state and the miss causes both judge by it."""
    bound = (prompt_tokens - 1) // granularity * granularity
    if previous_prompt_tokens is not None and previous_prompt_tokens < prompt_tokens:
        previous_bound = (previous_prompt_tokens - 1) // granularity * granularity
        if previous_bound < bound:
            bound = previous_bound
    if cached_tokens is not None and cached_tokens > bound:
        bound = cached_tokens
    return bound


def classify(
    prompt_tokens: int,
    cached_tokens: int | None,
    granularity: int,
    previous_prompt_tokens: int | None = None,
    warm_tail_granules: float = 2.0,
) -> str:
    """The state of one successful request (see the module docstring for the rule)."""
    if granularity < 1:
        granularity = 1
    bound = reusable_bound(prompt_tokens, cached_tokens, granularity, previous_prompt_tokens)
    if bound < granularity:
        return SHORT
    if cached_tokens is None:
        return UNKNOWN
    if cached_tokens == 0:
        return COLD
    if cached_tokens >= bound - warm_tail_granules * granularity:
        return WARM
    return PARTIAL


# Why prompt tokens were not served from the prefix cache: every value of the ``cause``
# label, in exposition order (``miss``).
NEW = "new"
EVICTED = "evicted"
ORDER = "order"
GRANULE = "granule"
CACHING_OFF = "caching_off"
UNREPORTED = "unreported"
CAUSES = (NEW, EVICTED, ORDER, GRANULE, CACHING_OFF, UNREPORTED, UNKNOWN)


def miss(
    prompt_tokens: int,
    cached_tokens: int | None,
    granularity: int,
    previous_prompt_tokens: int | None = None,
    caching_off: bool = False,
    variable_top: bool = False,
    untold: bool = False,
) -> tuple[int, int, str]:
    """Why a successful request's uncached prompt tokens were not cached: (granule tokens,
    avoidable tokens, the avoidable ones' cause). The two add up to n - c (n when c is not
    reported), so the causes summed are the prompt tokens less the cached ones.

    With R the reusable bound of the module docstring, capped at n:

    - c unknown: all n tokens are ``unreported`` (returned as avoidable, cause unreported);
    - n - R are ``granule``: the new tokens and the partial last granule, which no cache
      could have served; R - c are avoidable, and have one cause, the first that holds of:
      ``caching_off`` (the engine reports prefix caching disabled), ``order`` (the tap saw
      the shared text behind a varying top), ``unknown`` (``untold``: no session, a
      conversation the memory bound dropped, turns another exporter saw; or a previous
      turn at least as long as this one: not a continuation), ``evicted`` (the previous
      turn made those tokens reusable, and they were gone), ``new`` (a first turn).

    The request counts under the avoidable cause when anything was avoidable, else under
    ``granule``. Requires c <= n (validated events).
    """
    if cached_tokens is None:
        return 0, prompt_tokens, UNREPORTED
    if granularity < 1:
        granularity = 1
    bound = reusable_bound(prompt_tokens, cached_tokens, granularity, previous_prompt_tokens)
    if bound > prompt_tokens:
        bound = prompt_tokens
    avoidable = bound - cached_tokens
    if avoidable <= 0:
        return prompt_tokens - bound, 0, GRANULE
    if caching_off:
        cause = CACHING_OFF
    elif variable_top:
        cause = ORDER
    elif untold or (previous_prompt_tokens is not None and previous_prompt_tokens >= prompt_tokens):
        cause = UNKNOWN
    elif previous_prompt_tokens is not None:
        cause = EVICTED
    else:
        cause = NEW
    return prompt_tokens - bound, avoidable, cause
