"""The suite leaves `git status` clean: a run that leaves a file in the checkout fails and
names it (tests/git_clean.py), and one that does not passes."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.git_clean import REPO

pytestmark = pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout")


def run_pytest(test_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.git_clean",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(test_file.parent),
            str(test_file),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_run_that_leaves_a_file_fails_and_names_it(tmp_path: Path) -> None:
    leftover = REPO / f"leftover-{uuid.uuid4().hex}.txt"
    test_file = tmp_path / "test_leaves.py"
    test_file.write_text(f"def test_leaves():\n    open({str(leftover)!r}, 'w').write('x')\n")
    try:
        result = run_pytest(test_file)
    finally:
        leftover.unlink(missing_ok=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert "the test run left untracked files in the checkout" in result.stdout
    assert leftover.name in result.stdout


def test_a_run_that_writes_into_its_tmp_path_passes(tmp_path: Path) -> None:
    test_file = tmp_path / "test_tidy.py"
    test_file.write_text("def test_tidy(tmp_path):\n    (tmp_path / 'x').write_text('x')\n")
    result = run_pytest(test_file)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "left untracked files" not in result.stdout
