"""bench/bench_callers.py's truth is the exporter's rule: its own copy of the rule agrees with
``classify``, and its traffic, fed to the exporter's state in process with nothing capped,
is counted exactly as the bench says it is (so a confusion the bench reports is the
exporter's, under its caps and limits, not the generator's)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from exporter.signals.classify import classify
from exporter.signals.foresight import ForesightSettings
from exporter.signals.usage import UsageSettings, UsageState
from exporter.usage.event import validate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_callers  # noqa: E402


def test_the_benchs_rule_is_the_classifiers() -> None:
    rng = random.Random(7)
    for _ in range(20_000):
        granularity = rng.choice((1, 16, 32, 384, 2048))
        prompt = rng.randint(1, 200_000)
        cached = rng.randrange(0, prompt + 1, granularity) if rng.random() < 0.8 else 0
        previous = rng.choice((None, rng.randint(1, 200_000)))
        assert bench_callers.true_state(prompt, cached, granularity, previous, 2.0) == classify(
            prompt, cached, granularity, previous, 2.0
        ), (prompt, cached, granularity, previous)


@pytest.mark.parametrize(("granularity", "models"), [(16, 1), (2048, 3)])
def test_uncapped_the_exporter_counts_the_benchs_truth(granularity: int, models: int) -> None:
    args = bench_callers.parse_args(
        [
            "--quick",
            "--callers=50",
            "--conversations=200",
            "--duration=20",
            f"--granularity={granularity}",
            f"--models={models}",
        ]
    )
    traffic = bench_callers.build_traffic(args)
    state = UsageState(
        UsageSettings(
            callers_max=args.callers,
            max_series=10_000_000,
            granularity=granularity,
            foresight=ForesightSettings(max_conversations=100_000),
        )
    )
    truth: dict[tuple[str, str], list[int]] = {}
    for bodies in traffic.bodies:
        for body in bodies:
            for line, index in zip(body.data.split(b"\n"), body.truth, strict=True):
                state.record(validate(json.loads(line)), "http")
                pair, kind = divmod(index, 6)
                caller, model = divmod(pair, models)
                key = (f"caller-{caller:05d}", bench_callers.MODELS[model])
                truth.setdefault(key, [0] * 6)[kind] += 1
    counted = {
        key: [series.requests[name] for name in bench_callers.STATES]
        for key, series in state.series.items()
    }
    assert counted == truth
    every = [sum(column) for column in zip(*truth.values(), strict=True)]
    assert every[0] > 0.7 * sum(every)  # mostly warm follow-ups
    assert all(every[index] for index in range(6) if bench_callers.STATES[index] != "unknown")
