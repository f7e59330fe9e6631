"""Make docs/status-page.png again: the status page during report 000's collapse, as Debian's
chromium (headless) draws it 1,000 CSS pixels wide.

The same setup as tests/test_status_page_browser.py, which asserts what this picture shows:
the scenario ``two-agents-collapse`` (vLLM with --enable-per-request-metrics) played in
virtual time, then replayed into a real exporter on a frozen clock up to ``--at`` scenario
seconds (tests/replay.py), its vLLM a stand-in serving the simulator's /metrics as replayed.

Run from the repository root, with the dev dependencies and chromium installed:

    python tools/status_page_screenshot.py            # writes docs/status-page.png
    python tools/status_page_screenshot.py --at 900 --out /tmp/page.png
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from exporter.config import Config  # noqa: E402
from exporter.server import create_app  # noqa: E402
from tests.browser import chromium  # noqa: E402
from tests.replay import replay as replay_scenario  # noqa: E402

SCENARIO = "two-agents-collapse"
WIDTH = 1000


async def start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}/"


async def shoot(at: float, out: Path) -> None:
    body = {"text": ""}

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=body["text"], content_type="text/plain")

    vllm = web.Application()
    vllm.router.add_get("/metrics", metrics)
    vllm_runner, vllm_base = await start(vllm)
    exporter_runner = None
    try:
        config = Config(vllm_url=(vllm_base + "metrics",))
        replay = replay_scenario(SCENARIO, config=config)
        replay.on_scrape = lambda text: body.__setitem__("text", text)
        exporter_runner, base = await start(
            create_app(config, state=replay.state, initial_refresh=False)
        )
        replay.until(at)
        with tempfile.TemporaryDirectory() as profile:
            async with chromium(Path(profile)) as page:
                await page.open(base)
                await page.screenshot(out, width=WIDTH)
    finally:
        if exporter_runner is not None:
            await exporter_runner.cleanup()
        await vllm_runner.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--at",
        type=float,
        default=700.0,
        help="scenario seconds to replay before the picture (default 700: "
        "both agents collapsed, the pair no longer fits)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "status-page.png")
    args = parser.parse_args()
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        print(
            "status_page_screenshot: chromium is not installed (Debian: apt-get install chromium)",
            file=sys.stderr,
        )
        return 2
    asyncio.run(shoot(args.at, args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
