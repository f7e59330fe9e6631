"""The README's LiteLLM setup, and a real LiteLLM proxy started from it.

The README is the one source: its LiteLLM section holds the proxy's ``config.yaml`` and the
shell lines that start it, between ``<!-- litellm:begin -->`` and ``<!-- litellm:end -->``.
The test takes that YAML as it is and only points its two placeholder URLs at the loopback
simulator and exporter, so a README that stops working fails the test.

Facts this follows, measured with LiteLLM 1.108.7 on the CI machine class: the proxy refuses
to start without a master key; importing it takes 20-70 s on two busy cores; with no network
it retries the remote model cost map for about 10 s unless ``LITELLM_LOCAL_MODEL_COST_MAP``
is set. It runs in its own process group, its log in a file whose tail explains a failure.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / "docs" / "usage.md"  # its LiteLLM section
BEGIN, END = "<!-- litellm:begin -->", "<!-- litellm:end -->"
VLLM_PLACEHOLDER = "http://vllm:8000"
EXPORTER_PLACEHOLDER = "http://vllm-cache-exporter:10123"
BOOT_DEADLINE_SECONDS = 300.0


class LiteLLMFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def readme_section(readme: str | None = None) -> str:
    text = README.read_text(encoding="utf-8") if readme is None else readme
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"the README must hold exactly one {BEGIN} ... {END} section")
    return text.split(BEGIN, 1)[1].split(END, 1)[0]


def _fenced(section: str, language: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)
    if len(blocks) != 1:
        raise ValueError(f"the README's LiteLLM section must hold one ```{language} block")
    return blocks[0]


def readme_config_text(readme: str | None = None) -> str:
    """The LiteLLM ``config.yaml`` exactly as the README shows it."""
    return _fenced(readme_section(readme), "yaml")


_COMMAND = re.compile(r"\$\([^)]*\)")


def _literal(text: str) -> str:
    """``text`` as a replacement string that ``re.sub`` takes literally."""
    return text.replace("\\", "\\\\")


def readme_environment(command_output: dict[str, str], readme: str | None = None) -> dict[str, str]:
    """The variables the README's start-up block exports, each ``$(...)`` in a value replaced
    by ``command_output[NAME]`` (the test's stand-in for ``openssl`` or a secret file)."""
    environment = {}
    for line in _fenced(readme_section(readme), "sh").splitlines():
        found = re.match(r"export ([A-Z_][A-Z0-9_]*)=(.*)", line.strip())
        if not found:
            continue
        name, words = found.group(1), shlex.split(found.group(2), comments=True)
        if len(words) != 1:
            raise ValueError(f"the README's {name} must be one quoted word")
        environment[name] = _COMMAND.sub(_literal(command_output.get(name, "")), words[0])
    return environment


def proxy_config(vllm_url: str, exporter_url: str, readme: str | None = None) -> dict:
    """The README's config with its placeholder URLs pointed at the given servers."""
    text = readme_config_text(readme)
    for placeholder in (VLLM_PLACEHOLDER, EXPORTER_PLACEHOLDER):
        if text.count(placeholder) != 1:
            raise ValueError(f"the README's LiteLLM config must name {placeholder} once")
    text = text.replace(VLLM_PLACEHOLDER, vllm_url).replace(EXPORTER_PLACEHOLDER, exporter_url)
    return yaml.safe_load(text)


class LiteLLMProxy:
    """``litellm --config`` on a loopback port, stopped with its whole process group."""

    def __init__(
        self,
        venv: Path,
        config: dict,
        workdir: Path,
        environment: dict[str, str],
        port: int | None = None,
    ) -> None:
        self.venv = venv
        self.config = config
        self.workdir = workdir
        self.environment_overrides = environment
        self.port = port or free_port()
        self.config_path = workdir / "litellm-config.yaml"
        self.log_path = workdir / "litellm.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.venv / "bin" / "litellm"),
            "--config",
            str(self.config_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                # No network here but the package registries: use the cost map LiteLLM ships.
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "XDG_CACHE_HOME": str(self.workdir / "cache"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.environment_overrides)
        return env

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False), encoding="utf-8")
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                cwd=self.workdir,
                start_new_session=True,
            )

    def wait_ready(self, deadline_seconds: float = BOOT_DEADLINE_SECONDS) -> float:
        """Poll /health/liveliness (LiteLLM offers no readiness event); the seconds it took."""
        assert self.process is not None
        started = time.monotonic()
        while time.monotonic() - started < deadline_seconds:
            if self.process.poll() is not None:
                raise LiteLLMFailed(
                    f"LiteLLM exited with {self.process.returncode} while "
                    f"starting:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health/liveliness", timeout=2) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise LiteLLMFailed(f"LiteLLM not live after {deadline_seconds:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
