"""The compose stack overlaps the rest of the suite (tests/deploy/compose_stack.py).

When the session selects a test of test_compose_up.py that uses its ``stack`` fixture (the
``compose`` mark not deselected), the stack's start begins in the background as soon as
collection is done, that module runs last, and test_stack_without_docker.py, which publishes
the same fixed ports on 127.0.0.1, runs first; the start runs ``docker compose up`` once it is
done. Nothing starts otherwise (``pytest tests/usage``, ``-m "not compose"``,
``--collect-only``). The session's end stops and removes whatever is still there, also when
it is interrupted (Ctrl-C, or SIGTERM, which the start turns into the same interrupt).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.deploy import compose_stack

HERE = Path(__file__).resolve().parent
COMPOSE_UP = HERE / "test_compose_up.py"
SAME_PORTS = HERE / "test_stack_without_docker.py"  # compose.yaml's ports, without Docker
_WAITING_FOR = pytest.StashKey[set[str]]()  # node ids of SAME_PORTS still to run
_SIGTERM = pytest.StashKey[Any]()  # the handler the start replaced


def uses_stack(item: pytest.Item) -> bool:
    return item.path == COMPOSE_UP and "stack" in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.option.collectonly or not any(uses_stack(item) for item in items):
        return
    first = [item for item in items if item.path == SAME_PORTS]
    last = [item for item in items if item.path == COMPOSE_UP]
    rest = [item for item in items if item.path not in (SAME_PORTS, COMPOSE_UP)]
    items[:] = first + rest + last


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    if config.option.collectonly or not any(uses_stack(item) for item in session.items):
        return
    start = compose_stack.StackStart(config._tmp_path_factory.mktemp("engine"))  # type: ignore[attr-defined]
    waiting = {item.nodeid for item in session.items if item.path == SAME_PORTS}
    config.stash[_WAITING_FOR] = waiting
    if not waiting:
        start.ports_free.set()
    config.stash[compose_stack.KEY] = start
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        config.stash[_SIGTERM] = signal.signal(signal.SIGTERM, _interrupt)
    start.start()


def _interrupt(signum: int, _frame: object) -> None:
    """SIGTERM as Ctrl-C: pytest then ends the session, and the stack is taken down."""
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    """Once the last test that binds the stack's ports is done (its fixtures torn down), the
    start may run `docker compose up`."""
    try:
        return (yield)
    finally:
        waiting = item.config.stash.get(_WAITING_FOR, None)
        if waiting:
            waiting.discard(item.nodeid)
            if not waiting:
                item.config.stash[compose_stack.KEY].ports_free.set()


@pytest.hookimpl(tryfirst=True)  # before tests/git_clean.py looks at the checkout
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    start = config.stash.get(compose_stack.KEY, None)
    if start is None:
        return
    try:
        start.close()
    except Exception as err:  # noqa: BLE001 (reported as the session's failure)
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"taking the compose stack down failed: {err}", red=True, bold=True)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    finally:
        if _SIGTERM in config.stash:
            signal.signal(signal.SIGTERM, config.stash[_SIGTERM])
