"""--web.config.file and --tap.web-config.file through the real configuration and runtime:
flags, --check-config, and both listeners served with them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from exporter.cli import build_parser, main
from exporter.config import Config, ConfigError, build_config
from exporter.runtime import serve
from tests.helpers import value
from tests.test_run_process import free_port
from tests.web.certs import VALID_UNTIL
from tests.web.test_tls_auth import basic, tls_config, write_config

RELOADS = "vllm_cache_exporter_web_config_reloads_total"
USAGE = {"caller": "agent-1", "model": "tiny-llama", "prompt_tokens": 1396, "cached_tokens": 1376}


def config_from(*argv: str) -> Config:
    parser = build_parser()
    return build_config(parser.parse_args(["run", *argv]), environ={})


def test_flags_env_and_check_config(pki, hash_of, capsys):
    path = write_config(pki, tls_config() + f"basic_auth_users:\n  p: '{hash_of('x')}'\n")
    assert config_from("--web.config.file", path).web_config_file == path
    env = build_config(
        build_parser().parse_args(["run"]), environ={"VLLM_CACHE_EXPORTER_WEB_CONFIG_FILE": path}
    )
    assert env.web_config_file == path
    assert main(["--web.config.file", path, "--check-config"]) == 0
    assert json.loads(capsys.readouterr().out)["web.config.file"] == path


@pytest.mark.parametrize(
    "argv,option,words",
    [
        (["--web.config.file", "{folder}/absent.yml"], "--web.config.file", "cannot read"),
        (
            ["--web.config.file", "{folder}/bad.yml"],
            "--web.config.file",
            "tls_server_config.curve_preferences: not supported",
        ),
        (
            ["--tap.web-config.file", "{folder}/web.yml"],
            "--tap.web-config.file",
            "needs --tap.listen-address",
        ),
        (
            [
                "--tap.listen-address",
                "127.0.0.1:1",
                "--tap.upstream",
                "http://127.0.0.1:2",
                "--tap.web-config.file",
                "{folder}/auth.yml",
            ],
            "--tap.web-config.file",
            "basic_auth_users: not supported on this listener",
        ),
    ],
)
def test_bad_web_configs_are_configuration_errors(pki, hash_of, capsys, argv, option, words):
    write_config(pki, tls_config())
    (pki.folder / "bad.yml").write_text(tls_config("  curve_preferences: [X25519]\n"))
    (pki.folder / "auth.yml").write_text(
        tls_config() + f"basic_auth_users:\n  a: '{hash_of('x')}'\n"
    )
    argv = [arg.format(folder=pki.folder) for arg in argv]
    with pytest.raises(ConfigError) as caught:
        config_from(*argv)
    assert caught.value.field_name == option and words in str(caught.value)
    assert main([*argv, "--check-config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and option in err and words in err


async def wait_listening(port: int, deadline_seconds: float = 20) -> None:
    """The tap starts in the background after ``started``: poll its port, with a deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_seconds
    while True:
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            assert loop.time() < deadline, f"nothing listens on {port}"
            await asyncio.sleep(0.05)
            continue
        writer.close()
        await writer.wait_closed()
        return


@asynccontextmanager
async def running(config: Config) -> AsyncIterator[None]:
    stop, started = asyncio.Event(), asyncio.Event()
    task = asyncio.ensure_future(serve(config, stop=stop, started=started))
    waiting = asyncio.ensure_future(started.wait())
    await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        waiting.cancel()
        task.result()  # raises the reason it did not start
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=20)


async def test_exporter_listener_tls_basic_auth_probes_and_usage_token(pki, hash_of, fake_vllm):
    from tests.web.conftest import client_context

    path = write_config(
        pki, tls_config() + f"basic_auth_users:\n  prometheus: '{hash_of('s3cret')}'\n"
    )
    port = free_port()
    config = config_from(
        "--vllm.url",
        fake_vllm.url,
        "--web.listen-address",
        f"127.0.0.1:{port}",
        "--web.config.file",
        path,
        "--usage.ingest.token",
        "usage-token",
    )
    url = f"https://127.0.0.1:{port}"
    async with running(config), aiohttp.ClientSession() as client:
        context = client_context(pki)

        async def status(method: str, route: str, **kwargs: object) -> int:
            async with client.request(method, url + route, ssl=context, **kwargs) as response:  # type: ignore[arg-type]
                return response.status

        assert await status("GET", "/metrics") == 401
        assert await status("GET", "/", headers=basic("prometheus", "nope")) == 401
        assert await status("GET", "/-/healthy") == 200  # probes stay open
        # /v1/usage answers to its bearer token (one Authorization header cannot hold both).
        assert (
            await status(
                "POST", "/v1/usage", json=USAGE, headers={"Authorization": "Bearer usage-token"}
            )
            == 200
        )
        assert (
            await status("POST", "/v1/usage", json=USAGE, headers=basic("prometheus", "s3cret"))
            == 401
        )
        async with client.get(
            url + "/metrics", ssl=context, headers=basic("prometheus", "s3cret")
        ) as response:
            assert response.status == 200
            text = await response.text()
        assert value(text, RELOADS, listener="web", result="success") == 0
        assert (
            value(
                text,
                "vllm_cache_exporter_tls_certificate_not_after_timestamp_seconds",
                listener="web",
            )
            == VALID_UNTIL.timestamp()
        )
        # SIGHUP reaches the runtime's listener: a reload with no file changed (which the
        # change check would not do) shows in the counter.
        os.kill(os.getpid(), signal.SIGHUP)
        deadline = asyncio.get_running_loop().time() + 10
        while value(text, RELOADS, listener="web", result="success") != 1:
            assert asyncio.get_running_loop().time() < deadline, "SIGHUP did not reload"
            await asyncio.sleep(0.05)  # the handler runs on this loop: let it
            async with client.get(
                url + "/metrics", ssl=context, headers=basic("prometheus", "s3cret")
            ) as response:
                text = await response.text()
    assert value(text, "vllm_cache_usage_events_total", reader="http") == 1  # once, not twice


async def test_tap_serves_tls_from_its_own_web_config(pki, aiohttp_server, fake_vllm):
    from tests.web.conftest import client_context

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny-llama"}]})

    upstream_app = web.Application()
    upstream_app.router.add_get("/v1/models", models)
    upstream = await aiohttp_server(upstream_app, host="127.0.0.1")
    tap_config = Path(pki.folder / "tap.yml")
    tap_config.write_text(
        tls_config("  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n")
        + "http_server_config:\n  headers:\n"
        "    X-Content-Type-Options: nosniff\n"
    )
    tap_port = free_port()
    config = config_from(
        "--vllm.url",
        fake_vllm.url,
        "--web.listen-address",
        f"127.0.0.1:{free_port()}",
        "--tap.listen-address",
        f"127.0.0.1:{tap_port}",
        "--tap.upstream",
        str(upstream.make_url("")),
        "--tap.web-config.file",
        str(tap_config),
    )
    async with running(config), aiohttp.ClientSession() as client:
        await wait_listening(tap_port)
        good = client_context(pki, cert=pki.client_cert, key=pki.client_key)
        async with client.get(f"https://127.0.0.1:{tap_port}/v1/models", ssl=good) as response:
            assert response.status == 200
            assert response.headers["X-Content-Type-Options"] == "nosniff"
            assert (await response.json())["data"][0]["id"] == "tiny-llama"
        with pytest.raises(aiohttp.ClientError):
            async with client.get(f"http://127.0.0.1:{tap_port}/v1/models") as response:
                await response.read()
        with pytest.raises(aiohttp.ClientError):  # no client certificate
            async with client.get(
                f"https://127.0.0.1:{tap_port}/v1/models", ssl=client_context(pki)
            ) as response:
                await response.read()
