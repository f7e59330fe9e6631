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
3. At most ``max_labels`` distinct labels are admitted; the others share ``__other__``,
   and every event counted there is counted as an overflow. Which ones is decided by rank,
   not by arrival (``RankedSet``): the labels with the smallest BLAKE2b hashes among all
   seen, so a restart, or a second exporter fed the same callers in another order, names
   the same ones. A caller admitted early gives its place up when one of smaller rank
   arrives while the cap is full (its series go; ``on_evict`` tells the owner).

Nothing is ever hashed because of a prefix alone: ``pk-search`` and ``sess-caller`` are
names, ``sk-proj-4f9...`` is a key.

An alias of a hashed name (``key-0123456789ab=billing``) renames only a hash the exporter
made: no reader hands the signals a caller of that form, nor ``__other__``, unless it made
it itself (the HTTP ingest and the file follower refuse them as ``reserved_caller``,
``exporter.usage.event.is_reserved_caller``; the tap refuses them from its caller header and
the request body, and gives that form only to its own hash of a request's key). So a raw
name of the hashed form here is the tap's hash of a real key, and rule 2 hashes anything
else that is no plain name.

The operator's patterns run on names of at most MAX_CALLER_CHARS (models MAX_MODEL_CHARS)
characters, checked here too (a longer name is hashed without them), and are compiled with
RE2 (``google-re2``, the ``re2`` extra) where it is installed: linear in the name's length
whatever the pattern. Python's ``re`` backtracks: ``(a+)+$`` takes seconds on 26
characters, so without RE2 a pattern with a repeat inside a repeat is warned about at start.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from exporter.redaction import key_label
from exporter.values import MAX_CALLER_CHARS, OVERFLOW_LABEL

try:  # linear-time matching of the operator's patterns (optional: the re2 extra)
    import re2  # type: ignore[import-not-found, import-untyped, unused-ignore]
except ImportError:  # pragma: no cover - depends on what is installed
    re2 = None

if sys.version_info >= (3, 11):
    import re._parser as _sre_parse
else:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse

log = logging.getLogger(__name__)

OTHER = OVERFLOW_LABEL
DEFAULT_NAME_PATTERN = r"[A-Za-z0-9._-]{1,64}"
DEFAULT_MODEL_PATTERN = r"[A-Za-z0-9._:/+-]{1,128}"
# The defaults (--callers.max, --callers.detailed, --callers.max-series,
# --callers.targets-max): a platform's callers each with its own hit ratio, and that ratio
# on the vLLM replica that served them; the costly families per caller for a hundred of
# them; a budget that holds all of it on three models, each pair through one replica
# (10,000 x 3 x (9 + 2) + 100 x 3 x 252 = 405,600 series: the per-caller part of
# docs/metrics.md, exporter/signals/usage.py SERIES_PER_PAIR and TARGET_SERIES); the
# distinct replicas a gateway spreads them over.
DEFAULT_CALLERS = 10_000
DEFAULT_DETAILED = 100
DEFAULT_MAX_SERIES = 410_000
DEFAULT_TARGETS = 256

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
    r")"
)
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


_REPEATS = frozenset({_sre_parse.MAX_REPEAT, _sre_parse.MIN_REPEAT})
_UNBOUNDED = _sre_parse.MAXREPEAT


def can_backtrack(pattern: str) -> bool:
    """Whether ``pattern`` repeats something that itself repeats, one of the two without an
    upper bound (``(a+)+``, ``(a*)*``, ``(a{1,9})+``, ``([a-z]+-)*``): Python's ``re`` may
    then try exponentially many ways to match a name that fails. A heuristic: some such
    patterns are linear (the last one), and alternatives that overlap (``(a|aa)+``) are not
    seen."""
    try:
        tree = _sre_parse.parse(pattern)
    except re.error:
        return False

    def nested(items: Any, outer: int) -> bool:
        """``outer``: the largest count of the repeats around ``items`` (0: none)."""
        for op, arg in items:
            if op in _REPEATS:
                most = arg[1]
                if outer and (most == _UNBOUNDED or outer == _UNBOUNDED) and most > 1:
                    return True
                if nested(arg[2], max(outer, most) if most > 1 else outer):
                    return True
            elif op is _sre_parse.SUBPATTERN and nested(arg[-1], outer):
                return True
            elif op is _sre_parse.BRANCH and any(nested(b, outer) for b in arg[1]):
                return True
            elif op in (_sre_parse.ASSERT, _sre_parse.ASSERT_NOT) and nested(arg[1], outer):
                return True
        return False

    return nested(tree, 0)


def compile_pattern(pattern: str, what: str = "--callers.name-pattern") -> Callable[[str], object]:
    """``pattern``'s fullmatch: RE2's where it is installed and takes the pattern (it has no
    backreferences or lookarounds), else Python's, with a warning if it can backtrack."""
    if re2 is not None:
        options = re2.Options()
        options.log_errors = False
        try:
            return re2.compile(pattern, options=options).fullmatch  # type: ignore[no-any-return]
        except re2.error:
            pass
    if can_backtrack(pattern):
        log.warning(
            "%s %r repeats a repeated part: Python's regular expressions can take "
            "seconds or more on one name that fails to match it, stalling the "
            "exporter; install google-re2 (pip install 'vllm-cache-exporter[re2]') "
            "to match it in linear time, or rewrite it",
            what,
            pattern,
        )
    return re.compile(pattern).fullmatch


class NamePolicy:
    """Whether a name may be a label as it is, or only as its hash (rule 2 above)."""

    def __init__(
        self,
        pattern: str = DEFAULT_NAME_PATTERN,
        keep_emails: bool = False,
        max_chars: int = MAX_CALLER_CHARS,
        what: str = "--callers.name-pattern",
    ) -> None:
        self.fullmatch = compile_pattern(pattern, what)
        self.keep_emails = keep_emails
        # Names are bounded before they get here (exporter.values); a longer one is hashed
        # before any pattern sees it.
        self.max_chars = max_chars

    def label(self, name: str) -> str:
        if not name:  # no name at all (a model the proxy did not report)
            return name
        if len(name) > self.max_chars:
            return key_label(name)
        if looks_like_key(name):
            return key_label(name)
        if self.keep_emails and is_email(name):
            return name
        if self.fullmatch(name) is None:
            return key_label(name)
        return name


def rank(label: str) -> int:
    """A label's place in the order callers are admitted by: its 128-bit BLAKE2b hash
    (unsalted, so the same in every process; ``RankedSet``). Two labels of one rank are as
    likely as a collision of the hash."""
    digest = hashlib.blake2b(label.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return int.from_bytes(digest, "big")


class RankedSet:
    """At most ``size`` labels: of all labels ever offered, those of smallest ``rank``,
    whatever order they came in (a bottom-k sample).

    ``offer`` admits a label while there is room; when full, a label ranked before the
    worst member takes its place (the worst is returned, evicted) and any other is refused.
    The worst member only ever gets better, so a label refused once is refused for good,
    and after n distinct labels about ``size * ln(n / size)`` evictions have happened in all
    (460 for 100 of 10,000): the set settles on the same members in every process. Memory:
    a dict entry and a heap entry per member, about 200 bytes with a 30-character label.
    """

    def __init__(self, size: int) -> None:
        self.size = max(0, size)
        self.members: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []  # (-rank, label): the worst member first
        self.evictions = 0

    def __contains__(self, label: object) -> bool:
        return label in self.members

    def __len__(self) -> int:
        return len(self.members)

    def offer(self, label: str) -> tuple[bool, str | None]:
        """(admitted, the member it evicted or None)."""
        if label in self.members:
            return True, None
        if self.size <= 0:
            return False, None
        value = rank(label)
        if len(self.members) < self.size:
            self.members[label] = value
            heapq.heappush(self._heap, (-value, label))
            return True, None
        worst_negated, worst = self._heap[0]
        if value >= -worst_negated:
            return False, None
        heapq.heapreplace(self._heap, (-value, label))
        del self.members[worst]
        self.members[label] = value
        self.evictions += 1
        return True, worst

    def discard(self, label: str) -> None:
        """Take a member out (a caller gone from the caller cap): its place is free."""
        if self.members.pop(label, None) is not None:
            self._heap = [entry for entry in self._heap if entry[1] != label]
            heapq.heapify(self._heap)


class LabelCap:
    """Maps raw names to label values: alias, the name policy, then the cap (rules 1-3).

    ``label()`` is on the hot path: a dict hit for every name seen before. The memo is bounded
    (cleared when full) because raw names are unbounded. A name refused by the cap is refused
    for good; an admitted one may later be evicted by a label of smaller rank (``ranked``):
    the memo is cleared then and ``on_evict`` called with the label that went. Unranked (the
    models, which the operator names), the first ``max_labels`` are admitted.
    """

    def __init__(
        self,
        max_labels: int,
        allow: Iterable[str] = (),
        alias: Mapping[str, str] | None = None,
        memo_size: int = 10_000,
        policy: NamePolicy | None = None,
        ranked: bool = False,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        self.max_labels = max_labels
        self.policy = policy or NamePolicy()
        self.allow = frozenset(allow)
        self.alias = dict(alias or {})
        self.memo_size = memo_size
        self.ranked = RankedSet(max_labels) if ranked else None
        self.on_evict = on_evict
        self.admitted: set[str] | dict[str, int] = (
            self.ranked.members if self.ranked is not None else set()
        )
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
        if self.ranked is not None:
            admitted, evicted = self.ranked.offer(label)
            if evicted is not None:
                self._memo.clear()
                if self.on_evict is not None:
                    self.on_evict(evicted)
            return (label, False) if admitted else (OTHER, True)
        admitted_set = self.admitted
        assert isinstance(admitted_set, set)
        if len(admitted_set) < self.max_labels:
            admitted_set.add(label)
            return label, False
        return OTHER, True
