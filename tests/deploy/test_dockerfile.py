"""The image, checked without a Docker engine: what it is built from, who it runs as, what it
leaves behind, and that its entry point and HEALTHCHECK really work, run here as the
container would run them. (tests/deploy/test_compose_up.py builds and runs it for real.)
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.deploy import dockerfile
from tests.deploy.helpers import K8S_DIR, ROOT, build_context_files

tomllib = pytest.importorskip("tomllib")  # Python 3.11+, as in CI

DOCKERFILE = ROOT / "Dockerfile"
STAGES = dockerfile.parse(DOCKERFILE)
FINAL = STAGES[-1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PINNED_PYTHON = re.compile(r"^python:3\.11\.\d+-slim(?:-[a-z]+)?$")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def final_env() -> dict[str, str]:
    """ENV of the final stage (KEY=VALUE form), as the container starts with it."""
    env: dict[str, str] = {}
    for instruction in FINAL.all("ENV"):
        for word in instruction.words:
            key, sep, value = word.partition("=")
            assert sep, f"ENV {instruction.text!r}: use the KEY=VALUE form"
            env[key] = value
    return env


def test_every_stage_builds_from_the_same_base_by_default_the_pinned_slim_python():
    stage_names = {stage.name for stage in STAGES if stage.name}
    external = [stage for stage in STAGES if stage.base not in stage_names]
    assert external, "no FROM"
    for stage in external:
        assert PINNED_PYTHON.match(stage.base), f"FROM {stage.base}: pin python:3.11.<patch>-slim"
    # One build argument chooses the base of every stage, so the venv the first builds
    # finds the same interpreter in the last (another Debian-like base with python3 works:
    # tests/deploy/test_compose_up.py builds on Debian's own).
    assert {stage.base_text for stage in external} == {"${BASE_IMAGE}"}, [
        stage.base_text for stage in external
    ]
    assert dockerfile.build_args(DOCKERFILE)["BASE_IMAGE"] == external[0].base


def test_build_stage_runs_python3_which_every_base_has():
    """Debian's python3 package has no ``python`` command; the venv's has, for the rest."""
    runs = " ".join(item.text for item in STAGES[0].all("RUN"))
    assert re.search(r"\bpython3 -m venv /opt/venv\b", runs), runs
    assert not re.search(r"(^|[\s;&])python -m", runs), runs


def test_final_stage_runs_as_the_unprivileged_user_kubernetes_expects():
    user = FINAL.last("USER")
    assert user is not None, "final stage has no USER: the exporter would run as root"
    uid, _, gid = user.text.partition(":")
    assert uid not in ("root", "0") and gid not in ("root", "0")
    assert uid.isdigit(), "a numeric USER lets Kubernetes' runAsNonRoot verify it"
    created = " ".join(item.text for item in FINAL.all("RUN"))
    assert re.search(rf"useradd\b[^&]*--uid {uid}\b", created), "USER uid is never created"
    # The sidecar's securityContext must name the same uid, or the pod runs as another one.
    deployment = yaml.safe_load((K8S_DIR / "deployment.yaml").read_text(encoding="utf-8"))
    sidecar = next(
        c
        for c in deployment["spec"]["template"]["spec"]["containers"]
        if c["name"] == "vllm-cache-exporter"
    )
    assert str(sidecar["securityContext"]["runAsUser"]) == uid


def test_no_build_tools_or_caches_reach_the_image():
    for stage in STAGES:
        stage_env = " ".join(item.text for item in stage.all("ENV"))
        for run in stage.all("RUN"):
            if "pip install" in run.text:
                assert "--no-cache-dir" in run.text or "PIP_NO_CACHE_DIR=1" in stage_env, (
                    f"RUN {run.text!r} keeps pip's cache in the layer"
                )
    final_runs = " ".join(item.text for item in FINAL.all("RUN"))
    for tool in ("pip install", "apt-get install", "apk add", "gcc", "build-essential"):
        assert tool not in final_runs, f"final stage installs with {tool!r}"
    if len(STAGES) > 1:
        # Multi-stage: the final stage takes only the built virtualenv from the build stage.
        copies = [item for item in FINAL.all("COPY") if "from" in item.flags]
        assert copies, "final stage copies nothing from the build stage"
        for copy in copies:
            assert copy.words == ["/opt/venv", "/opt/venv"], copy.text


def test_entrypoint_is_the_console_script():
    entrypoint = FINAL.last("ENTRYPOINT")
    assert entrypoint is not None and entrypoint.exec_form() == ["vllm-cache-exporter"]
    assert "vllm-cache-exporter" in PYPROJECT["project"]["scripts"]
    cmd = FINAL.last("CMD")
    assert cmd is not None and cmd.exec_form() == ["run"]


def test_healthcheck_probes_healthy_with_the_images_own_python():
    check = FINAL.last("HEALTHCHECK")
    assert check is not None, "no HEALTHCHECK"
    argv = check.exec_form(check.text[check.text.index("CMD") + 3 :])
    assert argv is not None and argv[0] == "python", "exec form with python: no curl needed"
    assert "/-/healthy" in argv[-1]


def test_the_build_context_holds_the_package_and_nothing_else():
    context = build_context_files()
    for stage in STAGES:
        for copy in stage.all("COPY"):
            if "from" in copy.flags:
                continue
            for source in copy.words[:-1]:
                assert source in context or any(
                    f.startswith(source.rstrip("/") + "/") for f in context
                ), f"COPY {source}: not in context"
    assert "pyproject.toml" in context and PYPROJECT["project"]["readme"] in context
    package = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "exporter").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert package <= context, f"package files left out: {sorted(package - context)}"
    stray = [path for path in context if path.startswith(("tests/", ".git/", ".venv", "bench/"))]
    assert stray == [], f"not needed in the image: {stray[:5]}"


def console_script() -> list[str]:
    script = Path(sys.executable).parent / "vllm-cache-exporter"
    return [str(script)] if script.exists() else [sys.executable, "-m", "exporter"]


async def run_healthcheck(env: dict[str, str]) -> int:
    check = FINAL.last("HEALTHCHECK")
    assert check is not None
    argv = check.exec_form(check.text[check.text.index("CMD") + 3 :])
    assert argv is not None
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv[1:],
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    return await asyncio.wait_for(process.wait(), timeout=30)


async def test_container_command_serves_and_its_healthcheck_follows_the_port():
    """ENTRYPOINT + CMD with the image's ENV, on a free loopback port instead of 0.0.0.0."""
    env = final_env()
    assert env.get("VLLM_CACHE_EXPORTER_WEB_LISTEN_ADDRESS", "").startswith("0.0.0.0:")
    port = free_port()
    env = {key: value for key, value in env.items() if key != "PATH"}
    env.update(
        PATH=str(Path(sys.executable).parent),
        VLLM_CACHE_EXPORTER_WEB_LISTEN_ADDRESS=f"127.0.0.1:{port}",
    )
    cmd = FINAL.last("CMD")
    assert cmd is not None
    process = await asyncio.create_subprocess_exec(
        *console_script(),
        *(cmd.exec_form() or []),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with aiohttp.ClientSession() as session:
            deadline = asyncio.get_running_loop().time() + 30
            while True:  # another process: no event to await, poll with a deadline
                try:
                    async with session.get(f"http://127.0.0.1:{port}/-/healthy") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                if process.returncode is not None:
                    pytest.fail(f"exited {process.returncode}: {await process.stderr.read()!r}")
                assert asyncio.get_running_loop().time() < deadline, "never healthy"
                await asyncio.sleep(0.1)
        assert await run_healthcheck(env) == 0
    finally:
        process.send_signal(signal.SIGTERM)
        _out, err = await asyncio.wait_for(process.communicate(), timeout=20)
    assert process.returncode == 0, err.decode()
    # Nothing listens any more: the same probe must now report the container unhealthy.
    assert await run_healthcheck(env) != 0
