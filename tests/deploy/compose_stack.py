"""The compose stack of tests/deploy/test_compose_up.py, started in the background.

Most of that test's time is a wait for an event, the collapse's page, which the shipped
rules' wall-clock windows put about 12 minutes after the driver starts (the module docstring
there). So when a session selects a test that uses its ``stack`` fixture, tests/deploy/
conftest.py starts a :class:`StackStart` as soon as collection is done and runs the compose
tests last: the rest of the suite runs during the wait. The thread
- installs what is missing, starts the engine (tests/deploy/engine.py), builds the images;
- waits until the tests that publish the same fixed ports on 127.0.0.1 are done
  (tests/deploy/test_stack_without_docker.py, which the conftest runs first: ``ports_free``);
- runs ``docker compose up``, as the fixture used to.

The ports compose publishes are fixed (compose.yaml's), and lie outside the kernel's
ephemeral range, which every ``free_port()`` of the suite draws from (a bind to port 0): the
start refuses to run otherwise, so no other test can be handed one of them.

The module fixture :meth:`joins <StackStart.join>` the start (its error, with the output it
carries, fails the compose tests) and :meth:`closes <StackStart.close>` it after them. When
they never run (an interrupted session, ``-x``), the session's end closes it
(``pytest_sessionfinish`` in the conftest). Closing stops a start still under way, takes the
stack down (its logs first), stops the engine and checks the host is as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import engine as engines
from tests.deploy.helpers import (
    COMPOSE_FILE,
    ROOT,
    active_services,
    compose_environment,
    published_ports,
    resolved_compose,
)
from tests.deploy.stack_checks import port_in_use
from tests.transient import attempted

OVERRIDE = ROOT / "tests" / "deploy" / "compose.images.yaml"
LEFT_OUT = {"grafana"}  # no image for it here (test_compose_up.py's docstring)
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
KEY = pytest.StashKey["StackStart"]()


def model() -> dict[str, Any]:
    return resolved_compose()


def services() -> set[str]:
    return active_services(model()) - LEFT_OUT


def stack_ports() -> list[int]:
    """The host ports the stack's services publish (on 127.0.0.1)."""
    return sorted(
        int(port) for name in services() for _ip, port in published_ports(model()["services"][name])
    )


def ephemeral_ports() -> range:
    """The ports the kernel picks from for a bind to port 0 (Linux's ip_local_port_range)."""
    low, high = EPHEMERAL_RANGE.read_text().split()
    return range(int(low), int(high) + 1)


# --- the stack -------------------------------------------------------------------------------


def _matches(event: dict[str, Any], filters: tuple[str, ...]) -> bool:
    """Whether a Docker event passes ``docker events --filter`` style filters: values of one
    key are alternatives, keys must all hold (an ``event`` value matches ``health_status:
    healthy`` by its part before the colon, as dockerd does)."""
    attributes = event.get("Actor", {}).get("Attributes", {})
    action = event.get("Action") or event.get("status", "")
    by_key: dict[str, list[str]] = {}
    for item in filters:
        key, _, value = item.partition("=")
        by_key.setdefault(key, []).append(value)

    def holds(key: str, value: str) -> bool:
        if key == "event":
            return value in (action, action.split(":")[0])
        if key == "container":
            return str(event.get("id", "")).startswith(value) or attributes.get("name") == value
        if key == "label":
            return value.split("=")[0] in attributes
        raise ValueError(f"filter {key}= is not read back from the recording")

    return all(any(holds(key, value) for value in values) for key, values in by_key.items())


@dataclass
class Stack:
    engine: engines.Engine
    logs: Path
    facts: dict[str, Any] = field(default_factory=dict)
    up_at: float = 0.0  # wall clock, for docker's event and log times

    def compose(
        self, *args: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        binary = shutil.which("docker-compose")
        assert binary
        result = subprocess.run(
            [
                binary,
                "--project-directory",
                str(ROOT),
                "-f",
                str(COMPOSE_FILE),
                "-f",
                str(OVERRIDE),
                *args,
            ],
            cwd=ROOT,
            env=compose_environment(**self.engine.env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        with open(self.logs / "compose.log", "a", encoding="utf-8") as out:
            out.write(
                f"--- docker-compose {' '.join(args)}: {result.returncode}\n"
                f"{result.stdout}{result.stderr}"
            )
        if check:
            assert result.returncode == 0, (
                f"docker-compose {' '.join(args)}:\n{result.stderr[-3000:]}"
            )
        return result

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        return self.engine.inspect(self.container(service))[0]

    def tail(self, service: str, lines: int = 25) -> str:
        """The service's last log lines, for a failure's message."""
        result = self.engine.run("logs", "--tail", str(lines), self.container(service), check=False)
        return f"--- {service}'s last log lines:\n{result.stdout}{result.stderr}"

    def processes(self, service: str) -> list[dict[str, str]]:
        """The container's processes as the host sees them (uid, RSS in KiB, command)."""
        out = self.engine.run("top", self.container(service), "-eo", "pid,uid,rss,args").stdout
        lines = out.splitlines()
        return [
            dict(zip(("pid", "uid", "rss", "args"), line.split(None, 3), strict=True))
            for line in lines[1:]
        ]

    def record_events(self) -> subprocess.Popen[str]:
        """Docker's events from now on, written to ``events.jsonl`` as they happen. dockerd
        keeps only its last 256 events for ``docker events --since`` to replay, and the
        healthchecks' exec events fill that in a minute or two: the compose tests run last,
        so without a recording the health events of ``up`` are gone when they look."""
        self.events_file = self.logs / "events.jsonl"
        out = open(self.events_file, "w", encoding="utf-8")  # the process's stdout
        self.events_from = time.time()
        process = subprocess.Popen(
            [self.engine.docker, "events", "--format", "{{json .}}", "--filter", "type=container"],
            env={**os.environ, **self.engine.env},
            stdout=out,
            text=True,
        )
        out.close()
        return process

    def events(self, since: float, until: float, *filters: str) -> Iterator[dict[str, Any]]:
        """Docker's container events between ``since`` and ``until`` (wall clock) that match
        every filter (``docker events`` syntax: ``event=``, ``container=``, ``label=``), from
        the recording (``record_events``): those past are read back, the rest as they come."""
        path = getattr(self, "events_file", None)
        assert path is not None, "record_events() was not started"
        with open(path, encoding="utf-8") as recording:
            pending = ""
            while True:
                chunk = recording.readline()
                if not chunk or not chunk.endswith("\n"):
                    pending += chunk
                    if time.time() > until + 1:  # the recorder is a second behind at most
                        return
                    time.sleep(0.2)  # another process's file: nothing to await but its growth
                    continue
                line, pending = pending + chunk, ""
                event = json.loads(line)
                stamp = event["timeNano"] / 1e9
                if stamp > until:
                    return
                if stamp >= since and _matches(event, filters):
                    yield event

    def log_lines(self, service: str, since: float, until: float) -> Iterator[tuple[str, str]]:
        """The service's log lines from ``since``, as they are written, until ``until`` (wall
        clock), each with Docker's time. The compose tests run last, so ``until`` may be
        past already: then the lines written by then are read back."""
        args = ["--timestamps", "--since", f"{since:.3f}"]
        if until <= time.time():
            args += ["--until", f"{until:.3f}"]
        else:
            args += ["--follow"]
        lines: queue.Queue[str | None] = queue.Queue()
        with subprocess.Popen(
            [self.engine.docker, "logs", *args, self.container(service)],
            env={**os.environ, **self.engine.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as follow:

            def read() -> None:
                assert follow.stdout is not None
                for line in follow.stdout:
                    lines.put(line.rstrip("\n"))
                lines.put(None)

            threading.Thread(target=read, daemon=True).start()
            try:
                while True:
                    # Following: until ``until``. Reading back: until docker is done (bounded).
                    remaining = until - time.time() if "--follow" in args else 300.0
                    if remaining <= 0:
                        return
                    try:
                        line = lines.get(timeout=remaining)
                    except queue.Empty:
                        return
                    if line is None:
                        return
                    stamp, _, text = line.partition(" ")
                    yield stamp, text
            finally:
                follow.terminate()


def build_images(
    engine: engines.Engine,
    logs: Path,
    facts: dict[str, Any],
    between: Callable[[], None] = lambda: None,
) -> None:
    """The base image, ours and the override's; ``between`` runs before each build."""
    build_log = logs / "build.log"
    # Both fetch from registries (Debian's mirror; PyPI in the exporter's build): a step that
    # fails is tried again (tests/transient.py), its failures in build.log.
    facts["base_image_seconds"] = attempted(
        "mmdebstrap | docker import",
        lambda: engines.import_debian_base(engine, build_log),
        build_log,
    )
    base = {"BASE_IMAGE": engines.BASE_IMAGE}
    ours = model()["services"]["exporter"]
    context = Path(ours["build"]["context"])
    between()
    facts["exporter_build_seconds"] = attempted(
        f"docker build -t {ours['image']}",
        lambda: engines.build_image(
            engine,
            ours["image"],
            context / ours["build"].get("dockerfile", "Dockerfile"),
            context,
            base,
            build_log,
        ),
        build_log,
    )
    empty = logs / "empty-context"
    empty.mkdir()
    for name, image in override_images().items():
        between()
        facts[f"{name}_build_seconds"] = attempted(
            f"docker build -t {image}",
            lambda name=name, image=image: engines.build_image(
                engine, image, engines.IMAGES_DIR / f"{name}.Dockerfile", empty, base, build_log
            ),
            build_log,
        )
    for name, image in {
        "base": engines.BASE_IMAGE,
        "exporter": ours["image"],
        **override_images(),
    }.items():
        facts[f"{name}_image_bytes"] = engines.image_size(engine, image)


def override_images() -> dict[str, str]:
    override = yaml.safe_load(OVERRIDE.read_text(encoding="utf-8"))
    return {name: svc["image"] for name, svc in override["services"].items()}


# --- started in the background ----------------------------------------------------------------


class Cancelled(Exception):
    """The session ended before the stack was up."""


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    process.wait(timeout=10)


class StackStart:
    """The engine, the images and ``docker compose up`` in a thread of their own."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.logs = root / "logs"
        self.facts: dict[str, Any] = {}
        # Set once no test that binds the stack's fixed ports is still to run.
        self.ports_free = threading.Event()
        self.stack: Stack | None = None
        self.error: BaseException | None = None
        self._engine: engines.Engine | None = None
        self._exit = contextlib.ExitStack()
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._started = 0.0
        self._cpu_at_up = 0.0
        self._thread = threading.Thread(target=self._run, name="compose-stack", daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        try:
            self._bring_up()
        except BaseException as err:  # pytest's skip and fail outcomes too: join re-raises
            self.error = err

    def _check_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise Cancelled("the session ended before the compose stack was up")

    def _bring_up(self) -> None:
        engines.require(sys.platform == "linux", "Docker's engine runs on Linux")
        ports = stack_ports()
        drawn = [port for port in ports if port in ephemeral_ports()]
        engines.require(
            not drawn,
            f"127.0.0.1:{drawn}, which the compose stack publishes, "
            f"are in the kernel's ephemeral range ({EPHEMERAL_RANGE}): another "
            "test's free port could be one of them",
        )
        self.logs.mkdir(parents=True)
        self.facts["install_seconds"] = engines.ensure_installed(self.logs / "apt.log")
        self._check_cancelled()
        engine = self._engine = self._exit.enter_context(engines.running_engine(self.root))
        self._check_cancelled()
        build_images(engine, self.logs, self.facts, between=self._check_cancelled)
        waited = time.monotonic()
        while not self.ports_free.wait(timeout=1):
            self._check_cancelled()
        self.facts["waited_for_fixed_port_tests_seconds"] = round(time.monotonic() - waited, 1)
        self._check_cancelled()
        taken = [port for port in ports if port_in_use(port)]
        engines.require(not taken, f"127.0.0.1:{taken} in use: the compose stack publishes them")
        stack = Stack(engine, self.logs, self.facts)
        self._exit.callback(self._down, stack)
        recorder = stack.record_events()
        self._exit.callback(_stop, recorder)
        stack.up_at = time.time()
        self._cpu_at_up = engine.container_cpu_seconds() or 0.0  # the builds' (their cgroups)
        self.facts["up_after_session_start_seconds"] = round(time.monotonic() - self._started)
        started = time.monotonic()
        # `up` returns once the driver has started, which waits for the exporter and the
        # simulator to be healthy (depends_on: service_healthy).
        stack.compose("up", "-d", "--no-build", *sorted(services()))
        self.facts["up_seconds"] = time.monotonic() - started
        self.stack = stack

    def _down(self, stack: Stack) -> None:
        used = stack.engine.container_cpu_seconds()
        self.facts["stack_cpu_seconds"] = None if used is None else round(used - self._cpu_at_up, 1)
        self.facts["stack_wall_seconds"] = round(time.time() - stack.up_at)
        stack.compose("logs", "--no-color", "--timestamps", check=False)
        stack.compose("down", "--volumes", "--remove-orphans", "--timeout", "10", check=False)

    def join(self) -> Stack:
        """The stack, once up; the start's error otherwise (the thread's frames in it)."""
        self._thread.join()
        if isinstance(self.error, AssertionError):
            raise AssertionError(
                f"starting the compose stack (in the background since the "
                f"session began) failed: {self.error}\n"
                f"(its logs: {self.logs})"
            ) from self.error
        if self.error is not None:
            raise self.error
        assert self.stack is not None
        return self.stack

    def close(self) -> None:
        """Once, from the main thread: stop a start under way, take the stack down, stop the
        engine; raises what the engine left changed on the host (running_engine)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():
            self._cancelled.set()
            # Whatever docker command the start is in fails at once without its daemon (the
            # engine's own cleanup copes with a daemon already gone); apt-get is waited for.
            engine = self._engine
            if engine is not None and engine.process is not None:
                engine.process.terminate()
            self._thread.join()
        try:
            self._exit.close()
        finally:
            if self._engine is not None:
                self.facts.update(self._engine.facts)
            self.facts.pop("interfaces_before", None)
            print("\ncompose stack facts:", json.dumps(self.facts, sort_keys=True))


def started(config: pytest.Config, root: Callable[[], Path]) -> StackStart:
    """The session's start (tests/deploy/conftest.py's), or one started now if there is none
    (then no fixed-port test is left to wait for: the conftest orders those first)."""
    start = config.stash.get(KEY, None)
    if start is None:
        start = config.stash[KEY] = StackStart(root())
        start.ports_free.set()
        start.start()
    return start
