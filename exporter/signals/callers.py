"""Turn caller names from the outside world into a bounded, safe set of label values.

Caller names come from whoever can reach the proxy, so they are capped (the first
``max_labels`` distinct callers get their own label, later ones share ``__other__``, and the
overflow is counted), can be renamed (alias) or guaranteed a label past the cap (allowlist),
and a name that looks like an API key is never shown: it becomes ``key-`` and 12 hex digits
of its SHA-256, so an operator can still tell keys apart and alias the hash to a name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from exporter.redaction import key_label

OTHER = "__other__"

# Well-known secret prefixes: OpenAI/Anthropic/LiteLLM (sk-), Stripe-style (pk_, rk_),
# GitHub, GitLab, Hugging Face, Slack, Google, AWS access keys, JWTs, a pasted header.
_KEY_PREFIX = re.compile(
    r"(?:sk|pk|rk)[-_]|sess-|ghp_|gho_|ghs_|ghu_|github_pat_|glpat-|hf_|xox[abpors]-|AIza"
    r"|AKIA[0-9A-Z]{12}|ASIA[0-9A-Z]{12}|eyJ[A-Za-z0-9_-]{10,}\.|bearer\s", re.IGNORECASE)
_HEX_SECRET = re.compile(r"[0-9a-fA-F]{32,}")
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9+/=_-]{24,}")


def looks_like_key(name: str) -> bool:
    """True for names that are probably credentials rather than identities.

    A heuristic, tuned to keep ordinary service names ("team-search-agent-2") as they are: a
    known secret prefix, 32+ hex digits, or 24+ token characters mixing at least three of each
    of upper case, lower case and digits (what random base62/64 keys look like).
    """
    if _KEY_PREFIX.match(name):
        return True
    if _HEX_SECRET.fullmatch(name):
        return True
    if _TOKEN_CHARS.fullmatch(name):
        upper = sum(ch.isupper() for ch in name)
        lower = sum(ch.islower() for ch in name)
        digits = sum(ch.isdigit() for ch in name)
        return upper >= 3 and lower >= 3 and digits >= 3
    return False


class LabelCap:
    """Maps raw names to label values: alias, hide keys, then cap with an overflow bucket.

    ``label()`` is on the hot path: a dict hit for every name seen before. The memo is bounded
    (cleared when full) because raw names are unbounded; the decision for a name never changes
    once made, since admitted labels are kept separately and never expire.
    """

    def __init__(self, max_labels: int, allow: Iterable[str] = (),
                 alias: Mapping[str, str] | None = None, memo_size: int = 10_000) -> None:
        self.max_labels = max_labels
        self.allow = frozenset(allow)
        self.alias = dict(alias or {})
        self.memo_size = memo_size
        self.admitted: set[str] = set()
        self.overflowed = 0  # events that went to OTHER because the cap was reached
        self._memo: dict[str, tuple[str, bool]] = {}

    def label(self, name: str) -> str:
        hit = self._memo.get(name)
        if hit is None:
            hit = self._decide(name)
            if len(self._memo) >= self.memo_size:
                self._memo.clear()
            self._memo[name] = hit
        if hit[1]:
            self.overflowed += 1
        return hit[0]

    def _decide(self, name: str) -> tuple[str, bool]:
        label = self.alias.get(name, name)
        if label == name and looks_like_key(name):
            label = key_label(name)
            label = self.alias.get(label, label)
        if label in self.allow or label in self.admitted or label == OTHER:
            return label, False
        if len(self.admitted) < self.max_labels:
            self.admitted.add(label)
            return label, False
        return OTHER, True
