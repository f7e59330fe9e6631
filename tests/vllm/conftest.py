"""Session fixtures for the real-vLLM tests: the vLLM venv and the tiny model, built once."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.vllm.bootstrap import BootstrapError, ensure_vllm
from tests.vllm.server import VllmServer

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def vllm_python(pytestconfig: pytest.Config) -> Path:
    """The python of a ready vLLM venv; a first install announces itself past pytest's
    capture (what, how big, where its log is), as the LiteLLM one does."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")

    def announce(message: str) -> None:
        with capture.global_and_fixture_disabled():
            print(f"\n{message}", flush=True)

    try:
        return ensure_vllm(announce=announce)
    except BootstrapError as err:
        pytest.fail(f"cannot prepare vLLM for the end-to-end test: {err}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    result = subprocess.run(
        [str(vllm_python), str(HERE / "build_model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        pytest.fail(f"building the tiny model failed:\n{result.stderr[-3000:]}", pytrace=False)
    built = json.loads(result.stdout.strip().splitlines()[-1])
    assert built["vocab"] == 4096
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    setattr(item, "rep_" + report.when, report)


@pytest.fixture
def start_vllm(
    vllm_python: Path, tiny_model: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., VllmServer]]:
    """Start a vLLM with extra flags; stopped after the test, its log tail shown on failure."""
    servers: list[VllmServer] = []

    def start(name: str, *extra_args: str) -> VllmServer:
        server = VllmServer(vllm_python, tiny_model, tmp_path, name, tuple(extra_args))
        servers.append(server)
        server.start()
        took = server.wait_ready()
        print(f"vLLM {name} healthy after {took:.1f}s on {server.url}")
        return server

    yield start
    failed = getattr(request.node, "rep_call", None) is None or request.node.rep_call.failed
    for server in servers:
        server.stop()
        if failed:
            print(f"\n----- last lines of {server.log_path} -----\n{server.log_tail()}")
