"""What the prompt-order diagnosis costs per request, step by step, in one process.

    python bench/bench_order.py [--repeat 2000]

For a chat body as bench_tap.py sends it (prose, 4 KB and 400 KB prompts): the tap's own
request scan (``facts_of``, what every recorded call already pays) as the baseline, then
the diagnosis' steps: finding the prompt's bytes (handed over by msgspec, or a span of the
scan's), the fingerprint (at most --tap.prompt-order-bytes, default 32 KiB) and the
comparison with the last 8 requests of the same caller and model
(``OrderTracker.observe`` with 8 kept, all sharing the prompt: the most work a comparison
does). Medians of --repeat runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_tap import chat_payload  # noqa: E402

from exporter.signals.order import PRINTS_PER_PAIR, OrderTracker  # noqa: E402
from exporter.usage.openai import Endpoint  # noqa: E402
from exporter.usage.tap.fingerprint import fingerprint, new_key  # noqa: E402
from exporter.usage.tap.request import facts_of, prompt_bytes  # noqa: E402

CAP = 32 * 1024  # --tap.prompt-order-bytes default


def median_us(work: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def measure(chars: int, key: bytes, repeat: int) -> None:
    body = json.dumps(chat_payload(False, chars)).encode()
    facts = facts_of(body, Endpoint.CHAT)
    prompt_text = prompt_bytes(body, Endpoint.CHAT, facts)
    assert prompt_text is not None
    prompt = fingerprint(prompt_text, key, CAP)
    tracker = OrderTracker()
    for _ in range(PRINTS_PER_PAIR):
        tracker.observe("pair", prompt, 1.0)
    scan = median_us(lambda: facts_of(body, Endpoint.CHAT), repeat)
    find = median_us(lambda: prompt_bytes(body, Endpoint.CHAT, facts), repeat)
    cut = median_us(lambda: fingerprint(prompt_text, key, CAP), repeat)
    compare = median_us(lambda: tracker.observe("pair", prompt, 1.0), repeat)
    total = find + cut + compare
    print(
        f"{len(body) // 1000:>6}KB {len(prompt.digests):>6} {scan:>14.1f}us "
        f"{find:>6.1f}us {cut:>10.1f}us {compare:>9.1f}us {total:>8.1f}us "
        f"{total / scan:>6.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    key = new_key()
    print(
        f"{'prompt':>8} {'blocks':>6} {'scan (baseline)':>16} {'prompt':>8} "
        f"{'fingerprint':>12} {'compare x8':>11} {'diagnosis':>10} {'ratio':>6}"
    )
    for chars in (4_000, 400_000):
        measure(chars, key, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
