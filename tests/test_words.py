"""The clients' agent keeps its own copy of the prompt words (it runs in another venv and
imports nothing of this project): the copy must be the list the harnesses use."""

import ast
from pathlib import Path

from tests.words import WORDS

AGENT = Path(__file__).resolve().parent / "clients" / "agent.py"


def test_the_agent_builds_its_prompts_from_the_same_words():
    tree = ast.parse(AGENT.read_text(encoding="utf-8"))
    copies = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(target, ast.Name) and target.id == "WORDS" for target in node.targets)
    ]
    assert copies == [WORDS]
