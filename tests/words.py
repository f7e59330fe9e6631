"""The made-up words the real-engine tests build prompts from: each is one token of the tiny
test tokenizers, so a prompt's length in tokens is its length in words. One list for the
vLLM and LiteLLM harnesses; tests/clients/agent.py, which runs in the clients' own venv and
imports nothing of this project, keeps a copy that tests/test_words.py holds to this one."""

WORDS = [
    "kalo",
    "miren",
    "tasvu",
    "pedor",
    "silny",
    "quabex",
    "torela",
    "fingru",
    "hapjis",
    "kelmon",
    "renvu",
    "dorsil",
    "nyqua",
    "bexela",
    "grufin",
    "jiskel",
]
