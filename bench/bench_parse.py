"""Engine-reader parse cost: our scanner vs prometheus_client's text parser, same bodies,
same run. Prints medians of N rounds and the ratio (the client_python parser is the
baseline a naive exporter would use).

    python bench/bench_parse.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from exporter.engine.parse import parse

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def many_engines(text: str, engines: int) -> str:
    """The real scrape repeated for N data-parallel engines (label engine="i")."""
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    out = []
    for i in range(engines):
        out.extend(line.replace('engine="0"', f'engine="{i}"') for line in lines)
    return "\n".join(out) + "\n"


def timed(func, body: str, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        func(body)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def client_python(body: str) -> None:
    for family in text_string_to_metric_families(body):
        for _sample in family.samples:
            pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    real = (FIXTURES / "vllm-0.32.0-cpu" / "metrics_after.prom").read_text()
    residency = (FIXTURES / "vllm-0.33.0-kv-cache-metrics.prom").read_text()
    bodies = {
        "vLLM 0.32.0 scrape (1 engine)": real,
        "8 engines (data parallel)": many_engines(real, 8),
        "vLLM 0.33 with --kv-cache-metrics": residency,
    }
    print(f"{'body':32} {'samples':>8} {'ours ms':>9} {'client_python ms':>17} {'ratio':>6}")
    for name, body in bodies.items():
        samples = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
        ours = timed(parse, body, args.rounds)
        theirs = timed(client_python, body, args.rounds)
        print(
            f"{name:32} {samples:>8} {ours * 1e3:>9.2f} {theirs * 1e3:>17.2f} "
            f"{theirs / ours:>5.1f}x"
        )


if __name__ == "__main__":
    main()
