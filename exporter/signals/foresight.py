"""Foresight: what shows a prefix-cache collapse coming, before the hit ratio falls.

The hit ratio only sees a collapse once it has happened. What decides it beforehand is
arithmetic the field reports (docs/field-reports.md) did by hand: "how many tokens of
conversation fit at once". Conversations keep their prefix cached only while what they hold
in the KV pool stays a few thousand tokens under it; past that, each arrival evicts
another's blocks. So this module keeps:

- the live conversations: each one's latest context (prompt + completion of its last turn)
  and when it was last seen, in an LRU of ``ForesightSettings.max_conversations``, and the
  fingerprints of those it dropped while they were recent (``ConversationTracker.recall``:
  their next turns are ``unknown``, never taken for first turns);
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

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice

from exporter.signals.engine import EngineState
from exporter.signals.kvpool import PoolLayout, layout
from exporter.values import RecentKeys, UsageEvent

# Conversations remembered (least recently seen first out). Each is keyed by the 64-bit hash
# of (caller, model name, session) and shares its model name with the others, so what one
# costs does not depend on how long the names are: about 280 bytes (measured with tracemalloc,
# tests/usage/test_dropped_conversations.py), 28 MB at 100,000, and 90 bytes for the key of
# one dropped while recent (``ConversationTracker.forgotten``): 42 MB at worst. 100,000 is five
# times the 20,000 live conversations 10,000 failed (issue 32); a scrape scans them in about
# 50 ms (docs/limits.md).
DEFAULT_MAX_CONVERSATIONS = 100_000
# Raw model names kept once for every conversation that names them. Past this many, a
# conversation of yet another name keeps its model label in its place (attribution then
# matches on the label): a sender inventing names cannot make each conversation hold one.
MAX_MODEL_NAMES = 256
# (engine target, model name) pairs whose series are kept at 0 when nothing is live there:
# targets are capped by --callers.targets-max (256), model names as above; a guard.
MAX_POOLS = 4096
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
        "target",
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
        # The engine target (as shown) that served its latest turn, where the usage named
        # it and this exporter reads that vLLM: its context is in that pool, whichever
        # replicas serve its model (``by_target``). None: attributed by model (``attribute``).
        self.target: str | None = None

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


def conversation_key(caller: str, model_name: str, session: str | None) -> int:
    """The key of a conversation in ``ConversationTracker.by_key``: the 64-bit hash of
    (caller, model name, session), whatever their lengths (that two of 100,000 live
    conversations share one has odds under 1 in 10^9: a turn of one would then be judged
    against the other's). ``UsageState._record`` inlines it."""
    return hash((caller, model_name, session))


class ConversationTracker:
    """The live conversations, keyed by ``conversation_key`` (caller, model, session).

    A conversation is the usage events of one ``session`` (else of one caller and model).
    Its context is the prompt plus the completion of its latest successful turn: what the
    next turn will find in the cache if nothing evicts it; that turn's prompt is the
    classifier's "previous turn" for the next one. It counts as demand once it has had a
    follow-up turn (``Conversation.followed``), until it is idle or its vLLM restarts
    (``end_on_target``). Bounded by ``max_conversations``; a conversation dropped by the
    bound while still active is counted in ``dropped_active`` (the demand is then a lower
    bound).

    A conversation dropped while seen within the idle window (active, or not followed
    yet: with more live conversations than the bound, one is dropped before its second
    turn) leaves its key in ``forgotten``, so that its next turn, whose previous one is
    lost, is told from a first turn (``recall``): the classifier cannot judge it, and says
    ``unknown`` instead of misreading a warm follow-up as partial. ``forgotten`` holds
    ``max_conversations`` keys at most and the newest half of them at least (``RecentKeys``
    without a time limit, about 90 bytes a key); past that, the oldest half goes, and
    those conversations' next turns are judged as first turns again (``forgotten.
    forgotten_early`` counts them). Keys of conversations that never come back (a session
    id per request) fill it harmlessly.
    """

    def __init__(self, settings: ForesightSettings) -> None:
        self.settings = settings
        self.idle_seconds = settings.conversation_idle_seconds
        self.max_conversations = max(1, settings.max_conversations)
        self._state_tokens = dict(settings.state_tokens)
        # conversation_key -> its conversation, least recently seen first.
        self.by_key: dict[int, Conversation] = {}
        # Past the bound, this many more are dropped at once (1/256 of it: none below 256):
        # a dict finds its oldest entry only past every entry deleted before it (at 100,000
        # full, one at a time took 70 us and more a turn; an OrderedDict would not, but the
        # scans, one a scrape, took 2.5 to 8 times as long, its nodes scattered by the churn).
        self.drop_batch = self.max_conversations // 256
        self.forgotten = RecentKeys(self.max_conversations, math.inf)
        self.dropped_turns = 0  # turns of forgotten conversations (classified unknown)
        self._names: dict[str, str] = {}  # raw model name -> the one copy conversations hold
        self.dropped_active = 0
        self.ended_by_restart = 0  # conversations ended by a restart of their vLLM
        self.models: dict[str, None] = {}  # model labels seen, for series kept at 0
        # (engine target, model name) that served a conversation's turn, for series kept at
        # 0 (``by_target``); at most MAX_POOLS.
        self.pools: dict[tuple[str, str], None] = {}
        # Turns held against the memory of their conversation, and those it cannot explain
        # (``check_history``), per model label; the largest context of any conversation on
        # each model label, what a conversation never seen may have cached from (a system
        # prompt, a chat template, a document shared across conversations and callers).
        self.turns: dict[str, int] = {}
        self.unseen_history: dict[str, int] = {}
        self.largest_context: dict[str, int] = {}

    def keep(
        self,
        key: int,
        known: Conversation | None,
        event: UsageEvent,
        model: str,
        now: float,
        recalled: bool = False,
        target: str | None = None,
    ) -> None:
        """Put the conversation of ``key`` (taken out of ``by_key`` to read its previous
        turn, None for one not there) back with ``event`` as its latest turn (``model``: its
        model label), the oldest out past the bound (``now`` decides what was still live).
        ``recalled``: it was dropped by the bound while recent (``recall``), so it is a
        conversation already, and counts as one. ``target``: the engine target that served
        the turn (a backend this exporter reads, ``UsageState._record``), None when not known."""
        prompt_tokens = event.prompt_tokens
        completion = event.completion_tokens
        context_tokens = prompt_tokens + completion if completion else prompt_tokens
        when = event.time
        if when is None:
            when = now
        if known is None:
            names = self._names
            name = names.get(event.model)
            if name is None:
                name = event.model
                if len(names) < MAX_MODEL_NAMES:
                    names[name] = name
                else:
                    name = model
            known = Conversation(name, model, prompt_tokens, context_tokens, when)
            known.followed = recalled
        else:
            previous = known.prompt_tokens
            if previous is not None and previous < prompt_tokens:
                known.followed = True
            known.ended = False  # back after a restart: it holds its new context again
            known.prompt_tokens = prompt_tokens
            known.context_tokens = context_tokens
            if when > known.last_seen:
                known.last_seen = when
        if target is not None and known.target is not target:
            known.target = target
            pools = self.pools
            if len(pools) < MAX_POOLS:
                pools[(target, known.model_name)] = None
        conversations = self.by_key
        conversations[key] = known
        largest = self.largest_context
        if largest.get(model, 0) < context_tokens:
            largest[model] = context_tokens  # model labels are capped: bounded
        if model not in self.models:
            self.models[model] = None
        if len(conversations) > self.max_conversations:
            self.drop_oldest(now)

    def recall(self, key: int, now: float) -> bool:
        """Is ``key`` (not in ``by_key``) that of a conversation the bound dropped while it
        was recent? Its turn is then counted in ``dropped_turns``, and the key forgotten: the
        turn starts the conversation again (``keep(..., recalled=True)``)."""
        forgotten = self.forgotten
        if not len(forgotten) or forgotten.get(key, now) is None:
            return False
        forgotten.pop(key)
        self.dropped_turns += 1
        return True

    def check_history(
        self, known: Conversation | None, model: str, cached: int, granule: int
    ) -> bool:
        """Count a turn that reported ``cached`` tokens against what this exporter saw of its
        conversation (``known``, taken out of ``by_key``; None: never seen): more than a
        granule past the context it held after its last turn (for one never seen, past the
        largest context of any conversation on the model, which a shared prefix may come
        from) means turns this exporter did not see put it there. A context without its
        completion (not reported) explains anything: the completion is unknown. True when
        the turn is one of those (its previous turn here is not all of its history)."""
        turns = self.turns
        turns[model] = turns.get(model, 0) + 1
        if known is None:
            explained = self.largest_context.get(model, 0)
        elif known.context_tokens == known.prompt_tokens:
            return False
        else:
            explained = known.context_tokens
        if cached > explained + granule:
            self.unseen_history[model] = self.unseen_history.get(model, 0) + 1
            return True
        return False

    def drop_oldest(self, now: float) -> None:
        """The bound is passed: forget the least recently seen conversation, and
        ``drop_batch`` more. Of those seen within the idle window, keep the key in
        ``forgotten`` (unless a vLLM restart ended it: its next turn is a first one anyway),
        and count the active ones."""
        conversations = self.by_key
        pop = conversations.pop
        cutoff = now - self.idle_seconds
        forget = self.forgotten.put
        for key in list(islice(conversations, 1 + self.drop_batch)):
            oldest = pop(key)
            if oldest.last_seen < cutoff:
                continue  # idle: no longer live, its next turn judged as a first one
            if oldest.prompt_tokens is not None:
                forget(key, True, now)
            if oldest.counted:
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
    ) -> dict[tuple[str, str, str | None], Demand]:
        """Demand per (model label, model name, engine target or None: ``Conversation.
        target``) of the active conversations, in one pass
        (a scrape reads it once for every family that sums it differently). ``layouts``:
        model name -> the layout of the pool its conversations live in (``pool_layouts``);
        a context on a model without one counts its tokens as they are."""
        layouts = layouts or {}
        cutoff = now - self.idle_seconds
        # [conversations, context tokens, context blocks]
        sums: dict[tuple[str, str, str | None], list[int]] = {}
        for conversation in self.by_key.values():
            if conversation.last_seen >= cutoff and conversation.counted:
                key = (conversation.model, conversation.model_name, conversation.target)
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
        self, now: float, live: dict[tuple[str, str, str | None], Demand] | None = None
    ) -> dict[str, Demand]:
        """Demand per model label; every model seen has an entry (0 when none is live).
        ``live``: this tracker's ``live(now, layouts)``, when the caller has it (without it,
        contexts count as they are, with no state but what is configured)."""
        demand = {model: Demand() for model in self.models}
        for (model, _name, _target), part in (self.live(now) if live is None else live).items():
            demand[model].merge(part)
        return demand

    def by_model_name(
        self, now: float, live: dict[tuple[str, str, str | None], Demand] | None = None
    ) -> dict[tuple[str, str | None], Demand]:
        """Demand per (model name as the events carry it, engine target or None): what
        attribution matches on."""
        demand: dict[tuple[str, str | None], Demand] = {}
        for (_model, name, target), part in (self.live(now) if live is None else live).items():
            demand.setdefault((name, target), Demand()).merge(part)
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
) -> dict[tuple[str, str, str | None], Demand]:
    """The tracker's ``live(now)``, each model in the terms of the pool it lives in."""
    return tracker.live(now, pool_layouts(engine, tracker.model_names()))


def on_target(
    shown: str | None, model_name: str, served: Mapping[str, set[str]]
) -> tuple[str, str] | None:
    """The (target, vLLM model_name) whose pool a conversation occupies: the engine target
    that served its latest turn (``Conversation.target``) with the model of that name it
    serves, or the one model it serves whatever the proxy calls it; else, or with no
    target known, ``attribute``'s answer for its model."""
    if shown is not None:
        names = [name for name, targets in served.items() if shown in targets]
        if model_name in names:
            return shown, model_name
        if len(names) == 1:
            return shown, names[0]
    return attribute(model_name, served)


def by_target(
    tracker: ConversationTracker,
    engine: EngineState,
    now: float,
    live: dict[tuple[str, str, str | None], Demand] | None = None,
) -> dict[tuple[str, str], Demand]:
    """Demand per (target, vLLM model_name), for the conversations that can be attributed
    (``on_target``: by the replica that served them, else by model); a target that any
    tracked model maps to, or that served a tracked conversation, has an entry even when
    nothing is live on it. ``live``: ``live_demand(tracker, engine, now)``, when the caller
    has it already."""
    served = served_models(engine)
    demand: dict[tuple[str, str], Demand] = {}
    for model_name in sorted(tracker.model_names()):
        where = attribute(model_name, served)
        if where is not None:
            demand.setdefault(where, Demand())
    for pool_target, model_name in tracker.pools:
        where = on_target(pool_target, model_name, served)
        if where is not None:
            demand.setdefault(where, Demand())
    if live is None:
        live = live_demand(tracker, engine, now)
    for (model_name, served_by), part in tracker.by_model_name(now, live).items():
        where = on_target(served_by, model_name, served)
        if where is not None:
            demand.setdefault(where, Demand()).merge(part)
    return demand


def end_on_target(
    tracker: ConversationTracker, engine: EngineState, shown: str, before: float
) -> int:
    """A vLLM restart: end the conversations attributed to the target shown as ``shown``
    whose last turn came at or before ``before`` (the restart), and return how many.

    What they had cached went with the process, so they hold nothing in its pool: their
    demand leaves the fit at once, and each one's next turn, which finds nothing cached, is
    judged as a first turn (cold, never a follow-up that came back cold, which the status
    page would take for a collapse). It counts again from that turn. A conversation is in
    the pool of the replica that served its latest turn where the usage named it
    (``on_target``); else, of a model several targets serve, it is attributed to none, and
    a restart of one of them ends none (which pool it was in cannot be told).
    """
    served = served_models(engine)
    ended = 0
    where: dict[tuple[str, str | None], tuple[str, str] | None] = {}
    for conversation in tracker.by_key.values():
        if conversation.ended or conversation.last_seen > before:
            continue
        key = (conversation.model_name, conversation.target)
        if key not in where:
            where[key] = on_target(conversation.target, conversation.model_name, served)
        attributed = where[key]
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
