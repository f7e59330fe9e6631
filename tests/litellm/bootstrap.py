"""A venv with the LiteLLM proxy for the end-to-end test, created once and reused.

Where: ``VLLM_CACHE_EXPORTER_LITELLM_VENV``, else ``<repo>/.venv-litellm`` (git-ignored); the
install log is ``<venv>-install.log`` beside it (git-ignored too). What, as measured on the
CI machine class: ``pip install 'litellm[proxy]==1.108.7'``, about 150 s and 760 MB. The proxy
is a program the test starts, never imported by the test's own interpreter: its dependency
pins would fight the exporter's. A venv that already has exactly that version is reused.

Run ``python -m tests.litellm.bootstrap`` to prepare it ahead of a test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

LITELLM_VERSION = "1.108.7"
LITELLM_REQUIREMENT = f"litellm[proxy]=={LITELLM_VERSION}"
ENV_VAR = "VLLM_CACHE_EXPORTER_LITELLM_VENV"
REPO = Path(__file__).resolve().parents[2]
APPROXIMATE_SIZE = "760 MB"
APPROXIMATE_SECONDS = 150
INSTALL_TIMEOUT_SECONDS = 1800

# Checks without importing litellm (its proxy takes 20-60 s to import on two busy cores):
# the distribution and its version, the proxy's server stack, the console script.
_CHECK = f"""
import importlib.metadata as metadata, importlib.util as util
assert metadata.version("litellm") == {LITELLM_VERSION!r}, metadata.version("litellm")
for name in ("litellm", "fastapi", "uvicorn", "httpx", "yaml"):
    assert util.find_spec(name) is not None, name + " missing"
"""


class BootstrapError(RuntimeError):
    pass


def venv_dir() -> Path:
    return Path(os.environ.get(ENV_VAR) or REPO / ".venv-litellm")


def install_log(venv: Path) -> Path:
    return venv.parent / f"{venv.name}-install.log"


def proxy_command(venv: Path) -> Path:
    """The ``litellm`` console script of the venv."""
    return venv / "bin" / "litellm"


def is_ready(venv: Path) -> bool:
    python = venv / "bin" / "python"
    if not (python.exists() and proxy_command(venv).exists()):
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


def ensure_litellm(venv: Path | None = None,
                   announce: Callable[[str], None] = print) -> Path:
    """The venv of a ready LiteLLM proxy, installing it first (and saying so) if needed."""
    venv = venv or venv_dir()
    if is_ready(venv):
        return venv
    log = install_log(venv)
    announce(f"installing {LITELLM_REQUIREMENT} into {venv} (about {APPROXIMATE_SIZE}, "
             f"{APPROXIMATE_SECONDS} s, once); log: {log}")
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"bootstrapping {venv} for {LITELLM_REQUIREMENT}\n", encoding="utf-8")
    except OSError as err:
        raise BootstrapError(f"cannot write {log}: {err.strerror}") from None
    python = venv / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], log, "creating the venv")
    _run([str(python), "-m", "pip", "install", "--disable-pip-version-check",
          LITELLM_REQUIREMENT], log, f"pip install {LITELLM_REQUIREMENT}")
    if not is_ready(venv):
        check = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True)
        raise BootstrapError(f"{venv} is still not usable after installing:\n{check.stderr}")
    return venv


def main() -> int:
    try:
        print(ensure_litellm())
    except BootstrapError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
