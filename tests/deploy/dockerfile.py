"""A small Dockerfile reader: instructions by stage, as the builder sees them.

Enough of the syntax for our own file (continuations, comments, exec and shell forms,
``--flags`` on FROM/COPY/HEALTHCHECK); hadolint is not available here and a full parser is
not needed to check what the image promises.
"""

from __future__ import annotations

import json
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
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [item for item in self.instructions if item.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


def parse(path: Path) -> list[Stage]:
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
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = Instruction(keyword, rest).words
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
            continue
        assert stages, f"{path}: {keyword} before the first FROM"
        stages[-1].instructions.append(Instruction(keyword, rest.strip()))
    return stages
