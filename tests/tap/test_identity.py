"""Who the caller is: header, else the OpenAI ``user`` field, else an alias of the API key,
else a short hash of it, else anonymous. The key itself is forwarded and nothing else."""

from __future__ import annotations

import hashlib
import logging

import pytest

from exporter.usage.tap.identity import KeyAliases, resolve_caller

from .conftest import Reply, fixture_bytes

KEY = "sk-live-0123456789abcdef-SECRET"
DIGEST = hashlib.sha256(KEY.encode()).hexdigest()
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def chat_upstream(upstream):
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("02_chat_warm.json")))
    return upstream


async def caller_of(tap, payload=None, **headers: str) -> str:
    status, _, _ = await tap.post("/v1/chat/completions", payload or CHAT, headers=headers)
    assert status == 200
    return (await tap.usage.next_event()).caller


async def test_identity_order(chat_upstream, start_tap):
    tap = await start_tap(tap_key_alias=((DIGEST[:10], "alice-bot"),))
    auth = {"Authorization": f"Bearer {KEY}"}
    with_user = {**CHAT, "user": "end-user-7"}
    assert await caller_of(tap, with_user, **auth, **{"X-Caller": "team-a"}) == "team-a"
    assert await caller_of(tap, with_user, **auth) == "end-user-7"
    assert await caller_of(tap, CHAT, **auth) == "alice-bot"
    assert await caller_of(tap, CHAT) == "anonymous"
    # Blank values do not count as a name.
    assert await caller_of(tap, {**CHAT, "user": "  "}, **{"X-Caller": " "}) == "anonymous"


async def test_unaliased_key_is_a_short_hash_never_the_key(chat_upstream, start_tap):
    tap = await start_tap()
    caller = await caller_of(tap, Authorization=f"Bearer {KEY}")
    assert caller == "key-" + DIGEST[:12]
    assert KEY not in caller and "SECRET" not in caller
    # The key was forwarded as it came.
    assert chat_upstream.received[0].headers["Authorization"] == f"Bearer {KEY}"


async def test_configured_caller_header(chat_upstream, start_tap):
    tap = await start_tap(tap_caller_header="X-Team")
    assert await caller_of(tap, **{"X-Team": "search", "X-Caller": "ignored"}) == "search"


@pytest.mark.parametrize(
    "hostile,reason",
    [
        ("a" * 1000, "caller_too_long"),
        ("evil\x1b[31mred", "bad_caller"),
    ],
)
async def test_hostile_caller_is_counted_and_costs_nothing_else(
    chat_upstream, start_tap, hostile, reason
):
    tap = await start_tap()
    status, _, body = await tap.post("/v1/chat/completions", {**CHAT, "user": hostile})
    assert (status, body) == (200, fixture_bytes("02_chat_warm.json"))
    assert tap.usage.rejected == [("tap", reason)]
    assert tap.usage.events == []
    # The next caller is recorded as usual.
    assert await caller_of(tap, **{"X-Caller": "fine"}) == "fine"


def test_longest_alias_prefix_wins_and_bad_prefixes_are_ignored(caplog):
    with caplog.at_level(logging.WARNING):
        aliases = KeyAliases(
            (
                (DIGEST[:8], "short"),
                (DIGEST[:16], "long"),
                ("abc", "tiny"),
                ("not-hex-at-all", "typo"),
            )
        )
    assert aliases.lookup(DIGEST) == "long"
    assert aliases.lookup("f" * 64) is None
    assert "tiny" in caplog.text and "typo" in caplog.text
    assert resolve_caller({"Authorization": KEY}, None, "X-Caller", aliases) == "long"
    assert resolve_caller({"Authorization": f"bearer  {KEY} "}, None, "X-Caller", aliases) == "long"


async def test_the_key_never_reaches_logs_or_events(upstream, start_tap, caplog, unused_tcp_port):
    upstream.reply("/v1/chat/completions", Reply(status=401, body=b'{"error":"bad key"}'))
    upstream.reply("/v1/completions", Reply(hang=True))
    with caplog.at_level(logging.DEBUG):
        tap = await start_tap(tap_timeout=0.3)
        headers = {"Authorization": f"Bearer {KEY}"}
        await tap.post("/v1/chat/completions", CHAT, headers=headers)
        await tap.post("/v1/completions", {"prompt": "x"}, headers=headers)
        down = await start_tap(upstream_url=f"http://127.0.0.1:{unused_tcp_port}")
        await down.post("/v1/chat/completions", CHAT, headers=headers)
        await down.post("/v1/chat/completions", {**CHAT, "user": "x" * 300}, headers=headers)
    assert len(tap.usage.events) == 2 and len(down.usage.events) == 1
    assert "SECRET" not in caplog.text
    for event in tap.usage.events + down.usage.events:
        assert "SECRET" not in repr(event)
