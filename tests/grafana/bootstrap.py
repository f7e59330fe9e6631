"""Grafana's published panel code for the load test, installed once into this folder and reused.

What, from the npm registry, pinned to the Grafana the dashboards target
(``exporter.monitoring.dashboards.grafana.GRAFANA_VERSION``):

- ``npm ci`` of package.json/package-lock.json here: @grafana/data and @grafana/schema of that
  release and lodash, into ``node_modules/`` (about 120 MB, 100 packages, 20-80 s measured here).
- One module of @grafana/ui of that release, the single-stat panel migrations
  (``SingleStatBaseOptions.mjs``), taken from its registry tarball (``npm pack``, 2.4 MB, its
  sha512 pinned below) into ``vendor/``. @grafana/ui itself cannot be installed here: it
  depends on a git repository, and on a browser's worth of packages this check does not run.

Both folders and the log (``install.log``) are git-ignored. An install whose stamp matches the
lock file and the pinned tarball is reused as is. Run ``python -m tests.grafana.bootstrap`` to
prepare it ahead of a test run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from exporter.monitoring.dashboards.grafana import GRAFANA_VERSION

HERE = Path(__file__).resolve().parent
NODE_MODULES = HERE / "node_modules"
VENDOR = HERE / "vendor"
LOG = HERE / "install.log"
STAMP = NODE_MODULES / ".vllm-cache-exporter-stamp"
UI_PACKAGE = f"@grafana/ui@{GRAFANA_VERSION}"
# `npm view @grafana/ui@12.1.1 dist.integrity`; change with GRAFANA_VERSION.
UI_INTEGRITY = (
    "sha512-qdN0tYcAddb8qRWlon0aseeKUFoxc3ZFPawKPXCUdFv1B5PxvtYS2vIwy3XBzFQmkxRY"
    "+ts97+qUYp1WI28iQQ=="
)
UI_MEMBER = "package/dist/esm/components/SingleStatShared/SingleStatBaseOptions.mjs"
UI_MODULE = VENDOR / f"grafana-ui-{GRAFANA_VERSION}" / "SingleStatBaseOptions.mjs"
HARNESS = HERE / "load_dashboards.mjs"
TIMEOUT_SECONDS = 600


class BootstrapError(RuntimeError):
    pass


class NodeMissing(BootstrapError):
    """node or npm is not installed: the test skips locally and fails in CI."""


def _stamp() -> str:
    lock = (HERE / "package-lock.json").read_bytes()
    return f"{hashlib.sha256(lock).hexdigest()} {UI_INTEGRITY}\n"


def is_ready() -> bool:
    return STAMP.exists() and STAMP.read_text(encoding="utf-8") == _stamp() and UI_MODULE.exists()


def node() -> str:
    path = shutil.which("node")
    if path is None or shutil.which("npm") is None:
        raise NodeMissing(
            "node and npm are needed to load the dashboards with Grafana's code "
            "(Debian: apt-get install nodejs npm)"
        )
    return path


def _run(command: list[str], what: str, cwd: Path = HERE) -> str:
    with LOG.open("a", encoding="utf-8") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        result = subprocess.run(
            command, cwd=cwd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=TIMEOUT_SECONDS
        )
        log.write(result.stdout)
    if result.returncode != 0:
        tail = "\n".join(LOG.read_text(encoding="utf-8", errors="replace").splitlines()[-30:])
        raise BootstrapError(
            f"{what} failed (exit {result.returncode}); last lines of {LOG}:\n{tail}"
        )
    return result.stdout


def _fetch_ui_module() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        packed = json.loads(
            _run(
                ["npm", "pack", UI_PACKAGE, "--json", "--pack-destination", scratch],
                f"npm pack {UI_PACKAGE}",
            )
        )
        if packed[0]["integrity"] != UI_INTEGRITY:
            raise BootstrapError(
                f"{UI_PACKAGE} from the registry has integrity "
                f"{packed[0]['integrity']}, expected the pinned {UI_INTEGRITY}"
            )
        with tarfile.open(Path(scratch) / packed[0]["filename"]) as tarball:
            member = tarball.extractfile(UI_MEMBER)
            if member is None:
                raise BootstrapError(f"{UI_PACKAGE} has no {UI_MEMBER}")
            UI_MODULE.parent.mkdir(parents=True, exist_ok=True)
            UI_MODULE.write_bytes(member.read())


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_installed(announce: Callable[[str], None] = _print) -> Path:
    """The harness script, with everything it loads installed first if needed (said through
    ``announce`` first: an install is worth knowing about)."""
    node()
    if is_ready():
        return HARNESS
    announce(
        f"tests/grafana: installing Grafana {GRAFANA_VERSION}'s panel code from npm "
        f"(@grafana/data, @grafana/schema: npm ci, ~120 MB, about a minute; one module of "
        f"{UI_PACKAGE}: npm pack, 2.4 MB) into {HERE}; log: {LOG}"
    )
    LOG.write_text(f"installing Grafana {GRAFANA_VERSION}'s panel code\n", encoding="utf-8")
    _run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"], "npm ci")
    _fetch_ui_module()
    STAMP.write_text(_stamp(), encoding="utf-8")
    return HARNESS


def main() -> int:
    try:
        print(ensure_installed())
    except BootstrapError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
