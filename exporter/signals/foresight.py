"""Foresight: what shows a prefix-cache collapse coming, before the hit ratio falls.

The hit ratio only sees a collapse once it has happened. What decides it beforehand is
arithmetic the field reports did by hand: "how many tokens of conversation fit at once".
Conversations keep their prefix cached only while their summed context (plus, on a hybrid
model, the recurrent state each one keeps) stays a few thousand tokens under the KV pool; past
that, each arrival evicts another's blocks. So this module keeps:

- the live conversations: each one's latest context (prompt + completion of its last turn)
  and when it was last seen, in an LRU of ``ForesightSettings.max_conversations``;
  "active" means seen within ``conversation_idle_seconds``. Their sum against the pool is
  the demand the rules and ``check`` compare;
- which vLLM a model's conversations live on (``attribute``), so demand can be set against
  that engine's pool;
- the admission budget a token-gating proxy should use: the smallest pool seen (kept in
  ``signals.engine``, across vLLM restarts) minus a headroom.

Pure: times are handed in, nothing is read from a clock or a socket.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from exporter.signals.engine import EngineState

# Conversations remembered (least recently seen first out). An entry is a few hundred bytes
# (three strings of at most 256 characters, validated upstream, and four numbers).
DEFAULT_MAX_CONVERSATIONS = 10_000
# A conversation counts as live this long after its last turn: an agent waiting on a long
# tool call still wants its prefix back, and vLLM keeps it cached until something evicts it.
DEFAULT_IDLE_SECONDS = 600.0
# "A few thousand tokens under N": the field report's admission budget sat 3,732 tokens
# under its smallest pool.
DEFAULT_HEADROOM_TOKENS = 4096
# Copies of a hybrid model's recurrent state one conversation holds in the pool: the state of
# the running sequence and the checkpoint its next turn resumes from (vLLM keeps the latest
# checkpoint of every cached conversation; the running one holds its live state too).
STATE_COPIES_PER_CONVERSATION = 2


@dataclass(frozen=True)
class ForesightSettings:
    """The ``signals.*`` flags of the conversation and admission signals."""

    conversation_idle_seconds: float = DEFAULT_IDLE_SECONDS
    max_conversations: int = DEFAULT_MAX_CONVERSATIONS
    # Model name (as usage events carry it) -> pool tokens one copy of its per-sequence
    # recurrent state takes (hybrid models; the simulator's --state-tokens).
    state_tokens: Mapping[str, int] = field(default_factory=dict)
    admission_headroom_tokens: int = DEFAULT_HEADROOM_TOKENS


class Conversation:
    """What is known of one conversation: its latest turn's prompt and context, and when it
    was last seen."""

    __slots__ = ("model_name", "model", "prompt_tokens", "context_tokens", "last_seen")

    def __init__(self, model_name: str, model: str, prompt_tokens: int, context_tokens: int,
                 last_seen: float) -> None:
        self.model_name = model_name  # as the usage event names it
        self.model = model  # its label (after the model cap)
        self.prompt_tokens = prompt_tokens  # the classifier's "previous turn" for the next
        self.context_tokens = context_tokens
        self.last_seen = last_seen


@dataclass
class Demand:
    """Live conversations of one model (or on one engine) and what they need in the pool."""

    conversations: int = 0
    context_tokens: int = 0
    state_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.context_tokens + self.state_tokens

    def add(self, context_tokens: int, state_tokens: int) -> None:
        self.conversations += 1
        self.context_tokens += context_tokens
        self.state_tokens += state_tokens

    def merge(self, other: Demand) -> None:
        self.conversations += other.conversations
        self.context_tokens += other.context_tokens
        self.state_tokens += other.state_tokens


class ConversationTracker:
    """The live conversations, keyed by (caller, model, session).

    A conversation is the usage events of one ``session`` (else of one caller and model).
    Its context is the prompt plus the completion of its latest successful turn: what the
    next turn will find in the cache if nothing evicts it; that turn's prompt is the
    classifier's "previous turn" for the next one. Bounded by ``max_conversations``; a
    conversation dropped by the bound while still active is counted in ``dropped_active``
    (the demand is then a lower bound), and its next turn is classified as a first one.
    """

    def __init__(self, settings: ForesightSettings) -> None:
        self.settings = settings
        self.idle_seconds = settings.conversation_idle_seconds
        self.max_conversations = max(1, settings.max_conversations)
        self._state_tokens = dict(settings.state_tokens)
        # (caller, model name, session) -> its conversation, least recently seen first.
        # Updated in place by UsageState.record_rows (the steps of ``observe``, inlined).
        self.by_key: dict[tuple[str, str, str | None], Conversation] = {}
        self.dropped_active = 0
        self.models: dict[str, None] = {}  # model labels seen, for series kept at 0

    def observe(self, caller: str, model_name: str, model: str, session: str | None,
                prompt_tokens: int, context_tokens: int, when: float, now: float) -> None:
        """One successful turn that ended at ``when`` (``now`` decides what is still live).

        ``UsageState.record_rows`` takes these same steps inline, on ``by_key``
        (tests/usage/test_record_inline.py holds the two together)."""
        conversations = self.by_key
        key = (caller, model_name, session)
        known = conversations.pop(key, None)
        if known is None:
            known = Conversation(model_name, model, prompt_tokens, context_tokens, when)
        else:
            known.prompt_tokens = prompt_tokens
            known.context_tokens = context_tokens
            if when > known.last_seen:
                known.last_seen = when
        conversations[key] = known
        if model not in self.models:
            self.models[model] = None
        if len(conversations) > self.max_conversations:
            self.drop_oldest(now)

    def drop_oldest(self, now: float) -> None:
        """Forget the least recently seen conversation (the bound is passed)."""
        oldest = self.by_key.pop(next(iter(self.by_key)))
        if oldest.last_seen >= now - self.idle_seconds:
            self.dropped_active += 1

    def state_tokens(self, model_name: str) -> int:
        """Pool tokens one conversation of this model holds beside its context."""
        return STATE_COPIES_PER_CONVERSATION * self._state_tokens.get(model_name, 0)

    def active(self, now: float) -> Iterator[Conversation]:
        """Conversations seen within the idle window (a full scan: event times need not
        arrive in order, so recency of arrival says nothing; bounded by the LRU)."""
        cutoff = now - self.idle_seconds
        for conversation in self.by_key.values():
            if conversation.last_seen >= cutoff:
                yield conversation

    def live(self, now: float) -> dict[tuple[str, str], Demand]:
        """Demand per (model label, model name) of the active conversations, in one pass
        (a scrape reads it once for every family that sums it differently)."""
        cutoff = now - self.idle_seconds
        sums: dict[tuple[str, str], list[int]] = {}  # [conversations, context tokens]
        for conversation in self.by_key.values():
            if conversation.last_seen >= cutoff:
                key = (conversation.model, conversation.model_name)
                entry = sums.get(key)
                if entry is None:
                    sums[key] = [1, conversation.context_tokens]
                else:
                    entry[0] += 1
                    entry[1] += conversation.context_tokens
        return {key: Demand(count, context, count * self.state_tokens(key[1]))
                for key, (count, context) in sums.items()}

    def by_model(self, now: float,
                 live: dict[tuple[str, str], Demand] | None = None) -> dict[str, Demand]:
        """Demand per model label; every model seen has an entry (0 when none is live).
        ``live``: this tracker's ``live(now)``, when the caller has it already."""
        demand = {model: Demand() for model in self.models}
        for (model, _name), part in (self.live(now) if live is None else live).items():
            demand[model].merge(part)
        return demand

    def by_model_name(self, now: float, live: dict[tuple[str, str], Demand] | None = None
                      ) -> dict[str, Demand]:
        """Demand per model name as the events carry it (what attribution matches on)."""
        demand: dict[str, Demand] = {}
        for (_model, name), part in (self.live(now) if live is None else live).items():
            demand.setdefault(name, Demand()).merge(part)
        return demand

    def model_names(self) -> set[str]:
        return {conversation.model_name for conversation in self.by_key.values()}

    def __len__(self) -> int:
        return len(self.by_key)


# ---- which vLLM a model's conversations live on --------------------------------------------


def served_models(engine: EngineState) -> dict[str, set[str]]:
    """vLLM model_name -> the targets (as shown) that serve it, among those read last."""
    served: dict[str, set[str]] = {}
    for target in engine.targets.values():
        if not target.up:
            continue
        for row in target.rows:
            if row.model_name:
                served.setdefault(row.model_name, set()).add(target.shown)
    return served


def attribute(model_name: str, served: Mapping[str, set[str]]) -> tuple[str, str] | None:
    """The (target, vLLM model_name) whose pool a model's conversations occupy, or None.

    - The one target serving a model of that name.
    - Else, when every target read serves one and the same model on a single target, that
      one, whatever the proxy calls it (a LiteLLM alias, say).
    - Else nobody: several replicas serve it (conversations spread over pools the exporter
      cannot tell apart), or no target serves it. Per-model series still show the demand.
    """
    targets = served.get(model_name)
    if targets is None and len(served) == 1:
        model_name, targets = next(iter(served.items()))
    if targets is not None and len(targets) == 1:
        return next(iter(targets)), model_name
    return None


def by_target(tracker: ConversationTracker, engine: EngineState, now: float,
              live: dict[tuple[str, str], Demand] | None = None
              ) -> dict[tuple[str, str], Demand]:
    """Demand per (target, vLLM model_name), for the conversations that can be attributed;
    a target that any tracked model maps to has an entry even when nothing is live on it.
    ``live``: the tracker's ``live(now)``, when the caller has it already."""
    served = served_models(engine)
    demand: dict[tuple[str, str], Demand] = {}
    for model_name in sorted(tracker.model_names()):
        where = attribute(model_name, served)
        if where is not None:
            demand.setdefault(where, Demand())
    for model_name, part in tracker.by_model_name(now, live).items():
        where = attribute(model_name, served)
        if where is not None:
            demand[where].merge(part)
    return demand


# ---- the admission budget ------------------------------------------------------------------


def admission_budget(smallest_pool_tokens: int, headroom_tokens: int) -> int:
    """Tokens a token-gating proxy may admit at once: the smallest pool seen, less headroom.

    The pool moves from boot to boot with whatever else holds GPU memory at load time, so a
    budget under the largest or the latest one admits pairs that do not fit on a bad boot.
    """
    return max(0, smallest_pool_tokens - headroom_tokens)

