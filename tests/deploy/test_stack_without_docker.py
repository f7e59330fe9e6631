"""docs/deployment.md "Run the stack without Docker", run as it is written: its first block
starts the stack (Debian's Prometheus and Alertmanager on the shipped deploy/ files, the
simulator, the exporter, the alert logger, the driver), its second sends a test page
through Alertmanager.
The checks are the compose test's, the collapse aside (its page takes a quarter of an hour,
which tests/deploy/test_compose_up.py spends once): every scrape target up, every shipped
rule loaded and healthy, Alertmanager found, the exporter on 127.0.0.1, the page delivered.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.helpers import (
    ROOT,
    command_args,
    flag_value,
    published_ports,
    require_tool,
    resolved_compose,
)
from tests.deploy.stack_checks import (
    EXPORTER,
    PROMETHEUS,
    api,
    assert_every_shipped_rule_is_loaded_and_healthy,
    evaluated_rules,
    eventually,
    first_evaluations_within,
    http_get,
    listening_addresses,
    parse_alert,
    port_in_use,
    prometheus_jobs,
    scrape_targets_up,
)

pytestmark = pytest.mark.e2e

SECTION = "### Run the stack without Docker"
PORTS = (8000, 8001, 8080, 9090, 9093, 10123)


def readme_blocks() -> list[str]:
    readme = (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, flags=re.S)


def test_the_section_starts_what_compose_starts():
    """Checked without running anything: the same commands and ports as compose.yaml's."""
    start, check = readme_blocks()
    model = resolved_compose()["services"]
    for name in ("simulator", "exporter", "driver"):
        assert f"vllm-cache-exporter {command_args(model[name])[0]} " in start, name
    scenario = flag_value(command_args(model["simulator"]), "--scenario")
    assert start.count(f"--scenario {scenario} ") == 2, "the simulator's and the driver's"
    published = {
        int(port)
        for name, svc in model.items()
        if name != "grafana"
        for _ip, port in published_ports(svc)
    }
    assert published <= set(PORTS) and all(f"127.0.0.1:{port}" in start for port in PORTS)
    assert "amtool alert add" in check


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    for tool in ("prometheus", "prometheus-alertmanager", "amtool"):
        require_tool(tool)
    taken = [port for port in PORTS if port_in_use(port)]
    if taken:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"127.0.0.1:{taken} in use")
    start, _check = readme_blocks()
    output = tmp_path / "stack.log"
    env = {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    with open(output, "w", encoding="utf-8") as out:
        shell = subprocess.Popen(
            ["bash", "-e", "-c", start],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    try:
        yield shell, output
    finally:
        os.killpg(shell.pid, signal.SIGTERM)
        try:
            shell.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait(timeout=10)
        # Every process of the block, not only the shell: the group must be gone.
        deadline = time.monotonic() + 20
        while group_alive(shell.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_alive(shell.pid):
            os.killpg(shell.pid, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_readme_stack_is_wired_and_pages(stack: tuple[subprocess.Popen[str], Path]):
    shell, output = stack

    def alive() -> None:
        if shell.poll() is not None:
            pytest.fail(
                f"the docs/deployment.md block exited {shell.returncode}:\n{output.read_text()}"
            )

    alive()
    start, check = readme_blocks()
    # The block's sed: compose's service names -> this machine's ports.
    rewrite = dict(re.findall(r"s/([\w.-]+:\d+)/([\w.-]+:\d+)/", start))
    assert set(rewrite) >= {target for targets in prometheus_jobs().values() for target in targets}
    eventually(scrape_targets_up(rewrite), 90, "every scrape target up")
    assert_every_shipped_rule_is_loaded_and_healthy(
        eventually(evaluated_rules, first_evaluations_within(), "every rule evaluated once")
    )
    eventually(
        lambda: api(f"{PROMETHEUS}/api/v1/alertmanagers")["activeAlertmanagers"] or None,
        60,
        "Prometheus discovering Alertmanager",
    )
    for port in (10123, 9090, 9093):
        assert listening_addresses(port) == {"127.0.0.1"}, port
    # The test page goes out now; Alertmanager holds it group_wait (30 s) meanwhile.
    result = subprocess.run(
        ["bash", "-e", "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The driver's reports arrive (its first turn, a cold 75k-token prompt, takes a minute).
    eventually(
        lambda: "agent-a" in http_get(f"{EXPORTER}/metrics")[2] or None,
        180,
        "agent-a's usage reaching the exporter",
    )
    status, _type, page = http_get(f"{EXPORTER}/")
    assert status == 200 and "agent-a" in page
    line = eventually(
        lambda: next(
            (
                line
                for line in output.read_text().splitlines()
                if line.startswith("page FIRING VllmCacheTestPage")
            ),
            None,
        ),
        90,
        "the test page in the alert logger's output",
    )
    alert = parse_alert(line)
    assert alert and alert["labels"] == {"severity": "critical"}, line
    alive()
