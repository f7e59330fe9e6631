"""What the deployment checks share: the repository's paths, the compose model as compose
resolves it, and the rules by which compose picks services and Docker picks context files.

No Docker engine runs on CI machines, so these checks read the files the way the tools do:
``docker-compose config`` resolves variables, anchors and defaults, and the few rules the
tools apply at run time (profiles, mounts, .dockerignore) are reimplemented here, small and
documented, so that a wrong path or a stray service fails a test instead of a user's
``docker compose up``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
COMPOSE_FILE = ROOT / "compose.yaml"
DOTENV = ROOT / ".env"
K8S_DIR = ROOT / "deploy" / "kubernetes"


def require_tool(name: str) -> str:
    """The tool's path; skip locally when it is missing, fail in CI (.ci/run installs it)."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is required in CI (.ci/run installs it)")
        pytest.skip(f"{name} not installed")
    return path


def compose_environment(**overrides: str) -> dict[str, str]:
    """A clean environment: the user's SCENARIO or VLLM_URL must not change what we check."""
    env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG") if key in os.environ}
    env.update(overrides)
    return env


def docker_compose(
    *args: str,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    binary = require_tool("docker-compose")
    return subprocess.run(
        [binary, "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE), *args],
        cwd=ROOT,
        env=dict(env or compose_environment()),
        capture_output=True,
        text=True,
        timeout=120,
    )


@lru_cache(maxsize=8)
def _resolved(overrides: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    result = docker_compose("config", env=compose_environment(**dict(overrides)))
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def resolved_compose(**overrides: str) -> dict[str, Any]:
    """compose.yaml as docker-compose resolves it (variables, anchors, defaults applied)."""
    return _resolved(tuple(sorted(overrides.items())))


def raw_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))


def dotenv() -> dict[str, str]:
    """The project's .env, as compose reads it (KEY=VALUE lines, # comments)."""
    values: dict[str, str] = {}
    for line in DOTENV.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f".env: not KEY=VALUE: {line!r}"
        values[key.strip()] = value.strip()
    return values


def active_services(model: Mapping[str, Any], cli_profiles: Sequence[str] = ()) -> set[str]:
    """The services ``docker compose [--profile P ...] up`` starts.

    Compose (v2's compose-go ``WithDefaultProfiles``, and v1.28+) takes the ``--profile``
    flags when any are given, else COMPOSE_PROFILES from the environment or .env; services
    without ``profiles`` always run.
    """
    profiles = set(cli_profiles) or {
        part.strip() for part in dotenv().get("COMPOSE_PROFILES", "").split(",") if part
    }
    return {
        name
        for name, service in model["services"].items()
        if not service.get("profiles") or profiles & set(service["profiles"])
    }


def network_names(model: Mapping[str, Any], active: Iterable[str]) -> dict[str, list[str]]:
    """Host name on the default network -> the active services that answer to it."""
    names: dict[str, list[str]] = {}
    for name in sorted(active):
        service = model["services"][name]
        aliases = []
        networks = service.get("networks") or {}
        if isinstance(networks, Mapping):
            for network in networks.values():
                aliases.extend((network or {}).get("aliases", []))
        for host in (name, *aliases):
            names.setdefault(host, []).append(name)
    return names


@dataclass(frozen=True)
class Mount:
    source: Path
    target: PurePosixPath
    read_only: bool


def bind_mounts(service: Mapping[str, Any]) -> list[Mount]:
    """Host-path mounts of a resolved service (named volumes are left out)."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            parts = volume.split(":")
            if len(parts) < 2 or not parts[0].startswith(("/", ".")):
                continue
            mounts.append(
                Mount(
                    Path(parts[0]),
                    PurePosixPath(parts[1]),
                    len(parts) > 2 and "ro" in parts[2].split(","),
                )
            )
        elif volume.get("type") == "bind":
            mounts.append(
                Mount(
                    Path(volume["source"]),
                    PurePosixPath(volume["target"]),
                    bool(volume.get("read_only")),
                )
            )
    return mounts


def host_path(service: Mapping[str, Any], container_path: str) -> Path | None:
    """Where a path inside the container comes from on the host, through the bind mounts."""
    wanted = PurePosixPath(container_path)
    best: tuple[int, Path] | None = None
    for mount in bind_mounts(service):
        if wanted == mount.target or mount.target in wanted.parents:
            depth = len(mount.target.parts)
            if best is None or depth > best[0]:
                relative = wanted.relative_to(mount.target)
                source = mount.source if mount.source.is_absolute() else ROOT / mount.source
                best = (depth, source / relative)
    return None if best is None else best[1]


def published_ports(svc: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(host_ip, published port) of every published port, short or long syntax."""
    out = []
    for port in svc.get("ports", []):
        if isinstance(port, Mapping):
            out.append((str(port.get("host_ip", "")), str(port.get("published", ""))))
            continue
        parts = str(port).split("/")[0].split(":")
        host_ip = ":".join(parts[:-2]) if len(parts) >= 3 else ""
        out.append((host_ip, parts[-2] if len(parts) >= 2 else ""))
    return out


def command_args(service: Mapping[str, Any]) -> list[str]:
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """Value of ``--flag=value`` or ``--flag value`` in an argument list (last one wins)."""
    found = None
    for index, arg in enumerate(args):
        if arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
        elif arg == flag and index + 1 < len(args):
            found = args[index + 1]
    return found


# --- .dockerignore ----------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax (Go filepath.Match plus ``**``) as a regex on '/' paths."""
    out = []
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if pattern.startswith("**", index):
            out.append(".*")
            index += 2
            if index < len(pattern) and pattern[index] == "/":
                out[-1] = "(?:.*/)?"
                index += 1
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        else:
            out.append(re.escape(char))
        index += 1
    return re.compile("".join(out) + "$")


@dataclass(frozen=True)
class IgnoreRule:
    negate: bool
    text: str
    regex: re.Pattern[str]

    @property
    def literal_prefix(self) -> str:
        """The part before the first wildcard: what a ``!`` rule can re-include."""
        return re.split(r"[*?\[]", self.text, maxsplit=1)[0].rstrip("/")


def dockerignore_rules(path: Path) -> list[IgnoreRule]:
    rules = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        text = os.path.normpath(line[1:] if negate else line).lstrip("/")
        rules.append(IgnoreRule(negate, text, _pattern_regex(text)))
    return rules


def in_build_context(relative: str, rules: list[IgnoreRule]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    parts = PurePosixPath(relative).parts
    candidates = ["/".join(parts[:end]) for end in range(1, len(parts) + 1)]
    included = True
    for rule in rules:
        if any(rule.regex.match(candidate) for candidate in candidates):
            included = rule.negate
    return included


def build_context_files(root: Path = ROOT) -> set[str]:
    """Every file under root that the Docker build context would hold.

    Excluded folders that no ``!`` rule can reach back into (.git, virtualenvs) are not
    walked, so the check stays fast on a developer's checkout.
    """
    rules = dockerignore_rules(root / ".dockerignore")
    reopen = [rule.literal_prefix for rule in rules if rule.negate]

    def reachable(relative: str) -> bool:
        return any(
            prefix == ""
            or prefix == relative
            or prefix.startswith(relative + "/")
            or relative.startswith(prefix + "/")
            for prefix in reopen
        )

    files = set()
    for directory, subdirs, filenames in os.walk(root):
        base = Path(directory).relative_to(root).as_posix()
        base = "" if base == "." else base + "/"
        subdirs[:] = [
            name
            for name in subdirs
            if in_build_context(base + name, rules) or reachable(base + name)
        ]
        files.update(base + name for name in filenames if in_build_context(base + name, rules))
    return files
