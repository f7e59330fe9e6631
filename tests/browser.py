"""Debian's chromium, headless, driven over the DevTools protocol with aiohttp's websocket
client: what a user's browser does with the status page, every request and console message
recorded.

Started with a fresh profile and without the background services (without
--disable-background-networking and friends it calls Google's hosts, which would show up as
requests the page did not make). Skipped locally when chromium is not installed; in CI
(.ci/run installs it) its absence is a failure.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--mute-audio",
    "--remote-debugging-port=0",
)
LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


def chromium_path() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is required in CI (.ci/run installs Debian's chromium)")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    return found


@dataclass
class Page:
    """One tab: send commands, and what it asked for and complained about so far."""

    socket: aiohttp.ClientWebSocketResponse
    requests: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _waiting: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    _loaded: asyncio.Event = field(default_factory=asyncio.Event)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        number = next(self._ids)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[number] = answer
        await self.socket.send_json({"id": number, "method": method, "params": params})
        reply = await asyncio.wait_for(answer, 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def read(self) -> None:
        async for message in self.socket:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = message.json()
            if "id" in data:
                waiting = self._waiting.pop(data["id"], None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(data)
                continue
            self._event(data.get("method", ""), data.get("params", {}))

    def _event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.console_errors.append(repr(params.get("args")))
        elif method == "Runtime.exceptionThrown":
            self.console_errors.append(repr(params.get("exceptionDetails")))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.console_errors.append(params["entry"].get("text", ""))
        elif method == "Page.loadEventFired":
            self._loaded.set()

    async def open(self, url: str) -> None:
        self._loaded.clear()
        await self.send("Page.navigate", url=url)
        await asyncio.wait_for(self._loaded.wait(), 30)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path, width: int) -> None:
        """The whole page at ``width`` CSS pixels, as a PNG."""
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=800,
            deviceScaleFactor=1,
            mobile=False,
        )
        height = await self.evaluate("document.documentElement.scrollHeight")
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=int(height),
            deviceScaleFactor=1,
            mobile=False,
        )
        shot = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def chromium(profile: Path) -> AsyncIterator[Page]:
    """A headless chromium with one blank tab, stopped (and its profile left in ``profile``,
    a tmp path) on the way out."""
    process = await asyncio.create_subprocess_exec(
        chromium_path(),
        *FLAGS,
        f"--user-data-dir={profile}",
        "about:blank",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    reader: asyncio.Task[None] | None = None
    try:
        assert process.stderr is not None
        browser_url = await asyncio.wait_for(_listening(process.stderr), 60)
        port = browser_url.split("/")[2]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{port}/json/list") as response:
                targets = await response.json()
            tab = next(target for target in targets if target["type"] == "page")
            async with session.ws_connect(
                tab["webSocketDebuggerUrl"], max_msg_size=64 * 1024 * 1024
            ) as socket:
                page = Page(socket)
                reader = asyncio.ensure_future(page.read())
                for domain in ("Page", "Network", "Runtime", "Log"):
                    await page.send(f"{domain}.enable")
                yield page
    finally:
        if reader is not None:
            reader.cancel()
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 20)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()


async def _listening(stderr: asyncio.StreamReader) -> str:
    seen = []
    while True:
        line = (await stderr.readline()).decode(errors="replace")
        if not line:
            raise RuntimeError("chromium exited before listening:\n" + "".join(seen[-20:]))
        seen.append(line)
        match = LISTENING.search(line)
        if match:
            # keep draining its stderr, so that chromium never blocks on a full pipe
            asyncio.ensure_future(_drain(stderr))
            return match.group(1)


async def _drain(stderr: asyncio.StreamReader) -> None:
    while await stderr.readline():
        pass
