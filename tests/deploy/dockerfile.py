"""A small Dockerfile reader: instructions by stage, as the builder sees them.

Enough of the syntax for our own file (continuations, comments, exec and shell forms,
``--flags`` on FROM/COPY/HEALTHCHECK, ARGs before the first FROM as the bases' defaults);
hadolint is not available here and a full parser is not needed to check what the image
promises.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str  # upper case
    text: str  # everything after the keyword, continuations joined

    @property
    def flags(self) -> dict[str, str]:
        out = {}
        for word in shlex.split(self.text):
            if not word.startswith("--"):
                break
            key, _, value = word[2:].partition("=")
            out[key] = value
        return out

    @property
    def words(self) -> list[str]:
        """Arguments without leading --flags (shell-split)."""
        words = shlex.split(self.text)
        while words and words[0].startswith("--"):
            words.pop(0)
        return words

    def exec_form(self, text: str | None = None) -> list[str] | None:
        """The JSON array form (["a", "b"]) if that is how it is written, else None."""
        text = (self.text if text is None else text).strip()
        if not text.startswith("["):
            return None
        value = json.loads(text)
        assert isinstance(value, list) and all(isinstance(item, str) for item in value)
        return value


@dataclass
class Stage:
    base: str  # as built without --build-arg: variables replaced by their ARG defaults
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)
    base_text: str = ""  # as written, variables and all

    def all(self, keyword: str) -> list[Instruction]:
        return [item for item in self.instructions if item.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


def logical_lines(path: Path) -> list[str]:
    """The file's instructions, one a line: comments dropped, continuations joined."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, f"{path}: dangling line continuation"
    return logical


def build_args(path: Path) -> dict[str, str]:
    """The ARGs declared before the first FROM, with their defaults: what FROM may use."""
    args: dict[str, str] = {}
    for line in logical_lines(path):
        keyword, _, rest = line.partition(" ")
        if keyword.upper() == "FROM":
            break
        if keyword.upper() == "ARG":
            name, _, default = rest.strip().partition("=")
            args[name] = default
    return args


def parse(path: Path) -> list[Stage]:
    defaults = build_args(path)
    stages: list[Stage] = []
    for line in logical_lines(path):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG" and not stages:
            continue  # in build_args
        if keyword == "FROM":
            words = Instruction(keyword, rest).words
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(substitute(words[0], defaults), name, base_text=words[0]))
            continue
        assert stages, f"{path}: {keyword} before the first FROM"
        stages[-1].instructions.append(Instruction(keyword, rest.strip()))
    return stages


def substitute(text: str, defaults: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` replaced by the ARG's default (unknown: an error)."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in defaults, f"FROM uses ${name}, which no ARG before it declares"
        return defaults[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)
