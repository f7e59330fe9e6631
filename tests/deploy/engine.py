"""A Docker engine of the test's own, and the images compose.yaml needs, on a machine that has
neither Docker nor a reachable image registry (tests/deploy/test_compose_up.py).

- Debian's ``docker.io`` and ``mmdebstrap`` are installed when missing (as root; elsewhere
  the test skips, and fails in CI).
- ``dockerd`` runs on its own socket, data root, exec root, config file and cgroup parent,
  with no default bridge, no iptables rules, no NAT and no IP forwarding. Compose's project
  network is still a bridge (the services find each other on it by name); the host reaches
  the services only through the ports compose publishes on 127.0.0.1 (``docker-proxy``), and
  the containers reach nothing beyond the host. So the stack's traffic never leaves the
  machine and the host's firewall and sysctls are never touched. Image builds alone use the
  host's network (``docker build --network host``), for Debian's mirror and PyPI.
- The base image is Debian bookworm from the mirrors apt uses on this machine, with Debian's
  ``python3`` and ``python3-venv`` (``mmdebstrap``, then ``docker import``).
- Everything is undone whatever happens (:meth:`Engine.close`): containers, networks and
  volumes removed, the daemon stopped (killed if it must be) with every process it left,
  its mounts, interfaces, cgroups and the files it writes outside its roots removed, and the
  host checked to be as it was before: interfaces, iptables rules, mounts, processes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.helpers import ROOT

# The tool -> the Debian package that brings it.
PACKAGES = {"dockerd": "docker.io", "mmdebstrap": "mmdebstrap", "docker-compose": "docker-compose"}
IMAGES_DIR = ROOT / "tests" / "deploy" / "images"
SUITE = "bookworm"
# Debian's python3 and the venv module the Dockerfile's build stage needs; ca-certificates so
# that pip in the build trusts what this machine trusts (below).
BASE_PACKAGES = ("ca-certificates", "python3-venv")
BASE_IMAGE = f"vllm-cache-exporter-test/debian-python3:{SUITE}"
# mmdebstrap's merged-/usr setup without the usrmerge package (and the perl it pulls in):
# the way Debian's own container images are made. Documentation, man pages and translations
# are left out, as in the slim python images.
MMDEBSTRAP_OPTIONS = (
    "--variant=minbase",
    '--aptopt=Acquire::Retries "5"',
    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
)
# A Debian mirror that drops a connection is asked again (apt's default is not to).
APT_RETRIES = ("-o", "Acquire::Retries=5")
# Where dockerd and its containerd write outside the roots they are given: removed after the
# run when they were not there before.
OUTSIDE_ROOTS = (
    Path("/etc/docker/key.json"),
    Path("/etc/docker"),
    Path("/run/docker"),
    Path("/run/containerd"),
)
CGROUP_ROOT = Path("/sys/fs/cgroup")


def require(condition: bool, why: str) -> None:
    """Skip locally when a precondition fails; in CI, where .ci/run provides it, fail."""
    if condition:
        return
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def ensure_installed(log: Path) -> float:
    """Install what is missing of PACKAGES with apt; returns the seconds it took (0 if none)."""
    missing = sorted({package for tool, package in PACKAGES.items() if not shutil.which(tool)})
    if not missing:
        return 0.0
    require(os.geteuid() == 0, f"needs {', '.join(missing)} (apt-get install, as root)")
    started = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with open(log, "ab") as out:
        for command in (
            ["apt-get", "update", "-qq", *APT_RETRIES],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_RETRIES, *missing],
        ):
            result = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900
            )
            assert result.returncode == 0, f"{' '.join(command)} failed: see {log}"
    return time.monotonic() - started


def docker_cli() -> str:
    """Debian's docker CLI, the daemon's own version (another one earlier on PATH would
    speak a newer API down to it, and build differently)."""
    packaged = Path("/usr/bin/docker")
    found = str(packaged) if packaged.exists() else shutil.which("docker")
    assert found, "docker.io is installed but its docker CLI is not found"
    return found


# --- the host, before and after -------------------------------------------------------------


def _iptables_rules() -> str:
    """Every table's rules, counters left out: dockerd must not have added any."""
    out = []
    for tool in ("iptables-save", "ip6tables-save"):
        path = shutil.which(tool)
        if path is None:
            continue
        result = subprocess.run([path], capture_output=True, text=True, timeout=60)
        out.extend(
            re.sub(r"\[\d+:\d+\]", "", line)
            for line in result.stdout.splitlines()
            if line and not line.startswith("#")
        )
    return "\n".join(out)


@dataclass(frozen=True)
class HostState:
    interfaces: frozenset[str]
    iptables: str
    mounts: frozenset[str]  # mount points under the engine's root
    processes: frozenset[int]  # processes whose command line names the engine's root

    @classmethod
    def capture(cls, root: Path) -> HostState:
        return cls(
            frozenset(os.listdir("/sys/class/net")),
            _iptables_rules(),
            frozenset(mounts_under(root)),
            frozenset(processes_naming(root)),
        )

    def differences(self, other: HostState) -> list[str]:
        out = []
        if self.interfaces != other.interfaces:
            out.append(f"interfaces {sorted(self.interfaces)} -> {sorted(other.interfaces)}")
        if self.iptables != other.iptables:
            out.append(f"iptables rules changed:\n{self.iptables}\n->\n{other.iptables}")
        if other.mounts - self.mounts:
            out.append(f"mounts left: {sorted(other.mounts - self.mounts)}")
        if other.processes - self.processes:
            out.append(f"processes left: {sorted(other.processes - self.processes)}")
        return out


def mounts_under(root: Path) -> list[str]:
    prefix = str(root) + "/"
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point.startswith(prefix):
            points.append(point)
    return points


def processes_naming(root: Path) -> list[int]:
    needle = str(root).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            found.append(int(entry))
    return found


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- the engine -----------------------------------------------------------------------------


@dataclass
class Engine:
    root: Path
    docker: str = field(default_factory=docker_cli)
    process: subprocess.Popen[bytes] | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def cgroup_parent(self) -> str:
        return f"vllm-cache-exporter-test-{os.getpid()}"

    @property
    def env(self) -> dict[str, str]:
        """The client's environment: this daemon, and a client config of its own."""
        return {"DOCKER_HOST": f"unix://{self.socket}", "DOCKER_CONFIG": str(self.root / "cli")}

    def run(
        self, *args: str, timeout: float = 300, check: bool = True, stdin: Any = None
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.docker, *args],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=stdin,
        )
        if check:
            assert result.returncode == 0, (
                f"docker {' '.join(args)}: {result.returncode}\n{result.stdout}\n{result.stderr}"
            )
        return result

    def inspect(self, *ids: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = json.loads(self.run("inspect", *ids).stdout)
        return result

    # -- start and stop --

    def start(self) -> None:
        dockerd = shutil.which("dockerd")
        assert dockerd
        (self.root / "daemon.json").write_text("{}\n")  # not /etc/docker/daemon.json
        command = [
            dockerd,
            f"--host=unix://{self.socket}",
            f"--data-root={self.root / 'data'}",
            f"--exec-root={self.root / 'exec'}",
            f"--pidfile={self.root / 'dockerd.pid'}",
            f"--config-file={self.root / 'daemon.json'}",
            f"--cgroup-parent=/{self.cgroup_parent}",
            "--bridge=none",
            "--iptables=false",
            "--ip-forward=false",
            "--ip-masq=false",
        ]
        log = open(self.root / "dockerd.log", "wb")  # noqa: SIM115 (the reader thread owns it)
        self.process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.PIPE, start_new_session=True
        )
        ready = threading.Event()

        def follow(stream: Any) -> None:  # the daemon's log: copied, and read for readiness
            for line in stream:
                log.write(line)
                log.flush()
                if b"API listen on" in line:
                    ready.set()
            log.close()

        threading.Thread(target=follow, args=(self.process.stderr,), daemon=True).start()
        deadline = time.monotonic() + 120
        while not ready.wait(timeout=1):
            if self.process.poll() is not None:
                raise AssertionError(f"dockerd exited {self.process.returncode}: {self.log_tail()}")
            assert time.monotonic() < deadline, f"dockerd never listened: {self.log_tail()}"
        info = json.loads(self.run("info", "--format", "{{json .}}").stdout)
        self.facts.update(
            server=info["ServerVersion"],
            storage=info["Driver"],
            cgroup_version=info.get("CgroupVersion"),
            cgroup_driver=info["CgroupDriver"],
        )

    def log_tail(self, lines: int = 30) -> str:
        path = self.root / "dockerd.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> list[str]:
        """Stop the daemon and undo everything it did; returns what could not be undone."""
        problems = []
        if self.process is not None and self.process.poll() is None:
            ids = self.run("ps", "-aq", check=False, timeout=60).stdout.split()
            if ids:
                self.run("rm", "-f", "-v", *ids, check=False, timeout=120)
            self.run("network", "prune", "-f", check=False, timeout=60)
            self.run("volume", "prune", "-f", check=False, timeout=60)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                problems.append("dockerd ignored SIGTERM for 60 s: killed")
                self.process.kill()
                self.process.wait(timeout=30)
        # Whatever outlived it: container processes (by their cgroups), containerd and its
        # shims, which name the exec root on their command lines.
        _kill(self._cgroup_processes())
        _kill(processes_naming(self.root))
        for point in sorted(mounts_under(self.root), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=60)
        self._remove_interfaces()
        return problems + self._remove_cgroups()

    # -- what the daemon leaves outside its roots --

    def _cgroup_dirs(self) -> list[Path]:
        found = []
        for hierarchy in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()] if CGROUP_ROOT.is_dir() else []:
            candidate = hierarchy / self.cgroup_parent
            if candidate.is_dir():
                found.append(candidate)
        return found

    def _cgroup_processes(self) -> list[int]:
        pids: list[int] = []
        for top in self._cgroup_dirs():
            for procs in top.rglob("cgroup.procs"):
                try:
                    pids.extend(int(line) for line in procs.read_text().split())
                except OSError:
                    pass
        return pids

    def container_cpu_seconds(self) -> float | None:
        """CPU time the containers used so far, from their cgroups' own accounting (cgroup v1
        cpuacct.usage, else v2 cpu.stat); None when neither is there."""
        dirs = self._cgroup_dirs()
        for top in dirs:
            if (top / "cpuacct.usage").is_file():
                return round(int((top / "cpuacct.usage").read_text()) / 1e9, 1)
        for top in dirs:
            stat = top / "cpu.stat"
            for line in stat.read_text().splitlines() if stat.is_file() else []:
                if line.startswith("usage_usec "):
                    return round(int(line.split()[1]) / 1e6, 1)
        return None

    def _remove_cgroups(self) -> list[str]:
        problems = []
        for top in self._cgroup_dirs():
            for directory in [
                *sorted(
                    (p for p in top.rglob("*") if p.is_dir()),
                    key=lambda p: len(p.parts),
                    reverse=True,
                ),
                top,
            ]:
                try:
                    directory.rmdir()
                except OSError as err:
                    problems.append(f"cgroup {directory}: {err}")
        return problems

    def _remove_interfaces(self) -> None:
        """Bridges and veths of compose's networks, should the daemon not have removed them."""
        before = self.facts.get("interfaces_before", frozenset())
        for name in sorted(set(os.listdir("/sys/class/net")) - before):
            if name.startswith(("br-", "veth")):
                subprocess.run(["ip", "link", "delete", name], capture_output=True, timeout=60)


@contextmanager
def running_engine(root: Path) -> Iterator[Engine]:
    """A started engine in ``root``, and on exit the host as it was, or the test fails."""
    outside = {path: path.exists() for path in OUTSIDE_ROOTS}
    before = HostState.capture(root)
    engine = Engine(root)
    engine.facts["interfaces_before"] = before.interfaces
    try:
        engine.start()
        yield engine
    finally:
        problems = engine.close()
        for path, existed in outside.items():  # files first, then their folders
            if not existed and path.is_file():
                path.unlink()
        for path, existed in outside.items():
            if not existed and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(root / "data", ignore_errors=True)
        shutil.rmtree(root / "exec", ignore_errors=True)
        problems += before.differences(HostState.capture(root))
        assert not problems, "the engine left the host changed:\n" + "\n".join(problems)


# --- images ---------------------------------------------------------------------------------


def debian_sources(suite: str = SUITE) -> list[str]:
    """One-line sources for ``suite`` on the Debian mirrors apt uses here (apt's own view of
    /etc/apt/sources.list*): the archive for the suite and its updates, the security mirror."""
    result = subprocess.run(
        [
            "apt-get",
            "indextargets",
            "--format",
            "$(ORIGIN)\t$(REPO_URI)\t$(RELEASE)",
            "Identifier: Packages",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    archive = security = None
    for line in result.stdout.splitlines():
        origin, uri, release = (line.split("\t") + ["", "", ""])[:3]
        if origin != "Debian":
            continue
        if release.endswith("-security"):
            security = security or uri
        else:
            archive = archive or uri
    assert archive, (
        "apt has no Debian mirror configured (apt-get indextargets): "
        f"{result.stdout or result.stderr}"
    )
    lines = [f"deb {archive} {suite} main", f"deb {archive} {suite}-updates main"]
    if security:
        lines.append(f"deb {security} {suite}-security main")
    return lines


def import_debian_base(engine: Engine, log: Path) -> float:
    """mmdebstrap | docker import: the base image; returns the seconds it took."""
    mmdebstrap = shutil.which("mmdebstrap")
    assert mmdebstrap
    hook = IMAGES_DIR / "trust-host-cas.sh"
    command = [
        mmdebstrap,
        *MMDEBSTRAP_OPTIONS,
        f"--include={','.join(BASE_PACKAGES)}",
        f'--customize-hook=sh "{hook}" "$1"',
        SUITE,
        "-",
        *debian_sources(),
    ]
    started = time.monotonic()
    with open(log, "ab") as err:
        build = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err)
        try:
            imported = engine.run("import", "-", BASE_IMAGE, stdin=build.stdout, timeout=900)
        finally:
            assert build.stdout is not None
            build.stdout.close()
            build.wait(timeout=900)
    assert build.returncode == 0, f"mmdebstrap failed ({build.returncode}): see {log}"
    assert imported.stdout.strip().startswith("sha256:"), imported.stdout
    return time.monotonic() - started


def build_image(
    engine: Engine,
    tag: str,
    dockerfile: Path,
    context: Path,
    build_args: Mapping[str, str],
    log: Path,
) -> float:
    """docker build on the host's network; returns the seconds it took."""
    args = [arg for key, value in build_args.items() for arg in ("--build-arg", f"{key}={value}")]
    started = time.monotonic()
    result = engine.run(
        "build",
        "--network",
        "host",
        *args,
        "-t",
        tag,
        "-f",
        str(dockerfile),
        str(context),
        check=False,
        timeout=1200,
    )
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"--- docker build -t {tag}\n{result.stdout}\n{result.stderr}\n")
    assert result.returncode == 0, f"docker build -t {tag} failed:\n{result.stderr[-3000:]}"
    return time.monotonic() - started


def image_size(engine: Engine, tag: str) -> int:
    return int(engine.run("image", "inspect", "--format", "{{.Size}}", tag).stdout)
