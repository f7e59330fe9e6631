"""A venv holding exact releases of a program the tests run in its own interpreter (the real
vLLM, LiteLLM, the openai and anthropic SDKs), created on first use and reused.

Where: the environment variable the venv names, else ``<repo>/<default name>`` (git-ignored);
the install log is ``<venv>-install.log`` beside it (git-ignored too). A first install says
so before it starts (what, how big, where the log goes), so a first test run does not sit
silent for minutes. A venv whose check passes (the exact versions, the modules the test
needs) is reused as it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.transient import attempted

REPO = Path(__file__).resolve().parents[1]


class BootstrapError(RuntimeError):
    pass


class StepFailed(BootstrapError):
    """A step exited non-zero (a registry's dropped connection among the causes: retried);
    one that ran out of time is a plain BootstrapError (not retried: the budget is spent)."""


def _run(command: list[str], log: Path, what: str, timeout: float) -> None:
    with log.open("a", encoding="utf-8") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        try:
            result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BootstrapError(f"{what} did not finish in {timeout:.0f} s; see {log}") from None
    if result.returncode != 0:
        tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-40:])
        raise StepFailed(f"{what} failed (exit {result.returncode}); last lines of {log}:\n{tail}")


@dataclass(frozen=True)
class PinnedVenv:
    """``requirements`` installed with pip into a venv of their own.

    ``check`` is Python run by the venv's interpreter: it exits 0 when the venv is ready.
    ``then`` are further pip arguments run after the install, each with what it does (vLLM's
    CPU build needs CUDA extras removed). ``size`` and ``seconds`` are what the announcement
    says to expect, as measured on the CI machine class.
    """

    requirements: tuple[str, ...]
    env_var: str
    default_name: str
    check: str
    size: str
    seconds: int
    then: tuple[tuple[tuple[str, ...], str], ...] = ()
    timeout: float = 1800.0

    @property
    def requirement(self) -> str:
        return " ".join(self.requirements)

    def venv_dir(self) -> Path:
        return Path(os.environ.get(self.env_var) or REPO / self.default_name)

    @staticmethod
    def install_log(venv: Path) -> Path:
        return venv.parent / f"{venv.name}-install.log"

    @staticmethod
    def python(venv: Path) -> Path:
        return venv / "bin" / "python"

    def is_ready(self, venv: Path) -> bool:
        python = self.python(venv)
        if not python.exists():
            return False
        result = subprocess.run(
            [str(python), "-c", self.check], capture_output=True, text=True, timeout=120
        )
        return result.returncode == 0

    def ensure(
        self, venv: Path | None = None, announce: Callable[[str], None] = print, hint: str = ""
    ) -> Path:
        """The venv, ready: installed first (and said so) when it is not."""
        venv = venv or self.venv_dir()
        if self.is_ready(venv):
            return venv
        log = self.install_log(venv)
        announce(
            f"installing {self.requirement} into {venv} (about {self.size}, "
            f"{self.seconds} s, once); log: {log}{hint}"
        )
        try:
            venv.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(f"bootstrapping {venv} for {self.requirement}\n", encoding="utf-8")
        except OSError as err:
            raise BootstrapError(f"cannot write {log}: {err.strerror}") from None
        python = self.python(venv)
        if not python.exists():
            _run([sys.executable, "-m", "venv", str(venv)], log, "creating the venv", self.timeout)
        install = [
            str(python),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            # pip's own retries are per connection (5, 15 s); a registry slow for a minute in
            # a download of gigabytes is waited for, and a whole install that still fails is
            # run again (tests/transient.py): pip's cache keeps what had arrived.
            "--retries=10",
            "--timeout=60",
            *self.requirements,
        ]
        what = f"pip install {self.requirement}"
        attempted(
            what,
            lambda: _run(install, log, what, self.timeout),
            log,
            transient=(StepFailed,),
        )
        for arguments, what in self.then:
            _run([str(python), "-m", "pip", *arguments], log, what, self.timeout)
        if not self.is_ready(venv):
            check = subprocess.run([str(python), "-c", self.check], capture_output=True, text=True)
            raise BootstrapError(f"{venv} is still not usable after installing:\n{check.stderr}")
        return venv

    def main(self, argv: Sequence[str] = ()) -> int:
        """``python -m tests.<x>.bootstrap``: prepare the venv ahead of a test run."""
        try:
            print(self.ensure())
        except BootstrapError as err:
            print(err, file=sys.stderr)
            return 1
        return 0
