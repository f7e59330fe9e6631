"""The README is what a new user runs: its commands and reference must match the code."""

from __future__ import annotations

import re
from pathlib import Path

from exporter.config import flags_markdown

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_flag_reference_is_current():
    block = README.split("<!-- flags:begin", 1)[1].split("-->", 1)[1].split("<!-- flags:end")[0]
    assert block.strip() == flags_markdown().strip(), "regenerate: config.flags_markdown()"


def test_ci_runs_exactly_the_readme_test_command():
    blocks = re.findall(r"```sh\n(.*?)```", README, flags=re.S)
    assert blocks[0].strip().endswith("vllm-cache-exporter demo")
    test_command = blocks[1].strip()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command in ci.splitlines()
