"""A deterministic stand-in tokenizer: the same text always gives the same token ids.

Prefix caching is keyed by token content, so the simulator needs a tokenizer that is stable
across processes and runs (``hash()`` of a str is salted per process; crc32 is not) and cheap
enough to tokenize a 90,000-token agent prompt on every turn. Text is cut into pieces of at
most ``PIECE_CHARS`` non-space characters (a short word is one token, a long one several, as
with a BPE vocabulary) and each piece is hashed to an id. Per-message results are memoised,
because an agent resends the same history every turn.

Chat prompts use a ChatML-like template: ``<|im_start|> role content <|im_end|>`` per
message, then ``<|im_start|> assistant`` for the reply, i.e. 3 tokens per message plus 2.
"""

from __future__ import annotations

import re
import zlib
from collections import OrderedDict
from collections.abc import Iterable

VOCAB_SIZE = 151_936  # Qwen's vocabulary size; only the range of ids matters
PIECE_CHARS = 8
IM_START, IM_END = 1, 2
ROLE_IDS = {"system": 3, "user": 4, "assistant": 5, "tool": 6, "developer": 7}
OTHER_ROLE = 8
SPECIAL_IDS = 16  # ids below this are reserved for the template
TOKENS_PER_MESSAGE = 3
TOKENS_FOR_REPLY = 2

_PIECES = re.compile(r"\S{1,8}")  # PIECE_CHARS
_MEMO_MAX = 512


class Tokenizer:
    """Text -> token ids, memoising whole texts (an LRU of ``_MEMO_MAX`` entries)."""

    def __init__(self) -> None:
        self._memo: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def encode(self, text: str) -> tuple[int, ...]:
        memo = self._memo
        tokens = memo.get(text)
        if tokens is not None:
            memo.move_to_end(text)
            return tokens
        span = VOCAB_SIZE - SPECIAL_IDS
        crc = zlib.crc32
        tokens = tuple(
            SPECIAL_IDS + crc(piece.encode("utf-8")) % span for piece in _PIECES.findall(text)
        )
        if len(text) > 64:  # short texts are cheap to redo; keep the memo for histories
            memo[text] = tokens
            if len(memo) > _MEMO_MAX:
                memo.popitem(last=False)
        return tokens

    def chat(self, messages: Iterable[tuple[str, str]]) -> list[int]:
        """Token ids of a chat prompt: (role, content) pairs through the template."""
        tokens: list[int] = []
        for role, content in messages:
            tokens.append(IM_START)
            tokens.append(ROLE_IDS.get(role, OTHER_ROLE))
            tokens.extend(self.encode(content))
            tokens.append(IM_END)
        tokens.append(IM_START)
        tokens.append(ROLE_IDS["assistant"])
        return tokens


def chat_overhead(message_count: int) -> int:
    """Template tokens a chat prompt of ``message_count`` messages adds to its contents."""
    return TOKENS_PER_MESSAGE * message_count + TOKENS_FOR_REPLY


_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


def base36(number: int) -> str:
    if number == 0:
        return "0"
    digits = []
    while number:
        number, rest = divmod(number, 36)
        digits.append(_ALPHABET[rest])
    return "".join(reversed(digits))


def words(count: int, tag: str, start: int = 0) -> str:
    """``count`` distinct one-token words unique to ``tag`` (a text of exactly ``count`` tokens).

    Each word is ``tag`` followed by a base-36 index; ``tag`` plus index must fit in one
    piece, so tags are kept short (see ``Workload``) and indexes below 36**4.
    """
    if len(tag) > PIECE_CHARS - 4:
        raise ValueError(f"tag {tag!r} is too long for one-token words")
    return " ".join(tag + base36(index).rjust(4, "0") for index in range(start, start + count))


def reply_words(seed: int, count: int) -> str:
    """The simulated model's reply: ``count`` one-token words derived from ``seed``."""
    out = []
    state = seed & 0xFFFFFFFF
    for _ in range(count):
        state = (state * 1_103_515_245 + 12_345) & 0x7FFFFFFF
        out.append("r" + base36(state % 36**6).rjust(6, "0")[:6])
    return " ".join(out)
