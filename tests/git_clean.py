"""A pytest plugin: the suite leaves the checkout as it found it.

Tests write into their temporary folders; installers' logs and caches are git-ignored. A run
that leaves an untracked, unignored file in the repository fails, naming the files, so that
`git status` stays clean after `python -m pytest` (CI checks the same once more after the
run, in .ci/run). Files that were already untracked when the run started are the developer's
own and are left out. Loaded from tests/conftest.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_BEFORE = pytest.StashKey[frozenset[str]]()


def untracked() -> frozenset[str] | None:
    """Untracked, unignored paths, or None outside a git checkout."""
    if not (REPO / ".git").exists():
        return None
    result = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all", "-z"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode != 0:
        return None
    return frozenset(entry[3:] for entry in result.stdout.split("\0") if entry.startswith("?? "))


def pytest_sessionstart(session: pytest.Session) -> None:
    found = untracked()
    if found is not None:
        session.stash[_BEFORE] = found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.stash.get(_BEFORE, None)
    if before is None or session.config.option.collectonly:
        return
    after = untracked() or frozenset()
    left = sorted(after - before)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = (
        "the test run left untracked files in the checkout (tests must write into "
        "their tmp_path; tools' logs belong in .gitignore): " + ", ".join(left)
    )
    if reporter is not None:
        reporter.write_line(message, red=True, bold=True)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
