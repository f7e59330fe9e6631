"""Turn names from the outside world into a bounded, safe set of label values.

Caller (and model) names come from whoever can reach the proxy, so three rules apply, in
this order, and the same whichever reader saw the name:

1. An alias the operator configured wins (``--callers.alias``).
2. The name becomes ``key-`` and 12 hex digits of its SHA-256 (``redaction.key_label``)
   unless it is a plausible plain name: it must match the name pattern (by default 1 to 64
   letters, digits, ``.``, ``_`` and ``-``; models also ``/``, ``:`` and ``+``, up to 128),
   and must not look like a secret (a token behind a well-known key prefix such as ``sk-``,
   ``ghp_``, ``hf_``, ``xoxb-``, ``AKIA``, a JWT, 32 or more hex digits, or a long run of
   letters and digits that mixes both, as random keys do). E-mail addresses are hashed too,
   unless the operator keeps them (``--callers.keep-emails``). The operator can still tell
   hashed names apart, and alias a hash to a readable name.
3. The first ``max_labels`` distinct labels are admitted; later ones share ``__other__``,
   and every event counted there is counted as an overflow.

Nothing is ever hashed because of a prefix alone: ``pk-search`` and ``sess-caller`` are
names, ``sk-proj-4f9...`` is a key.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from exporter.redaction import key_label

OTHER = "__other__"
DEFAULT_NAME_PATTERN = r"[A-Za-z0-9._-]{1,64}"
DEFAULT_MODEL_PATTERN = r"[A-Za-z0-9._:/+-]{1,128}"

# A well-known secret prefix followed by the token it introduces (never the prefix alone).
_PREFIXED_SECRET = re.compile(
    r"(?:^|[^A-Za-z0-9])(?:"
    r"sk[-_][A-Za-z0-9_-]{4,}"  # OpenAI, Anthropic, LiteLLM (its master key is sk-1234)
    r"|(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{8,}"  # Stripe secret and restricted keys
    r"|gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{16,}"  # GitHub
    r"|glpat-[A-Za-z0-9_-]{16,}"  # GitLab
    r"|hf_[A-Za-z0-9]{16,}"  # Hugging Face
    r"|xox[abpors]-[A-Za-z0-9-]{3,}"  # Slack
    r"|AIza[A-Za-z0-9_-]{30,}"  # Google
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"  # AWS access key ids
    r"|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]*"  # a JWT
    r")")
_HEX_RUN = re.compile(r"[0-9a-fA-F]{32,}")
_ALNUM_RUN = re.compile(r"[A-Za-z0-9]{20,}")
_TOKEN = re.compile(r"[A-Za-z0-9+/=_-]{24,}")
_EMAIL = re.compile(r"[^@\s]+@[^@\s]+\.[A-Za-z]{2,}")


def looks_like_key(name: str) -> bool:
    """True for names that are probably credentials rather than identities.

    Tuned to keep ordinary service names ("team-search-agent-2", "MyServiceProductionAgent",
    a UUID) as they are: a token behind a known secret prefix; 32+ hex digits; a run of 20+
    letters and digits with at least two of each (random keys), or of 32+ of them whatever
    they are; 24+ token characters mixing three or more each of upper case, lower case and
    digits (random base62/64).
    """
    if _PREFIXED_SECRET.search(name) or _HEX_RUN.search(name):
        return True
    for run in _ALNUM_RUN.findall(name):
        digits = sum(ch.isdigit() for ch in run)
        if len(run) >= 32 or (digits >= 2 and len(run) - digits >= 2):
            return True
    for run in _TOKEN.findall(name):
        upper = sum(ch.isupper() for ch in run)
        lower = sum(ch.islower() for ch in run)
        digits = sum(ch.isdigit() for ch in run)
        if upper >= 3 and lower >= 3 and digits >= 3:
            return True
    return False


def is_email(name: str) -> bool:
    return _EMAIL.fullmatch(name) is not None


class NamePolicy:
    """Whether a name may be a label as it is, or only as its hash (rule 2 above)."""

    def __init__(self, pattern: str = DEFAULT_NAME_PATTERN, keep_emails: bool = False) -> None:
        self.pattern = re.compile(pattern)
        self.keep_emails = keep_emails

    def label(self, name: str) -> str:
        if not name:  # no name at all (a model the proxy did not report)
            return name
        if looks_like_key(name):
            return key_label(name)
        if self.keep_emails and is_email(name):
            return name
        if self.pattern.fullmatch(name) is None:
            return key_label(name)
        return name


class LabelCap:
    """Maps raw names to label values: alias, the name policy, then the cap (rules 1-3).

    ``label()`` is on the hot path: a dict hit for every name seen before. The memo is bounded
    (cleared when full) because raw names are unbounded; the decision for a name never changes
    once made, since admitted labels are kept separately and never expire.
    """

    def __init__(self, max_labels: int, allow: Iterable[str] = (),
                 alias: Mapping[str, str] | None = None, memo_size: int = 10_000,
                 policy: NamePolicy | None = None) -> None:
        self.max_labels = max_labels
        self.policy = policy or NamePolicy()
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
        label = self.alias.get(name)
        if label is None:
            label = self.policy.label(name)
            label = self.alias.get(label, label)  # an alias may name a hashed name
        if label in self.allow or label in self.admitted or label == OTHER:
            return label, False
        if len(self.admitted) < self.max_labels:
            self.admitted.add(label)
            return label, False
        return OTHER, True
