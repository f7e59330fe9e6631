"""Foresight: what shows a prefix-cache collapse coming, before the hit ratio falls.

The hit ratio only sees a collapse once it has happened. What decides it beforehand is
arithmetic the field reports (docs/field-reports.md) did by hand: "how many tokens of
conversation fit at once". Conversations keep their prefix cached only while what they hold
in the KV pool stays a few thousand tokens under it; past that, each arrival evicts
another's blocks. So this module keeps:

- the live conversations: each one's latest context (prompt + completion of its last turn)
  and when it was last seen, in an LRU of ``ForesightSettings.max_conversations``;
  "active" means a conversation (it has had a follow-up turn: one request alone, a test
  record posted by hand say, is no conversation yet) seen within
  ``conversation_idle_seconds`` and not ended by a restart of the vLLM it lives on
  (``end_on_target``). What they hold against the pool is the demand the rules and
  ``check`` compare;
- which vLLM a model's conversations live on (``attribute``), so demand can be set against
  that engine's pool, in that engine's terms (``kvpool.PoolLayout``, read from its
  ``vllm:cache_config_info``): each context in whole blocks at what a block is worth of the
  pool, and on a hybrid model its recurrent state: one copy per conversation (the checkpoint
  its next turn resumes from) and one more for the turn being computed (its live state);
- the admission budget a token-gating proxy should use: the smallest pool seen (kept in
  ``signals.engine``, across vLLM restarts) minus a headroom.

Pure: times are handed in, nothing is read from a clock or a socket.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from exporter.signals.engine import EngineState
from exporter.signals.kvpool import PoolLayout, layout
from exporter.values import UsageEvent

# Conversations remembered (least recently seen first out). An entry is a few hundred bytes
# (three strings of at most 256 characters, validated upstream, and four numbers).
DEFAULT_MAX_CONVERSATIONS = 10_000
# A conversation counts as live this long after its last turn: an agent waiting on a long
# tool call still wants its prefix back, and vLLM keeps it cached until something evicts it.
DEFAULT_IDLE_SECONDS = 600.0
# "A few thousand tokens under N": the field report's admission budget sat 3,732 tokens
# under its smallest pool.
DEFAULT_HEADROOM_TOKENS = 4096


@dataclass(frozen=True)
class ForesightSettings:
    """The ``signals.*`` flags of the conversation and admission signals."""

    conversation_idle_seconds: float = DEFAULT_IDLE_SECONDS
    max_conversations: int = DEFAULT_MAX_CONVERSATIONS
    # Model name (as usage events carry it) -> pool tokens one copy of its per-sequence
    # recurrent state takes, overriding what the engine's cache configuration implies.
    state_tokens: Mapping[str, int] = field(default_factory=dict)
    admission_headroom_tokens: int = DEFAULT_HEADROOM_TOKENS


class Conversation:
    """What is known of one conversation: its latest turn's prompt and context, when it was
    last seen, whether it has had a follow-up turn, and whether a vLLM restart ended it."""

    __slots__ = (
        "model_name",
        "model",
        "prompt_tokens",
        "context_tokens",
        "last_seen",
        "followed",
        "ended",
    )

    def __init__(
        self, model_name: str, model: str, prompt_tokens: int, context_tokens: int, last_seen: float
    ) -> None:
        self.model_name = model_name  # as the usage event names it
        self.model = model  # its label (after the model cap)
        # The classifier's "previous turn" for the next; None once a vLLM restart ended the
        # conversation (its next turn finds nothing cached, and is judged as a first turn).
        self.prompt_tokens: int | None = prompt_tokens
        self.context_tokens = context_tokens
        self.last_seen = last_seen
        # A later turn came with a longer prompt than the one before (a follow-up): only
        # then is it a conversation whose prefix a next turn wants back, and counted.
        self.followed = False
        # Its vLLM restarted after its last turn: what it had cached is gone, so it holds
        # nothing in the pool until it comes back (its next turn counts it again).
        self.ended = False

    @property
    def counted(self) -> bool:
        """Does it count as live demand (when seen within the idle window)?"""
        return self.followed and not self.ended


@dataclass
class Demand:
    """Live conversations of one model (or on one engine) and what they hold in the pool:
    their contexts, one copy of the recurrent state each (hybrid models: the checkpoint each
    next turn resumes from), and one more copy for the turn being computed (its live state;
    several models or names merged count it once, the largest)."""

    conversations: int = 0
    context_tokens: int = 0
    state_tokens: int = 0
    turn_state_tokens: int = 0

    @property
    def tokens(self) -> int:
        return (
            self.context_tokens
            + self.state_tokens
            + (self.turn_state_tokens if self.conversations else 0)
        )

    def merge(self, other: Demand) -> None:
        self.conversations += other.conversations
        self.context_tokens += other.context_tokens
        self.state_tokens += other.state_tokens
        self.turn_state_tokens = max(self.turn_state_tokens, other.turn_state_tokens)


class ConversationTracker:
    """The live conversations, keyed by (caller, model, session).

    A conversation is the usage events of one ``session`` (else of one caller and model).
    Its context is the prompt plus the completion of its latest successful turn: what the
    next turn will find in the cache if nothing evicts it; that turn's prompt is the
    classifier's "previous turn" for the next one. It counts as demand once it has had a
    follow-up turn (``Conversation.followed``), until it is idle or its vLLM restarts
    (``end_on_target``). Bounded by ``max_conversations``; a conversation dropped by the
    bound while still active is counted in ``dropped_active`` (the demand is then a lower
    bound), and its next turn is classified as a first one.
    """

    def __init__(self, settings: ForesightSettings) -> None:
        self.settings = settings
        self.idle_seconds = settings.conversation_idle_seconds
        self.max_conversations = max(1, settings.max_conversations)
        self._state_tokens = dict(settings.state_tokens)
        # (caller, model name, session) -> its conversation, least recently seen first.
        self.by_key: dict[tuple[str, str, str | None], Conversation] = {}
        self.dropped_active = 0
        self.ended_by_restart = 0  # conversations ended by a restart of their vLLM
        self.models: dict[str, None] = {}  # model labels seen, for series kept at 0
        # Turns held against the memory of their conversation, and those it cannot explain
        # (``check_history``), per model label; the largest context of any conversation on
        # each model label, what a conversation never seen may have cached from (a system
        # prompt, a chat template, a document shared across conversations and callers).
        self.turns: dict[str, int] = {}
        self.unseen_history: dict[str, int] = {}
        self.largest_context: dict[str, int] = {}

    def keep(
        self,
        key: tuple[str, str, str | None],
        known: Conversation | None,
        event: UsageEvent,
        model: str,
        now: float,
    ) -> None:
        """Put the conversation of ``key`` (taken out of ``by_key`` to read its previous
        turn, None for a new one) back with ``event`` as its latest turn (``model``: its model
        label), the oldest out past the bound (``now`` decides what was still live)."""
        prompt_tokens = event.prompt_tokens
        completion = event.completion_tokens
        context_tokens = prompt_tokens + completion if completion else prompt_tokens
        when = event.time
        if when is None:
            when = now
        if known is None:
            known = Conversation(event.model, model, prompt_tokens, context_tokens, when)
        else:
            previous = known.prompt_tokens
            if previous is not None and previous < prompt_tokens:
                known.followed = True
            known.ended = False  # back after a restart: it holds its new context again
            known.prompt_tokens = prompt_tokens
            known.context_tokens = context_tokens
            if when > known.last_seen:
                known.last_seen = when
        conversations = self.by_key
        conversations[key] = known
        largest = self.largest_context
        if largest.get(model, 0) < context_tokens:
            largest[model] = context_tokens  # model labels are capped: bounded
        if model not in self.models:
            self.models[model] = None
        if len(conversations) > self.max_conversations:
            self.drop_oldest(now)

    def check_history(
        self, known: Conversation | None, model: str, cached: int, granule: int
    ) -> None:
        """Count a turn that reported ``cached`` tokens against what this exporter saw of its
        conversation (``known``, taken out of ``by_key``; None: never seen): more than a
        granule past the context it held after its last turn (for one never seen, past the
        largest context of any conversation on the model, which a shared prefix may come
        from) means turns this exporter did not see put it there. A context without its
        completion (not reported) explains anything: the completion is unknown."""
        turns = self.turns
        turns[model] = turns.get(model, 0) + 1
        if known is None:
            explained = self.largest_context.get(model, 0)
        elif known.context_tokens == known.prompt_tokens:
            return
        else:
            explained = known.context_tokens
        if cached > explained + granule:
            self.unseen_history[model] = self.unseen_history.get(model, 0) + 1

    def drop_oldest(self, now: float) -> None:
        """Forget the least recently seen conversation (the bound is passed)."""
        oldest = self.by_key.pop(next(iter(self.by_key)))
        if oldest.counted and oldest.last_seen >= now - self.idle_seconds:
            self.dropped_active += 1

    def state_tokens(self, model_name: str, pool: PoolLayout | None = None) -> int:
        """Pool tokens one copy of a conversation's recurrent state takes on this model:
        ``--signals.state-tokens`` where given, else what its engine's layout implies."""
        configured = self._state_tokens.get(model_name)
        if configured is not None:
            return configured
        return round(pool.state_tokens) if pool is not None else 0

    def active(self, now: float) -> Iterator[Conversation]:
        """Conversations that count (``Conversation.counted``) seen within the idle window
        (a full scan: event times need not arrive in order, so recency of arrival says
        nothing; bounded by the LRU)."""
        cutoff = now - self.idle_seconds
        for conversation in self.by_key.values():
            if conversation.last_seen >= cutoff and conversation.counted:
                yield conversation

    def live(
        self, now: float, layouts: Mapping[str, PoolLayout] | None = None
    ) -> dict[tuple[str, str], Demand]:
        """Demand per (model label, model name) of the active conversations, in one pass
        (a scrape reads it once for every family that sums it differently). ``layouts``:
        model name -> the layout of the pool its conversations live in (``pool_layouts``);
        a context on a model without one counts its tokens as they are."""
        layouts = layouts or {}
        cutoff = now - self.idle_seconds
        # [conversations, context tokens, context blocks]
        sums: dict[tuple[str, str], list[int]] = {}
        for conversation in self.by_key.values():
            if conversation.last_seen >= cutoff and conversation.counted:
                key = (conversation.model, conversation.model_name)
                pool = layouts.get(conversation.model_name)
                context = conversation.context_tokens
                blocks = -(-context // pool.block_tokens) if pool is not None else 0
                entry = sums.get(key)
                if entry is None:
                    sums[key] = [1, context, blocks]
                else:
                    entry[0] += 1
                    entry[1] += context
                    entry[2] += blocks
        demand = {}
        for key, (count, context, blocks) in sums.items():
            pool = layouts.get(key[1])
            copy = self.state_tokens(key[1], pool)
            context_tokens = context if pool is None else round(blocks * pool.block_pool_tokens)
            demand[key] = Demand(count, context_tokens, count * copy, copy)
        return demand

    def by_model(
        self, now: float, live: dict[tuple[str, str], Demand] | None = None
    ) -> dict[str, Demand]:
        """Demand per model label; every model seen has an entry (0 when none is live).
        ``live``: this tracker's ``live(now, layouts)``, when the caller has it (without it,
        contexts count as they are, with no state but what is configured)."""
        demand = {model: Demand() for model in self.models}
        for (model, _name), part in (self.live(now) if live is None else live).items():
            demand[model].merge(part)
        return demand

    def by_model_name(
        self, now: float, live: dict[tuple[str, str], Demand] | None = None
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


def pool_layouts(engine: EngineState, model_names: Iterable[str]) -> dict[str, PoolLayout]:
    """Model name (as usage events carry it) -> the layout of the pool its conversations live
    in: that of the engine ``attribute`` names, else, for a model several replicas serve, the
    first replica's (replicas of one model are laid out alike)."""
    served = served_models(engine)
    found: dict[str, PoolLayout] = {}
    for model_name in model_names:
        where = attribute(model_name, served)
        if where is not None:
            candidates: list[tuple[str, str]] = [where]
        else:
            candidates = [(target, model_name) for target in sorted(served.get(model_name, ()))]
        for target, vllm_name in candidates:
            pool = _target_layout(engine, target, vllm_name)
            if pool is not None:
                found[model_name] = pool
                break
    return found


def _target_layout(engine: EngineState, shown: str, model_name: str) -> PoolLayout | None:
    for target in engine.targets.values():
        if target.shown != shown or not target.up:
            continue
        for row in target.rows:
            if row.model_name == model_name and row.cache_config is not None:
                pool = layout(row.cache_config)
                if pool is not None:
                    return pool
    return None


def live_demand(
    tracker: ConversationTracker, engine: EngineState, now: float
) -> dict[tuple[str, str], Demand]:
    """The tracker's ``live(now)``, each model in the terms of the pool it lives in."""
    return tracker.live(now, pool_layouts(engine, tracker.model_names()))


def by_target(
    tracker: ConversationTracker,
    engine: EngineState,
    now: float,
    live: dict[tuple[str, str], Demand] | None = None,
) -> dict[tuple[str, str], Demand]:
    """Demand per (target, vLLM model_name), for the conversations that can be attributed;
    a target that any tracked model maps to has an entry even when nothing is live on it.
    ``live``: ``live_demand(tracker, engine, now)``, when the caller has it already."""
    served = served_models(engine)
    demand: dict[tuple[str, str], Demand] = {}
    for model_name in sorted(tracker.model_names()):
        where = attribute(model_name, served)
        if where is not None:
            demand.setdefault(where, Demand())
    if live is None:
        live = live_demand(tracker, engine, now)
    for model_name, part in tracker.by_model_name(now, live).items():
        where = attribute(model_name, served)
        if where is not None:
            demand[where].merge(part)
    return demand


def end_on_target(
    tracker: ConversationTracker, engine: EngineState, shown: str, before: float
) -> int:
    """A vLLM restart: end the conversations attributed to the target shown as ``shown``
    whose last turn came at or before ``before`` (the restart), and return how many.

    What they had cached went with the process, so they hold nothing in its pool: their
    demand leaves the fit at once, and each one's next turn, which finds nothing cached, is
    judged as a first turn (cold, never a follow-up that came back cold, which the status
    page would take for a collapse). It counts again from that turn. Conversations of a
    model several targets serve are not attributed to any, so a restart of one of them ends
    none (which pool they were in cannot be told).
    """
    served = served_models(engine)
    ended = 0
    where: dict[str, tuple[str, str] | None] = {}
    for conversation in tracker.by_key.values():
        if conversation.ended or conversation.last_seen > before:
            continue
        name = conversation.model_name
        if name not in where:
            where[name] = attribute(name, served)
        attributed = where[name]
        if attributed is not None and attributed[0] == shown:
            conversation.ended = True
            conversation.prompt_tokens = None
            ended += 1
    tracker.ended_by_restart += ended
    return ended


# ---- the admission budget ------------------------------------------------------------------


def admission_budget(smallest_pool_tokens: int, headroom_tokens: int) -> int:
    """Tokens a token-gating proxy may admit at once: the smallest pool seen, less headroom.

    The pool moves from boot to boot with whatever else holds GPU memory at load time, so a
    budget under the largest or the latest one admits pairs that do not fit on a bad boot.
    """
    return max(0, smallest_pool_tokens - headroom_tokens)
