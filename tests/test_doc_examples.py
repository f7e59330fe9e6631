"""The examples of README.md and docs/ are true to the code: each `vllm-cache-exporter`
command line they show is one the command line accepts, and the `POST /v1/usage` examples of
docs/usage.md, sent to a real exporter process as written (with curl and jq, as the reader
would, where they are installed), get the reply the page shows."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from exporter.cli import parse
from exporter.config import RUN, resolve
from tests.helpers import value

ROOT = Path(__file__).resolve().parent.parent
USAGE = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
# Where the examples' commands are: the quick path and every reference page (docs/performance.md
# is a benchmark report: its commands are bench/'s).
PAGES = [
    ROOT / "README.md",
    *sorted(path for path in (ROOT / "docs").glob("*.md") if path.name != "performance.md"),
]
DOC_URL = "http://127.0.0.1:10123"
TOKEN = "doc-example-token"


def code_blocks(text: str, languages: tuple[str, ...] = ("sh", "console", "")) -> list[str]:
    """The fenced blocks of a page in these languages ("": no language given), in order."""
    blocks: list[str] = []
    current: list[str] | None = None
    language = ""
    for line in text.splitlines(keepends=True):
        fence = re.match(r"^ *```(\w*)\s*$", line)
        if fence and current is None:
            current, language = [], fence.group(1)
        elif fence and current is not None:
            if language in languages:
                blocks.append("".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def command_lines(block: str) -> list[str]:
    """The `vllm-cache-exporter ...` commands of a block, continuation lines joined, without
    the prompt, a trailing comment, a pipe, a redirection or a trailing `&`."""
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = []
    for line in joined.splitlines():
        line = line.strip().removeprefix("$ ")
        if not line.startswith("vllm-cache-exporter"):
            continue
        line = re.split(r"\s+#\s", line, maxsplit=1)[0]
        line = re.split(r"\s[|>&]", line + " ", maxsplit=1)[0]
        commands.append(line.strip())
    return commands


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for block in code_blocks(page.read_text(encoding="utf-8")):
            for command in command_lines(block):
                found.append((page.relative_to(ROOT).as_posix(), command))
    return found


def test_every_fence_is_a_line_of_its_own():
    """A code fence with text after it (```` ``` When stdout is ````) is no fence: the block
    runs on into the prose, and the examples after it are read as prose."""
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```"):
                assert re.match(r"^ *```\w*\s*$", line), f"{page.name}:{number}: {line}"


def test_the_docs_show_commands():
    """The walk finds the commands (so the test below cannot pass by finding none)."""
    pages = {page for page, _ in documented_commands()}
    assert {
        "README.md",
        "docs/usage.md",
        "docs/demo.md",
        "docs/monitoring.md",
        "docs/security.md",
        "docs/deployment.md",
    } <= pages


@pytest.mark.parametrize("page, command", documented_commands())
def test_every_documented_command_line_is_accepted(page, command):
    """Every flag of the command exists for that command and every value passes its check
    (what the process would do before anything else; a file it names need not exist)."""
    argv = shlex.split(command)[1:]
    if "..." in argv:  # "vllm-cache-exporter ... --tap.key-alias": the flag alone
        argv = [argv[0] if argv[0] != "..." else RUN, *(word for word in argv[1:] if word != "...")]
    try:
        args = parse(argv)
    except SystemExit as err:
        pytest.fail(f"{page}: `{command}` is refused by the command line (exit {err.code})")
    resolve(args.command, args, environ={})


# ---- POST /v1/usage, against a real exporter process -----------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.asynccontextmanager
async def running_exporter(token: str = "") -> AsyncIterator[str]:
    """`vllm-cache-exporter` as a process on a free port (with a bearer token, if given)."""
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_EXPORTER_USAGE_INGEST_TOKEN": token}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "exporter",
        "--web.listen-address",
        f"127.0.0.1:{port}",
        "--log.level",
        "warning",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while True:  # no event to await across processes: poll readiness with a deadline
                try:
                    async with session.get(f"{url}/-/ready") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                assert process.returncode is None, "the exporter exited"
                assert loop.time() < deadline, "exporter never ready"
                await asyncio.sleep(0.1)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        _out, errors = await asyncio.wait_for(process.communicate(), timeout=20)
    assert process.returncode == 0, errors.decode()


async def post(url: str, path: str, body: bytes, token: str = "") -> tuple[int, object]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}{path}", data=body, headers=headers) as response:
            return response.status, await response.json()


async def run_shell(command: str, cwd: Path, url: str) -> str:
    shell = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        command.replace(DOC_URL, url),
        cwd=cwd,
        env={**os.environ, "TOKEN": TOKEN},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, errors = await asyncio.wait_for(shell.communicate(), 30)
    assert shell.returncode == 0, errors.decode()
    return out.decode()


def post_example() -> tuple[str, bytes, dict[str, object]]:
    """The "### POST /v1/usage" console block: the command (its heredoc included), the body
    it sends, and the reply it shows."""
    section = USAGE.split("### POST /v1/usage", 1)[1]
    block = code_blocks(section)[0]
    command, _, rest = block.removeprefix("$ ").partition("<<'NDJSON'\n")
    body, _, reply = rest.partition("NDJSON\n")
    return f"{command}<<'NDJSON'\n{body}NDJSON\n", body.encode(), json.loads(reply)


async def test_the_post_example_gets_the_reply_docs_usage_md_shows(tmp_path):
    """The NDJSON example, with the token it sends: one accepted, the negative one rejected
    with the reason, message and line shown."""
    command, body, shown = post_example()
    async with running_exporter(TOKEN) as url:
        status, reply = await post(url, "/v1/usage", body, TOKEN)
        assert (status, reply) == (200, shown)
        if shutil.which("curl"):  # the command itself, as the reader pastes it
            assert json.loads(await run_shell(command, tmp_path, url)) == shown


async def test_the_native_record_example_is_accepted():
    """docs/usage.md's native record, every field of it set, is one accepted event."""
    block = USAGE.split("**The native record**", 1)[1].split("```json\n", 1)[1].split("```")[0]
    async with running_exporter() as url:
        status, reply = await post(url, "/v1/usage", block.encode())
    assert (status, reply) == (200, {"accepted": 1, "rejected": 0, "errors": []})


async def test_the_openai_examples_are_accepted_as_posted(tmp_path):
    """The four `?format=openai` records, posted as NDJSON, and the jq one-liner for a
    proxy that keeps the upstream body (fed the first record's response body; it sends no
    token, so to an exporter without one)."""
    block = USAGE.split("One record of each")[1].split("```json\n", 1)[1].split("```")[0]
    section = USAGE.split("Easiest for a home-grown proxy", 1)[1]
    command = re.sub(r"\\\n\s*", " ", code_blocks(section)[0].strip().removeprefix("$ "))
    first = json.loads(block.splitlines()[0])
    (tmp_path / "response.json").write_text(json.dumps(first["response"]), encoding="utf-8")
    async with running_exporter() as url:
        status, reply = await post(url, "/v1/usage?format=openai", block.encode())
        assert (status, reply) == (200, {"accepted": 4, "rejected": 0, "errors": []})
        if not (shutil.which("curl") and shutil.which("jq")):
            pytest.skip("the jq example needs jq and curl")
        answer = json.loads(await run_shell(command, tmp_path, url))
    assert answer == {"accepted": 1, "rejected": 0, "errors": []}


async def test_the_native_record_posted_by_hand_is_no_live_conversation():
    """docs/usage.md's native record (91,070 prompt tokens, session conv-42), posted by hand
    as a test, stamped now: one request alone, and the same sent again, is no conversation,
    so it adds nothing to the live demand the KV-fit signal and its alert compare with the
    pool. Its follow-up (a longer prompt in the same session) is one."""
    block = USAGE.split("**The native record**", 1)[1].split("```json\n", 1)[1].split("```")[0]
    record = json.loads(block)
    record.pop("time")  # as a reader trying it now would: the event is live
    body = json.dumps(record).encode()
    model = {"model": "qwen3.8-27b"}
    async with running_exporter() as url:
        for _ in range(2):
            assert await post(url, "/v1/usage", body) == (
                200,
                {"accepted": 1, "rejected": 0, "errors": []},
            )
            metrics = await get_text(f"{url}/metrics")
            assert value(metrics, "vllm_cache_conversations_active", **model) == 0
            assert value(metrics, "vllm_cache_conversations_demand_tokens", **model) == 0
        follow_up = {**record, "prompt_tokens": record["prompt_tokens"] + 2_300}
        await post(url, "/v1/usage", json.dumps(follow_up).encode())
        metrics = await get_text(f"{url}/metrics")
        assert value(metrics, "vllm_cache_conversations_active", **model) == 1


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        return await response.text()
