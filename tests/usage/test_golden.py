"""node_exporter-style end-to-end for the per-caller side: the real vLLM 0.32.0 responses,
replayed as a proxy would report them through POST /v1/usage (``openai`` format), must give
exactly the committed exposition. ``UPDATE_GOLDEN=1 python -m pytest
tests/usage/test_golden.py`` rewrites it; review the diff like code.

The replay covers every response shape the reader knows: chat and completions, whole and
streamed (SSE text), the Responses API whole and streamed, an HTTP error, two conversations
and a caller whose requests carry the proxy's TTFT and queue wait; and the same shapes from
vLLM with ``--enable-per-request-metrics`` (its own TTFT and queue wait, source="engine"),
one of them also timed by the proxy, and an ``n=2`` answer, for which vLLM sends none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.helpers import FIXTURES

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "per-caller-vllm-0.32.0.prom"
CAPTURES = FIXTURES / "vllm-0.32.0-cpu"

# (caller, session, capture, what the proxy measured itself)
REPLAY = (
    ("agent-a", "conv-1", "01_chat_cold.json", {"ttft_seconds": 0.41, "queue_seconds": 0.01}),
    ("agent-a", "conv-1", "02_chat_warm.json", {"ttft_seconds": 0.09, "queue_seconds": 0.0}),
    ("agent-a", "conv-1", "03_chat_stream_warm.sse.txt", {"ttft_seconds": 0.12}),
    ("agent-b", "conv-2", "05_completion_repeat.json", {}),
    ("agent-b", "conv-2", "06_completion_stream.sse.txt", {}),
    ("agent-b", "conv-3", "08_completion_no_shared_prefix.json", {}),
    ("agent-c", None, "10_responses_warm.json", {}),
    ("agent-c", None, "09_responses_stream_warm.sse.txt", {}),
    ("agent-c", None, "11_chat_error_400.json", {"status": 400}),
    (
        "agent-d",
        "conv-4",
        "12_chat_metrics_cold.json",
        {"ttft_seconds": 0.25, "queue_seconds": 0.05},
    ),
    ("agent-d", "conv-4", "13_chat_stream_metrics_warm.sse.txt", {"ttft_seconds": 0.03}),
    ("agent-d", "conv-5", "14_completion_metrics_one_token.json", {}),
    ("agent-d", "conv-5", "15_completion_stream_metrics.sse.txt", {}),
    ("agent-d", "conv-6", "16_chat_metrics_n2.json", {"ttft_seconds": 0.5}),
    ("agent-e", None, "17_responses_metrics.json", {}),
    ("agent-e", None, "18_responses_stream_metrics.sse.txt", {}),
)


def record(
    caller: str, session: str | None, capture: str, measured: dict[str, object]
) -> dict[str, object]:
    text = (CAPTURES / capture).read_text(encoding="utf-8")
    response: object = json.loads(text) if capture.endswith(".json") else text
    out: dict[str, object] = {"caller": caller, "response": response, **measured}
    if session is not None:
        out["session"] = session
    return out


def per_caller_exposition(text: str) -> str:
    """The per-caller series: everything of ours but the engine and self series and the
    wall-clock timestamp of the last event."""
    keep = []
    for line in text.splitlines():
        if not line.startswith(("vllm_cache_", "# HELP vllm_cache_", "# TYPE vllm_cache_")):
            continue
        if "vllm_cache_engine_" in line or "vllm_cache_exporter_" in line:
            continue
        if "last_event_timestamp" in line:
            continue
        keep.append(line)
    return "\n".join(keep) + "\n"


async def test_replayed_vllm_responses_match_the_golden_exposition(usage_client):
    client, _state = await usage_client()
    body = "\n".join(json.dumps(record(*entry)) for entry in REPLAY)
    response = await client.post("/v1/usage?format=openai", data=body)
    reply = await response.json()
    assert response.status == 200, reply
    assert reply["accepted"] == len(REPLAY) and reply["rejected"] == 0
    got = per_caller_exposition(await (await client.get("/metrics")).text())
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(got, encoding="utf-8")
    assert got == GOLDEN.read_text(encoding="utf-8"), f"exposition drifted from {GOLDEN}"


def test_the_golden_file_holds_what_vllm_reported():
    """The golden file is not just whatever the code printed: its totals are vLLM's."""
    text = GOLDEN.read_text(encoding="utf-8")
    assert 'vllm_cache_prompt_tokens_total{caller="agent-a",model="tiny-llama"} 4187.0' in text
    assert 'vllm_cache_cached_tokens_total{caller="agent-a",model="tiny-llama"} 2752.0' in text
    assert 'vllm_cache_requests_total{caller="agent-a",model="tiny-llama",state="cold"} 1.0' in text
    assert 'vllm_cache_requests_total{caller="agent-c",model="",state="error"} 1.0' in text
