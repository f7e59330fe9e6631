"""Plain words: the one source of every sentence ``check``, the status page and the demo say
about what is wrong and what to do: a collapse, conversations that no longer fit, prefix
caching off, cached tokens not reported, preemptions, an unreadable or incomplete vLLM, pool
fit, admission budgets, declared completions and prompt order.

Pure: numbers in, sentences out. The numbers come from wherever the caller read them (a
vLLM's /metrics, an exporter's /metrics, the signals state), so the advice is the same
whichever surface shows it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

# A caller whose declared max_tokens is at least this many times its median use is told so.
OVERSTATEMENT_WORTH_SAYING = 4.0


def tokens(count: float) -> str:
    return f"{count:,.0f}"


def percent(ratio: float) -> str:
    return f"{ratio:.1%}"


def duration(seconds: float) -> str:
    """A window or an age, as people say it: 45 s, 5 min, 1 h 10 min."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def names(items: Sequence[str]) -> str:
    """a, b and c."""
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


# ---- what is wrong now ---------------------------------------------------------------------


@dataclass(frozen=True)
class Collapse:
    """One (caller, model) pair whose hit ratio collapsed: the condition of the
    VllmCachePrefixCollapse alert, held now (the ratio over the short window under a fraction
    of the baseline, the baseline worth losing, traffic then and one window before)."""

    caller: str
    model: str
    since: float
    window_seconds: float
    ratio_now: float
    baseline: float
    baseline_window_seconds: float


def collapse_sentence(collapses: Sequence[Collapse]) -> str:
    parts = [
        f"{collapse.caller} on {collapse.model} got {percent(collapse.ratio_now)} of its "
        f"prompt tokens from the cache over the last {duration(collapse.window_seconds)}, "
        f"against its baseline of {percent(collapse.baseline)} (the last "
        f"{duration(collapse.baseline_window_seconds)})"
        for collapse in collapses
    ]
    who = names(list(dict.fromkeys(collapse.caller for collapse in collapses)))
    return (
        f"Prefix cache collapse: {who}. " + "; ".join(parts) + ". Each turn now reads its "
        "whole prompt again, minutes instead of seconds to the first token. Most often "
        "the live conversations no longer fit the KV pool together (see below): gate "
        "admission by tokens or let fewer conversations share this engine."
    )


def engine_collapse_sentence(
    target: str,
    ratio_now: float,
    baseline: float,
    window_seconds: float,
    baseline_window_seconds: float,
) -> str:
    return (
        f"Prefix cache collapse on vLLM {target}: {percent(ratio_now)} of looked-up prompt "
        f"tokens were hits over the last {duration(window_seconds)}, against its baseline of "
        f"{percent(baseline)} (the last {duration(baseline_window_seconds)}), while prompts "
        "keep coming."
    )


# vLLM's CPU build batches this many tokens per engine step unless told otherwise
# (--max-num-batched-tokens; engine/arg_utils.py, the CPU platform's default).
CPU_DEFAULT_BATCHED_TOKENS = 2048


def hybrid_granule_sentence(granule: int, stale_label: str | None) -> str:
    """What prefix caching can resume on a hybrid engine (``mamba_cache_mode="align"``)."""
    stale = (
        (f" (its mamba_block_size label, {stale_label}, is stale: the granule is block_size)")
        if stale_label and stale_label != str(granule)
        else ""
    )
    return (
        f'hybrid model (mamba_cache_mode "align"): cached in whole {granule:,}-token '
        f"granules: a warm turn re-reads its last granule as well as what it added, so "
        f"well under 100% cached can be a full hit{stale}."
    )


def hybrid_cpu_batching_sentence(where: str, granule: int) -> str:
    """The CPU Mamba2 kernel's limit (vLLM 0.32), which /metrics cannot show is kept."""
    rule = (
        f"On vLLM's CPU build, keep --max-num-batched-tokens at {granule:,} or below "
        f"for {where}: the CPU Mamba2 kernel ends the engine (IndexError in "
        f"mamba_mixer2) when one prefill step spans more than one {granule:,}-token "
        "granule"
    )
    if granule < CPU_DEFAULT_BATCHED_TOKENS:
        return (
            f"{rule}, and its default batch, {CPU_DEFAULT_BATCHED_TOKENS:,} tokens, "
            f"does: start it with --max-num-batched-tokens {granule}. (/metrics does not "
            "show the batch size, nor the build; on a GPU this does not apply.)"
        )
    return (
        f"{rule}; its default batch, {CPU_DEFAULT_BATCHED_TOKENS:,} tokens, does not. "
        "(/metrics does not show the batch size, nor the build; on a GPU this does not "
        "apply.)"
    )


def prefix_caching_off_sentence(where: str) -> str:
    return (
        f"{where}: prefix caching is off, so every turn re-reads its whole prompt. Start "
        "vLLM with --enable-prefix-caching (hybrid models default to off in older vLLM)."
    )


def not_reported_sentence(callers: Sequence[str]) -> str:
    who = f" for {names(list(callers))}" if callers else ""
    return (
        "cached_tokens not reported: start vLLM with --enable-prompt-tokens-details "
        f"(without it vLLM leaves cached_tokens out of each response's usage; requests{who} "
        "show as unknown, never as a 0% hit)."
    )


def details_unknown_sentence() -> str:
    """What check says once when it cannot tell (it reads only /metrics)."""
    return (
        "whether vLLM reports cached_tokens per request (--enable-prompt-tokens-details) "
        "does not show in /metrics: add --exporter.url URL of a running exporter to find "
        "out, or look for usage.prompt_tokens_details in a response."
    )


def per_request_metrics_unknown_sentence() -> str:
    """What check says once when it cannot tell (a flag of vLLM's API server, in no metric)."""
    return (
        "whether vLLM times each request itself (--enable-per-request-metrics) does not "
        'show in /metrics either: add --exporter.url, or look for "metrics" in a '
        "response. Without it TTFT is the proxy's, with vLLM's own queue in it (the tap "
        "logs a warning at the first answer without them)."
    )


def per_request_metrics_off_sentence() -> str:
    """No turn timed by vLLM, some by the proxy."""
    return (
        "every TTFT the exporter has is the proxy's (source=\"proxy\"), with vLLM's own "
        "queue in it: start vLLM with --enable-per-request-metrics so that TTFT and queue "
        "wait are the engine's own."
    )


# Whose TTFT a figure is (signals/timing.py chooses): vLLM's own, or the proxy's.
TTFT_SOURCE_LABEL = {"engine": "vLLM's own", "proxy": "the proxy's, vLLM's queue included"}


def ttft_source_label(source: str | None) -> str:
    return TTFT_SOURCE_LABEL.get(source or "", "nothing timed yet")


def seconds(value: float | None) -> str:
    """A TTFT as the page and check show it: 0.4 s, 52.1 s, 130 s; "-" for none."""
    if value is None:
        return "-"
    return f"{value:.1f} s" if value < 100 else f"{value:.0f} s"


def ttft_sentence(caller: str, source: str | None, warm: float | None, cold: float | None) -> str:
    return (
        f"{caller}: median time to first token since the exporter started, warm turns "
        f"{seconds(warm)}, cold turns {seconds(cold)} ({ttft_source_label(source)})."
    )


def preemptions_sentence(where: str, count: float, over: str) -> str:
    """``over``: "in the last 5 min", "since vLLM started"."""
    return (
        f"vLLM is preempting requests: {where} preempted {tokens(count)} time(s) {over}. "
        "At times more concurrent context than the KV pool holds; preempted requests "
        "are recomputed."
    )


def unreadable_sentence(target: str, message: str) -> str:
    sentence = f"vLLM {target} cannot be read: {message}."
    hint = url_hint(target, message)
    return f"{sentence} {hint}" if hint else sentence


def url_hint(target: str, message: str) -> str:
    """The fix for the most common wrong URL: an OpenAI base URL (ending in /v1) given where
    vLLM's /metrics is meant; vLLM serves /metrics at its root, so the read gets a 404."""
    parts = urlsplit(target)
    if "404" not in message or not (parts.path.rstrip("/").endswith("/v1") or "/v1/" in parts.path):
        return ""
    root = urlunsplit((parts.scheme, parts.netloc, "", "", ""))
    return f"vLLM serves /metrics at its root, not under /v1: use --vllm.url {root} (without /v1)."


def absent_sentence(where: str, signal: str, known: str = "") -> str:
    under = f" under any known name ({known})" if known else " under any known name"
    return (
        f"{where} exposes no {signal} metric{under}: the exporter shows it as absent, and "
        "a dashboard querying it reads nothing (or a misleading 0). Is this vLLM, with "
        "stats logging on (no --disable-log-stats)?"
    )


# ---- what happened, for a story told as it goes -------------------------------------------


def arrival_sentence(caller: str, callers: int) -> str:
    return (
        f"{caller} arrives: {callers} caller(s) now share the engine, each conversation "
        "holding its own prefix in the KV pool."
    )


def warm_sentence(caller: str, ratio: float, window_seconds: float) -> str:
    return (
        f"{caller} is warm: {percent(ratio)} of its prompt tokens came from the cache over "
        f"the last {duration(window_seconds)} (each turn re-reads only what it added)."
    )


def recovered_sentence(callers: Sequence[str]) -> str:
    return f"No collapse any more for {names(list(callers))}."


def pool_sentence(
    pool_tokens: int,
    smallest_pool_tokens: int,
    smallest_source: str,
    headroom_tokens: int,
    budget_tokens: int,
) -> str:
    """The pool, the smallest one known, and the admission budget derived from it."""
    if smallest_pool_tokens < pool_tokens:
        smallest = (
            f"the smallest seen {smallest_source} is {tokens(smallest_pool_tokens)}, "
            "and budgets go by the smallest"
        )
    else:
        smallest = (
            f"the smallest known ({smallest_source}); read it over several boots, it "
            "moves with free GPU memory"
        )
    return (
        f"KV pool {tokens(pool_tokens)} tokens, {smallest}. Admission budget: "
        f"{tokens(budget_tokens)} tokens (gate by tokens, not requests: "
        f"max_concurrent_tokens {tokens(budget_tokens)}, {tokens(headroom_tokens)} under "
        f"the smallest pool)."
    )


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
        return (
            self.conversations >= 2 and self.demand_tokens > self.pool_tokens - self.headroom_tokens
        )


def fit_sentence(fit: Fit, idle_seconds: float | None = None) -> str:
    window = f" (a turn within {idle_seconds / 60:g} min)" if idle_seconds else ""
    head = (
        f"{fit.conversations} conversation(s) active{window} need "
        f"{tokens(fit.demand_tokens)} tokens of KV cache: {fit.ratio:.1%} of the "
        f"{tokens(fit.pool_tokens)}-token pool."
    )
    if fit.overflows:
        return (
            f"{head} They do not all fit: each turn will evict another conversation's "
            "prefix and the hit ratio will collapse. Gate admission by tokens or let "
            "fewer conversations share this engine."
        )
    if fit.conversations >= 2:
        room = fit.pool_tokens - fit.headroom_tokens - fit.demand_tokens
        return f"{head} They fit, with {tokens(room)} tokens to spare past the headroom."
    return f"{head} One conversation alone cannot be evicted by another."


def unattributed_sentence(model: str, conversations: float, demand_tokens: float) -> str:
    return (
        f"{model}: {conversations:,.0f} conversation(s) active need {tokens(demand_tokens)} "
        "tokens of KV cache (not attributed to one vLLM: compare with the pools of the "
        "vLLMs serving it)."
    )


@dataclass(frozen=True)
class Completions:
    """What one caller declared as max_tokens and what it used (tokens), from exact sums and
    counts. ``charge_bound``: a count of tokens that at least 99% of the requests used no
    more than (the upper bound of the histogram bucket the 99th percentile falls in, never
    above the largest used or declared where those are known; infinite when nothing bounds
    it). ``largest``: the most any one request used, where it is known (the status page's
    memory; /metrics has no maximum)."""

    caller: str
    model: str
    requests: int
    declared_mean: float
    used_mean: float
    charge_bound: float
    largest: int | None = None

    @property
    def overstatement(self) -> float:
        return self.declared_mean / self.used_mean if self.used_mean > 0 else math.inf

    @property
    def advised_charge(self) -> int:
        """What an admission gate should charge for the completion: what 99% of the requests
        stayed within, rounded up to a whole 256 tokens, never more than declared."""
        if math.isinf(self.charge_bound):
            return int(self.declared_mean)
        return min(int(self.declared_mean), int(math.ceil(self.charge_bound / 256.0)) * 256)


def completions(
    caller: str,
    model: str,
    buckets: Sequence[tuple[float, float]],
    used_sum: float,
    declared_sum: float,
    largest_used: float | None = None,
    largest_declared: float | None = None,
) -> Completions | None:
    """``Completions`` from a completion-tokens-used histogram (cumulative (upper bound,
    count) buckets, the last +Inf), its sum and the declared tokens' sum; None without a
    request. The means are the sums over the count: exact, not read from the buckets."""
    ordered = sorted(buckets)
    requests = ordered[-1][1] if ordered else 0.0
    if requests <= 0:
        return None
    rank = 0.99 * requests
    bound = next((le for le, count in ordered if count >= rank), math.inf)
    known = [value for value in (largest_used, largest_declared) if value is not None]
    charge_bound = min([bound, *known])
    return Completions(
        caller,
        model,
        int(requests),
        declared_sum / requests,
        used_sum / requests,
        charge_bound,
        int(largest_used) if largest_used is not None else None,
    )


def completion_sentence(figures: Completions) -> str:
    largest = f" ({tokens(figures.largest)} at most)" if figures.largest is not None else ""
    head = (
        f"{figures.caller} on {figures.model}: {figures.requests} request(s) declared "
        f"max_tokens {tokens(figures.declared_mean)} on average and used "
        f"{tokens(figures.used_mean)} on average{largest}"
    )
    if figures.overstatement >= OVERSTATEMENT_WORTH_SAYING:
        within = (
            "" if math.isinf(figures.charge_bound) else " (99% of the requests stayed within it)"
        )
        return (
            f"{head}: an overstatement of {figures.overstatement:.0f}x. An admission gate "
            f"that charges the declared figure holds a fraction of the conversations "
            f"it could: charge prompt + min(max_tokens, "
            f"{tokens(figures.advised_charge)}) instead{within}."
        )
    return f"{head}: declared and used agree well enough to charge the declared figure."


@dataclass(frozen=True)
class PromptOrder:
    """One caller's requests (to one model) compared for prompt order, and those that share
    most of their text with a recent one but not its beginning (means in bytes of the prompt
    as sent, about characters)."""

    caller: str
    model: str
    compared: int
    variable_top: int
    shared_chars: float  # mean over the variable_top requests
    first_difference_chars: float  # idem

    @property
    def worth_saying(self) -> bool:
        """At least two such requests, and most of those compared."""
        return self.variable_top >= 2 and self.variable_top >= 0.5 * self.compared


def prompt_order_sentence(figures: PromptOrder) -> str:
    return (
        f"{figures.caller} on {figures.model}: {figures.variable_top} of "
        f"{figures.compared} request(s) compared share ~{tokens(figures.shared_chars)} "
        f"characters with a recent one but differ within the first "
        f"{tokens(figures.first_difference_chars)}: something variable sits at the top "
        "of the prompt (a per-agent task, a timestamp, a request id), so the prefix cache "
        "cannot reuse the text they share. Put the shared text first, byte-identical in "
        "every request, and the varying part last."
    )


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
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound
