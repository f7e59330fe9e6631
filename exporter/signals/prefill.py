"""Prefill time saved and lost: a caller's cached tokens, and its prompt tokens missed because
their prefix had been evicted, in seconds of its model's measured prefill.

The one Python definition of the figures the recording rules
``caller_model:vllm_cache_prefill_seconds_saved:<long>`` and ``..._lost:<long>`` record
(exporter/monitoring/rules.py ``_prefill_engine_rules`` and ``_prefill_caller_rules``): the
status page, ``check --exporter.url`` (which reads the page), the demo and the scenario test
(tests/sim/test_prefill_time.py) all compute them here.

- The model's prefill rate over a window: the prompt tokens its engines computed (prompt
  tokens less those served from a cache) over the seconds their requests spent in prefill,
  each summed over every vLLM target serving that model_name before dividing; none without
  prefill time or computed tokens (the rules drop a zero rate).
- Seconds saved over the window: the pair's cached tokens over it at that rate; seconds lost:
  its evicted missed tokens over it at that rate. The rules record them per second (a rate
  over the window); times the window they are these.

Pure arithmetic; the windows are read by the caller (signals/status.py reads them from the
history at the same slot boundaries as every other long-window figure).
"""

from __future__ import annotations


def rate(computed_tokens: float, prefill_seconds: float) -> float | None:
    """Prompt tokens computed per second of prefill; None without prefill time or computed
    tokens (``model:vllm_cache_engine_prefill_tokens_per_second``, zero rates dropped)."""
    if prefill_seconds <= 0 or computed_tokens <= 0:
        return None
    return computed_tokens / prefill_seconds


def seconds(tokens: float, tokens_per_second: float | None) -> float | None:
    """Seconds of prefill ``tokens`` cost at the measured rate; None without a rate."""
    if tokens_per_second is None:
        return None
    return max(0.0, tokens) / tokens_per_second


def minutes(value: float | None) -> str:
    """As the collapse alert's description says it (printf "%.0fm" of the minutes), under a
    minute in seconds; "-" without a figure."""
    if value is None:
        return "-"
    return f"{value:.0f}s" if value < 59.5 else f"{value / 60:.0f}m"
