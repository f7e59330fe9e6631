"""`check`: one read of a vLLM's /metrics, the field reports' traps named in plain words."""

from __future__ import annotations

import asyncio
import re
import sys

from exporter.check import Report, describe
from exporter.engine.parse import parse
from tests.helpers import fixture_text

REAL = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")


def report_for(text: str) -> Report:
    report = Report("http://vllm/metrics")
    describe(parse(text), report)
    return report


def test_healthy_real_vllm_has_no_problem():
    report = report_for(REAL)
    assert report.problems == []
    assert any("prefix caching on, block 32 tokens, KV pool 1,048,576 tokens" in line
               for line in report.lines)
    assert any("6,784 of 9,914 looked-up tokens were hits (68.4%)" in line
               for line in report.lines)


def test_prefix_caching_off_is_a_problem():
    report = report_for(REAL.replace('enable_prefix_caching="True"',
                                     'enable_prefix_caching="False"'))
    assert len(report.problems) == 1
    assert "--enable-prefix-caching" in report.problems[0]


def test_old_names_are_read_and_a_missing_016_metric_is_only_a_note():
    report = report_for(fixture_text("vllm-0.9-oldnames.prom"))
    assert report.problems == []
    assert any("hits (68.4%)" in line for line in report.lines)
    assert any("prompt_tokens_cached" in note and "0.16" in note for note in report.notes)


def test_a_metric_under_no_known_name_is_a_problem_not_a_zero():
    renamed = REAL.replace("vllm:num_preemptions_total", "vllm:num_preemptions_renamed_total")
    report = report_for(renamed)
    assert len(report.problems) == 1
    assert "no preemptions metric under any known name" in report.problems[0]


def test_preemptions_are_noted():
    text = REAL.replace('vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 0.0',
                        'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 12.0')
    report = report_for(text)
    assert report.problems == []
    assert any("12 preemption(s)" in note for note in report.notes)


async def run_check(*urls: str) -> tuple[int, str, str]:
    args = [arg for url in urls for arg in ("--vllm.url", url)]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "exporter", "check", "--vllm.timeout", "5", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_command_exit_codes(fake_vllm, unused_tcp_port):
    code, out, _ = await run_check(fake_vllm.url)
    assert code == 0, out
    assert out.splitlines()[0] == fake_vllm.url and "  OK" in out.splitlines()

    fake_vllm.body = REAL.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    code, out, _ = await run_check(fake_vllm.url)
    assert code == 1 and "PROBLEM: tiny-llama engine 0: prefix caching is off" in out

    dead = f"http://127.0.0.1:{unused_tcp_port}"
    code, out, _ = await run_check(dead)
    assert code == 1 and "cannot read vLLM's /metrics (connect)" in out

    code, _, err = await run_check("not-a-url")
    assert code == 2 and "--vllm.url" in err


def test_residency_metrics_off_is_said_in_words():
    report = report_for(REAL)
    assert report.problems == []
    off = [note for note in report.notes if "KV residency metrics are off" in note]
    assert len(off) == 1 and "start vLLM with --kv-cache-metrics" in off[0]


def test_residency_evicted_before_reuse_is_named():
    report = report_for(fixture_text("vllm-0.33.0-kv-cache-metrics.prom"))
    assert not any("KV residency metrics are off" in note for note in report.notes)
    (line,) = [line for line in report.lines if "KV residency:" in line]
    # The fixture's evictions: 150 sampled blocks, idle 2-30 s, reused about every 45 s.
    assert "150 sampled block(s) evicted since vLLM started" in line
    idle = float(line.split("median idle before eviction ")[1].split(" s")[0])
    gap = float(line.split("median gap between reuses ")[1].split(" s")[0])
    assert 10 < idle < 20 < 40 < gap < 60
    evicted_early = [note for note in report.notes if "sooner than blocks are reused" in note]
    assert len(evicted_early) == 1 and "too small" in evicted_early[0]
    assert report.problems == []


def test_residency_on_without_evictions_yet():
    text = fixture_text("vllm-0.33.0-kv-cache-metrics.prom")
    empty = re.sub(r"^(vllm:kv_block_\w+_(?:bucket|count|sum)\{[^}]*\}) \S+$", r"\1 0.0", text,
                   flags=re.M)
    report = report_for(empty)
    assert any("KV residency: no sampled block evicted" in line for line in report.lines)
    assert not any("KV residency metrics are off" in note for note in report.notes)
