"""A venv with the real client libraries agents use, exactly pinned, created once and reused.

Where: ``VLLM_CACHE_EXPORTER_CLIENTS_VENV``, else ``<repo>/.venv-clients`` (git-ignored); the
install log is ``<venv>-install.log`` beside it (git-ignored too). What: the ``openai`` and
``anthropic`` Python SDKs at the versions below (about 60 MB with httpx and pydantic; 20-40
s). The clients run in their own interpreter, as an agent does (``tests/clients/agent.py``):
their dependency pins never meet the exporter's, and the test's process only serves the
exporter and the tap. A venv that already has exactly these versions is reused.

Run ``python -m tests.clients.bootstrap`` to prepare it ahead of a test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

OPENAI_VERSION = "3.57.0"
ANTHROPIC_VERSION = "2.15.0"
REQUIREMENTS = (f"openai=={OPENAI_VERSION}", f"anthropic=={ANTHROPIC_VERSION}")
ENV_VAR = "VLLM_CACHE_EXPORTER_CLIENTS_VENV"
REPO = Path(__file__).resolve().parents[2]
APPROXIMATE_SIZE = "60 MB"
APPROXIMATE_SECONDS = 30
INSTALL_TIMEOUT_SECONDS = 900

_CHECK = f"""
import importlib.metadata as metadata
assert metadata.version("openai") == {OPENAI_VERSION!r}, metadata.version("openai")
assert metadata.version("anthropic") == {ANTHROPIC_VERSION!r}, metadata.version("anthropic")
"""


class BootstrapError(RuntimeError):
    pass


def venv_dir() -> Path:
    return Path(os.environ.get(ENV_VAR) or REPO / ".venv-clients")


def install_log(venv: Path) -> Path:
    return venv.parent / f"{venv.name}-install.log"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_ready(venv: Path) -> bool:
    python = venv_python(venv)
    if not python.exists():
        return False
    result = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True,
                            timeout=120)
    return result.returncode == 0


def _run(command: list[str], log: Path, what: str) -> None:
    with log.open("a", encoding="utf-8") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        try:
            result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT,
                                    timeout=INSTALL_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            raise BootstrapError(f"{what} did not finish in {INSTALL_TIMEOUT_SECONDS} s; "
                                 f"see {log}") from None
    if result.returncode != 0:
        tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-40:])
        raise BootstrapError(f"{what} failed (exit {result.returncode}); last lines of {log}:"
                             f"\n{tail}")


def ensure_clients(venv: Path | None = None, announce: Callable[[str], None] = print) -> Path:
    """The python of a ready clients venv, installing it first (and saying so) if needed."""
    venv = venv or venv_dir()
    if is_ready(venv):
        return venv_python(venv)
    log = install_log(venv)
    announce(f"installing {' '.join(REQUIREMENTS)} into {venv} (about {APPROXIMATE_SIZE}, "
             f"{APPROXIMATE_SECONDS} s, once); log: {log}")
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"bootstrapping {venv} for {' '.join(REQUIREMENTS)}\n",
                       encoding="utf-8")
    except OSError as err:
        raise BootstrapError(f"cannot write {log}: {err.strerror}") from None
    python = venv_python(venv)
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], log, "creating the venv")
    _run([str(python), "-m", "pip", "install", "--disable-pip-version-check", *REQUIREMENTS],
         log, "pip install " + " ".join(REQUIREMENTS))
    if not is_ready(venv):
        check = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True)
        raise BootstrapError(f"{venv} is still not usable after installing:\n{check.stderr}")
    return python


def main() -> int:
    try:
        print(ensure_clients())
    except BootstrapError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
