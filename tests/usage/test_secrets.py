"""No secret or personal data in labels, pages, logs or error replies.

A table of the caller forms operators and attackers actually send, through every way a name
reaches the exporter (POST /v1/usage, the tap's caller header, the OpenAI ``user`` field):
each is a readable label or a ``key-`` hash as the documented policy says, and the raw
secret appears nowhere the exporter writes. Then URLs with credentials in every flag that
takes one.
"""

from __future__ import annotations

import json
import logging

import pytest

from exporter.cli import main
from exporter.config import Config
from exporter.redaction import key_label, redact_text, redact_url
from exporter.server import create_app
from exporter.signals.callers import NamePolicy
from tests.tap.conftest import Reply, fixture_bytes

# (name as sent, readable?) -- at least the forms the issue lists, and more.
CALLERS = [
    ("sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8t", False),
    ("sk-1234", False),
    ("Bearer sk-abcdef1234567890", False),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2ln", False),
    ("ghp_a1B2a1B2a1B2a1B2a1B2a1B2a1B2a1B2", False),
    ("AKIAIOSFODNN7EXAMPLE", False),
    ("xoxb-123-456-abc", False),
    ("hf_AbCdEfGhIjKlMnOpQrStUvWxYz", False),
    ("0123456789abcdef0123456789abcdef", False),
    ("token=sk-abcdef1234567890", False),
    ("jan.kowalski@example.com", False),
    (" sk-leadingspace12345", False),
    ("Authorization: Bearer sk-abcdef1234567890", False),
    ("api_key:sk-abcdef1234567890", False),
    ("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", False),
    ("user:hunter2", False),
    ("Basic dXNlcjpodW50ZXIy", False),
    ("abcdefghijklmnopqrstuvwxyz012345", False),
    ("https://admin:pw@vllm.internal", False),
    ("Agent Smith", False),
    ("x" * 65, False),
    ("agent-a", True),
    ("team-search-agent-2", True),
    ("pk-search", True),
    ("sess-caller", True),
    ("rk-7", True),
    ("claude-code", True),
    ("nightly-batch-2024-10-01", True),
    ("6f1e2a0c-7b1d-4a58-9a3e-1c2b3d4e5f60", True),
    ("MyServiceProductionAgent", True),
]
SECRET_PARTS = [
    "Ab3dEf6h",
    "sk-1234",
    "abcdef1234567890",
    "eyJhbGci",
    "a1B2a1B2",
    "AKIAIOSF",
    "xoxb-123",
    "hf_AbCd",
    "0123456789abcdef",
    "jan.kowalski",
    "hunter2",
    "dXNlcjpo",
    "wJalrXUt",
    "admin:pw",
    "abcdefghijklmnopqrstuvwxyz",
]


def expected_label(name: str, readable: bool) -> str:
    name = name.strip(" ")
    return name if readable else key_label(name)


@pytest.mark.parametrize("name, readable", CALLERS, ids=range(len(CALLERS)))
def test_the_policy_on_each_form(name, readable):
    assert NamePolicy().label(name.strip(" ")) == expected_label(name, readable)


def test_e_mail_addresses_kept_only_when_the_operator_says_so():
    assert NamePolicy(keep_emails=True).label("jan@example.com") == "jan@example.com"
    assert NamePolicy().label("jan@example.com") == key_label("jan@example.com")


def test_an_e_mail_as_the_model_name_is_hashed_too():
    from exporter.signals.callers import DEFAULT_MODEL_PATTERN

    policy = NamePolicy(DEFAULT_MODEL_PATTERN)
    assert policy.label("jan@example.com") == key_label("jan@example.com")
    assert policy.label("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert policy.label("llama3:8b") == "llama3:8b"


def assert_no_secret(text: str, where: str) -> None:
    for part in SECRET_PARTS:
        assert part not in text, f"{part!r} leaked into {where}"


async def test_no_raw_secret_through_post_v1_usage(usage_client, caplog):
    client, _state = await usage_client(callers_max=1000)
    caplog.set_level(logging.DEBUG)
    body = "\n".join(
        json.dumps(
            {
                "caller": name,
                "model": "jan.kowalski@example.com",
                "prompt_tokens": 100,
                "cached_tokens": 0,
            }
        )
        for name, _ in CALLERS
    )
    reply = await client.post("/v1/usage", data=body)
    assert (await reply.json())["accepted"] == len(CALLERS)
    bad = await client.post(
        "/v1/usage", data=json.dumps({"caller": CALLERS[0][0], "prompt_tokens": -1})
    )
    metrics = await (await client.get("/metrics")).text()
    page = await (await client.get("/")).text()
    for name, readable in CALLERS:
        assert f'caller="{expected_label(name, readable)}"' in metrics
    assert f'model="{key_label("jan.kowalski@example.com")}"' in metrics
    for text, where in (
        (metrics, "/metrics"),
        (page, "/"),
        (await bad.text(), "the reply"),
        (caplog.text, "the log"),
    ):
        assert_no_secret(text, where)


@pytest.mark.parametrize("way", ["header", "user"])
async def test_no_raw_secret_through_the_tap(upstream, start_tap, aiohttp_client, way, caplog):
    from exporter.wiring import signals_state

    caplog.set_level(logging.DEBUG)
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("02_chat_warm.json")))
    config = Config(callers_max=1000)
    state = signals_state(config)
    tap = await start_tap(usage=state.usage)
    for name, _readable in CALLERS:
        payload = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
        headers = {}
        if way == "header":
            headers["X-Caller"] = name
        else:
            payload["user"] = name
        status, _, _ = await tap.post("/v1/chat/completions", payload, headers=headers)
        assert status == 200
    exporter = await aiohttp_client(create_app(config, state, initial_refresh=False))
    metrics = await (await exporter.get("/metrics")).text()
    for name, readable in CALLERS:
        assert f'caller="{expected_label(name, readable)}"' in metrics, name
    assert_no_secret(metrics, "/metrics")
    assert_no_secret(caplog.text, "the log")


# --- URLs with credentials ----------------------------------------------------------------

SECRET_URL = "http://admin:vllmpass123@127.0.0.1:1/metrics?api_key=sk-qwerty987&x=1"


@pytest.mark.parametrize(
    "url, shown",
    [
        (SECRET_URL, "http://redacted@127.0.0.1:1/metrics?api_key=redacted&x=1"),
        ("https://u:p@host", "https://redacted@host"),
        ("http://vllm:8000/metrics", "http://vllm:8000/metrics"),
        (
            "http://vllm:8000/metrics?token=t&sig=s&page=2",
            "http://vllm:8000/metrics?token=redacted&sig=redacted&page=2",
        ),
    ],
)
def test_one_redaction_rule(url, shown):
    assert redact_url(url) == shown
    assert redact_text(f"cannot connect to {url}: refused") == f"cannot connect to {shown}: refused"


async def test_vllm_url_credentials_appear_nowhere(aiohttp_client, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    client = await aiohttp_client(create_app(Config(vllm_url=(SECRET_URL,)), initial_refresh=False))
    metrics = await (await client.get("/metrics")).text()  # reads it: connection refused
    page = await (await client.get("/")).text()
    ready = await (await client.get("/-/ready")).text()
    assert 'target="http://redacted@127.0.0.1:1/metrics?api_key=redacted&x=1"' in metrics
    assert (
        main(
            [
                "--vllm.url",
                SECRET_URL,
                "--tap.listen-address",
                "127.0.0.1:0",
                "--tap.upstream",
                "http://tapuser:tappass456@127.0.0.1:9",
                "--check-config",
            ]
        )
        == 0
    )
    assert main(["--vllm.url", "ftp://admin:vllmpass123@x"]) == 2
    printed = capsys.readouterr()
    for text in (metrics, page, ready, caplog.text, printed.out, printed.err):
        for secret in ("vllmpass123", "sk-qwerty987", "tappass456", "admin:", "tapuser"):
            assert secret not in text


async def test_the_tap_sends_its_upstream_credentials_only_when_the_client_sends_none(
    upstream, start_tap
):
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("02_chat_warm.json")))
    host = upstream.url.split("://", 1)[1]
    tap = await start_tap(upstream_url=f"http://vllm-user:vllm-pass@{host}")
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    assert (await tap.post("/v1/chat/completions", chat))[0] == 200
    assert (
        await tap.post(
            "/v1/chat/completions", chat, headers={"Authorization": "Bearer sk-client-key"}
        )
    )[0] == 200
    import base64

    first, second = upstream.received
    assert (
        first.headers["Authorization"]
        == "Basic " + base64.b64encode(b"vllm-user:vllm-pass").decode()
    )
    assert second.headers["Authorization"] == "Bearer sk-client-key"
