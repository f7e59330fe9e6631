"""Same text, same tokens: in every process, whatever PYTHONHASHSEED, so a prefix cached by
one simulator run is the prefix the next request of the same text finds."""

from __future__ import annotations

import os
import subprocess
import sys

from exporter.sim.kvcache import block_keys
from exporter.sim.tokenizer import Tokenizer, chat_overhead, reply_words, words

SNIPPET = """
from exporter.sim.kvcache import block_keys
from exporter.sim.tokenizer import Tokenizer
tokens = Tokenizer().chat([("system", "You are terse. " * 40), ("user", "naïve café, 123!")])
print(tokens[:50], block_keys(tokens, 16)[-1])
"""


def test_tokens_and_block_keys_are_the_same_in_every_process():
    outputs = set()
    for seed in ("1", "2", "random"):
        result = subprocess.run(
            [sys.executable, "-c", SNIPPET],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
        )
        outputs.add(result.stdout)
    assert len(outputs) == 1


def test_word_and_template_counts_are_exact():
    tokenizer = Tokenizer()
    assert len(tokenizer.encode(words(1234, "ab"))) == 1234
    assert len(tokenizer.encode(reply_words(7, 300))) == 300
    messages = [("system", words(100, "s")), ("user", words(20, "u"))]
    assert len(tokenizer.chat(messages)) == 120 + chat_overhead(2)
    # a long word is several tokens, whitespace is none
    assert len(tokenizer.encode("abcdefghijklmnopq")) == 3
    assert tokenizer.encode("a   b\n\tc") == tokenizer.encode("a b c")


def test_different_texts_share_no_prefix():
    tokenizer = Tokenizer()
    first, second = tokenizer.encode(words(64, "aa")), tokenizer.encode(words(64, "ab"))
    assert block_keys(first, 16)[0] != block_keys(second, 16)[0]
    assert tokenizer.encode(words(10, "aa")) == first[:10]
