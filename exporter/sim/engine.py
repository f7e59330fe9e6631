"""The engine model: scheduling, prefill, decode and preemption over a KV pool, in pure code.

Nothing here reads a clock or awaits anything. The caller hands in the time (``submit``,
``advance``) and collects what happened (``drain``): requests admitted, first tokens,
preemptions, finishes. Between two events every rate is constant, so the model jumps from
event to event (``next_event_time``) instead of ticking, and a 90,000-token conversation
costs a handful of steps whether it plays in wall-clock time or in virtual time.

The behaviours the field reports (docs/field-reports.md) depend on:

- A request's prompt is looked up in the prefix cache when it is admitted; reuse starts at
  the first token, comes in whole granules G, never covers the last prompt token, and on a
  hybrid model only resumes where a recurrent-state checkpoint was saved:
  cached = floor(min(shared prefix in the pool, n - 1) / G) * G.
- Admission allocates the whole prompt's blocks (evicting least recently released cached
  blocks); a request that does not fit waits, and the queue is first come, first served.
- Prompts are read one at a time at ``prefill_rate`` tokens/s (slowed by
  ``prefill_interference`` per stream decoding beside it); streams decode together, each at
  ``decode_rate / (1 + decode_slowdown * (streams - 1))``.
- TTFT = queue wait + uncached tokens / prefill rate.
- A decoding stream that needs a block when none can be freed preempts the most recently
  admitted request (vLLM's policy): its blocks go back to the pool, it is counted, and it
  recomputes later from what is still cached.
- With ``kv_cache_metrics`` (vLLM's ``--kv-cache-metrics``) a sample of the reusable blocks
  is followed from allocation (the admission that computes it) through its prefix-cache hits
  (the admissions that reuse it) to its eviction, which is reported (``Evicted``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from exporter.sim.kvcache import BlockPool, CachedBlock, Residency, ResidencySampler, block_keys

EPSILON = 1e-9


# Recurrent-state copies of one running sequence (and vLLM's reserve per request, per state
# group): live state and checkpoint with prefix caching, the live state alone without.
STATE_COPIES_CACHED = 2
STATE_COPIES_UNCACHED = 1


class EngineConfigError(ValueError):
    pass


@dataclass(frozen=True)
class EngineConfig:
    """The simulated vLLM's settings; names follow vLLM's flags where vLLM has one."""

    served_model_name: str = "sim-llama"
    kv_pool_tokens: int = 262_144
    block_size: int = 16
    granularity: int = 0  # tokens per reusable granule; 0 = block_size
    hybrid: bool = False
    enable_prefix_caching: bool | None = None  # None: vLLM's default (off for hybrid here)
    enable_prompt_tokens_details: bool = False
    enable_per_request_metrics: bool = False
    max_model_len: int = 0  # 0: the pool size, capped at 131,072
    max_num_seqs: int = 256
    prefill_rate: float = 9_500.0  # prompt tokens/s, one prompt at a time
    decode_rate: float = 60.0  # tokens/s of one stream decoding alone
    decode_slowdown: float = 0.14  # per extra decoding stream
    prefill_interference: float = 0.0  # prefill slowdown per decoding stream
    state_tokens: int = 0  # pool tokens one recurrent-state copy takes (hybrid models)
    gpu_memory_utilization: float = 0.92
    cache_dtype: str = "auto"
    kv_cache_metrics: bool = False  # vLLM's --kv-cache-metrics: KV residency histograms
    kv_cache_metrics_sample: float = 0.01  # share of blocks followed (vLLM's default)

    def __post_init__(self) -> None:
        checks = (
            (self.kv_pool_tokens >= self.block_size, "kv_pool_tokens must hold one block"),
            (self.block_size > 0, "block_size must be positive"),
            (self.granularity >= 0, "granularity must not be negative"),
            (
                self.granularity % self.block_size == 0 if self.block_size > 0 else True,
                "granularity must be a multiple of block_size",
            ),
            (self.max_model_len >= 0, "max_model_len must not be negative"),
            (self.max_num_seqs > 0, "max_num_seqs must be positive"),
            (self.prefill_rate > 0, "prefill_rate must be positive"),
            (self.decode_rate > 0, "decode_rate must be positive"),
            (self.decode_slowdown >= 0, "decode_slowdown must not be negative"),
            (self.prefill_interference >= 0, "prefill_interference must not be negative"),
            (self.state_tokens >= 0, "state_tokens must not be negative"),
            (
                0 < self.kv_cache_metrics_sample <= 1,
                "kv_cache_metrics_sample must be above 0 and at most 1",
            ),
            (bool(self.served_model_name), "served_model_name must not be empty"),
        )
        for ok, problem in checks:
            if not ok:
                raise EngineConfigError(problem)

    @property
    def prefix_caching(self) -> bool:
        """vLLM < 0.26 held prefix caching back for hybrid models unless asked (report 000)."""
        if self.enable_prefix_caching is None:
            return not self.hybrid
        return self.enable_prefix_caching

    @property
    def granule(self) -> int:
        return self.granularity or self.block_size

    @property
    def context_limit(self) -> int:
        return self.max_model_len or min(self.kv_pool_tokens, 131_072)

    @property
    def state_blocks(self) -> int:
        """Blocks one copy of a sequence's recurrent state takes (one per state group)."""
        if not self.hybrid or not self.state_tokens:
            return 0
        return -(-self.state_tokens // self.block_size)

    @property
    def state_copies(self) -> int:
        """Copies of its state a running sequence holds, and vLLM reserves per request: with
        prefix caching the live state and the checkpoint its next turn resumes from (as
        vLLM's "align" mode keeps them for a gated-DeltaNet hybrid); without, the live one."""
        return STATE_COPIES_CACHED if self.prefix_caching else STATE_COPIES_UNCACHED

    @property
    def blocks_per_request(self) -> int:
        """Blocks vLLM sets aside for one request of ``context_limit`` tokens when it sizes
        its concurrency: the attention blocks, and the state copies of every state group."""
        return -(-self.context_limit // self.block_size) + self.state_copies * self.state_blocks

    @property
    def num_blocks(self) -> int:
        """The pool's blocks. ``kv_pool_tokens`` is the pool as vLLM prints it (what the field
        reports quote): in tokens of full-length requests, ``kv_cache_max_concurrency`` of
        them, each taking ``blocks_per_request`` blocks. On a dense model that is the blocks'
        own tokens; a hybrid one, whose requests also reserve state blocks, has more blocks
        than ``kv_pool_tokens / block_size``."""
        if not self.hybrid:
            return self.kv_pool_tokens // self.block_size
        return round(self.kv_pool_tokens * self.blocks_per_request / self.context_limit)

    @property
    def pool_tokens(self) -> int:
        """Tokens the pool's blocks hold."""
        return self.num_blocks * self.block_size


# Request states
WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"


@dataclass(eq=False)
class Request:
    """One request inside the engine."""

    request_id: str
    prompt: Sequence[int]
    output: Sequence[int]  # the tokens it will generate (max_tokens of them)
    arrival: float
    max_tokens: int  # what it will generate
    state: str = WAITING
    generated: float = 0.0  # output tokens produced so far (fractional between events)
    remaining_prefill: float = 0.0
    hashed: list[CachedBlock] = field(default_factory=list)
    private_kv: int = 0  # KV blocks held that are not (yet) reusable
    state_held: int = 0  # pool blocks held for recurrent state (live + pending checkpoint)
    hit_tokens: int = 0  # cached tokens at first admission (what usage reports)
    hit_block: CachedBlock | None = None
    computed_on_admission: int = 0
    admitted_at: float | None = None  # first admission
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str = ""
    preemptions: int = 0
    new_cached_tokens: int = 0  # tokens this request added to the prefix cache
    blocked_at: int = -1  # pool version when admission last failed
    # max_tokens as the request declared it, when the answer ends before (0: max_tokens):
    # it decides whether the request fits the context window, not how much is written.
    declared_max_tokens: int = 0
    allocated_at: float = 0.0  # when its latest admission allocated its blocks
    _keys: list[int] | None = None  # chain keys of prompt + output, computed once

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def generated_tokens(self) -> int:
        return min(self.max_tokens, int(self.generated + EPSILON))

    @property
    def kv_blocks(self) -> int:
        return len(self.hashed) + self.private_kv


@dataclass(frozen=True)
class Admitted:
    seq: Request
    time: float
    hit_tokens: int
    resumed: bool


@dataclass(frozen=True)
class FirstToken:
    seq: Request
    time: float


@dataclass(frozen=True)
class Preempted:
    seq: Request
    time: float


@dataclass(frozen=True)
class Finished:
    seq: Request
    time: float
    reason: str  # length | abort | error


@dataclass(frozen=True)
class Rejected:
    seq: Request
    time: float
    message: str


@dataclass(frozen=True)
class Evicted:
    """A sampled block was evicted to make room for ``seq`` (with ``kv_cache_metrics``)."""

    seq: Request
    time: float
    residency: Residency


EngineEvent = Admitted | FirstToken | Preempted | Finished | Rejected | Evicted


class Engine:
    def __init__(self, config: EngineConfig, start_time: float = 0.0) -> None:
        self.config = config
        self.now = start_time
        self.pool = BlockPool(config.num_blocks)
        self.residency = (
            ResidencySampler(config.kv_cache_metrics_sample) if config.kv_cache_metrics else None
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the last is preempted first
        self.prefilling: Request | None = None
        self.decoding: list[Request] = []
        self.preemptions = 0
        self._outbox: list[EngineEvent] = []
        self._by_id: dict[str, Request] = {}

    # ---- the caller's side -------------------------------------------------------------

    def submit(self, seq: Request, now: float) -> None:
        """Queue a request that arrived at ``now`` (events up to ``now`` are played first)."""
        self.advance(now)
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id} is already in the engine")
        limit = self.config.context_limit
        declared = max(seq.max_tokens, seq.declared_max_tokens)
        if seq.prompt_tokens + declared > limit:
            self._reject(
                seq,
                f"This model's maximum context length is {limit} tokens. "
                f"However, you requested {seq.prompt_tokens + declared} "
                f"tokens ({seq.prompt_tokens} in the messages, "
                f"{declared} in the completion).",
            )
            return
        if seq.prompt_tokens == 0:
            self._reject(seq, "The prompt is empty.")
            return
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)
        self._schedule()

    def abort(self, request_id: str, now: float) -> None:
        """The client went away: free what the request holds and count it as aborted."""
        self.advance(now)
        seq = self._by_id.get(request_id)
        if seq is None or seq.state == DONE:
            return
        if seq.state == WAITING:
            self.waiting.remove(seq)
        else:
            self._stop_running(seq)
            self._release(seq)
        self._finish(seq, "abort")
        self._schedule()

    def advance(self, now: float) -> None:
        """Play every event up to ``now``."""
        if now < self.now - EPSILON:
            raise ValueError("time went backwards")
        while True:
            when = self.next_event_time()
            if when is None or when > now + EPSILON:
                break
            self._progress(max(when, self.now))
            self._handle_due()
        self._progress(max(now, self.now))

    def next_event_time(self) -> float | None:
        """When the next internal event happens, given no new arrivals (None: idle)."""
        best: float | None = None
        if self.prefilling is not None:
            rate = self._prefill_rate()
            best = self.now + max(0.0, self.prefilling.remaining_prefill) / rate
        if self.decoding:
            rate = self._decode_rate()
            for seq in self.decoding:
                target = min(seq.max_tokens, self._decode_capacity(seq))
                when = self.now + max(0.0, target - seq.generated) / rate
                if best is None or when < best:
                    best = when
        return best

    def drain(self) -> list[EngineEvent]:
        out, self._outbox = self._outbox, []
        return out

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    # ---- views for /metrics ------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        """vLLM's kv_cache_usage_perc: blocks pinned by live requests, as a fraction."""
        return self.pool.pinned / self.pool.num_blocks

    # ---- rates -------------------------------------------------------------------------

    def _prefill_rate(self) -> float:
        cfg = self.config
        return cfg.prefill_rate / (1.0 + cfg.prefill_interference * len(self.decoding))

    def _decode_rate(self) -> float:
        cfg = self.config
        return cfg.decode_rate / (1.0 + cfg.decode_slowdown * max(0, len(self.decoding) - 1))

    def _decode_capacity(self, seq: Request) -> int:
        """Output tokens the sequence's KV blocks can hold before it needs another block."""
        return seq.kv_blocks * self.config.block_size - seq.prompt_tokens

    # ---- time --------------------------------------------------------------------------

    def _progress(self, to: float) -> None:
        elapsed = to - self.now
        if elapsed <= 0:
            return
        if self.prefilling is not None:
            self.prefilling.remaining_prefill -= elapsed * self._prefill_rate()
        if self.decoding:
            step = elapsed * self._decode_rate()
            for seq in self.decoding:
                seq.generated += step
        self.now = to

    def _handle_due(self) -> None:
        """Handle every event due now; the tolerance is in seconds, so float noise in the
        token counts can never leave an event pending at the current time."""
        decode_rate = self._decode_rate()
        due = [
            seq
            for seq in self.decoding
            if (min(seq.max_tokens, self._decode_capacity(seq)) - seq.generated) / decode_rate
            <= EPSILON
        ]
        seq = self.prefilling
        if seq is not None and seq.remaining_prefill / self._prefill_rate() <= EPSILON:
            self._prefill_done(seq)
            if seq.state == DECODE:
                due.append(seq)
        for seq in due:
            if seq.state != DECODE:  # preempted by an earlier one in this loop
                continue
            if seq.generated + EPSILON * decode_rate >= seq.max_tokens:
                seq.generated = float(seq.max_tokens)
                self._complete(seq)
            elif seq.generated + EPSILON * decode_rate >= self._decode_capacity(seq):
                self._grow(seq)
        self._schedule()

    # ---- scheduling --------------------------------------------------------------------

    def _schedule(self) -> None:
        """Admit the head of the queue when the prefill lane is free and its blocks fit."""
        while self.prefilling is None and self.waiting:
            seq = self.waiting[0]
            if len(self.running) >= self.config.max_num_seqs:
                return
            if not self._admit(seq):
                if not self.running:
                    self.waiting.popleft()
                    self._reject(
                        seq,
                        "The request does not fit in the KV cache "
                        f"({self.config.kv_pool_tokens} tokens).",
                    )
                    continue
                return
            self.waiting.popleft()

    def _keys(self, seq: Request, length: int) -> list[int]:
        """Chain keys of the first ``length`` tokens of prompt + output (a prefix of one list:
        a block's key depends only on the tokens up to its end)."""
        if seq._keys is None:
            seq._keys = block_keys(list(seq.prompt) + list(seq.output), self.config.block_size)
        return seq._keys[: length // self.config.block_size]

    def _tokens_to_compute(self, seq: Request) -> Sequence[int]:
        """The prompt, plus what was already generated when a preempted request resumes."""
        done = seq.generated_tokens
        if done == 0:
            return seq.prompt
        return list(seq.prompt) + list(seq.output[:done])

    def _lookup(self, tokens: Sequence[int], keys: list[int]) -> tuple[int, list[CachedBlock]]:
        """(cached tokens, cached blocks to pin) for a prompt: whole granules, n-1 at most."""
        cfg = self.config
        if not cfg.prefix_caching:
            return 0, []
        block = cfg.block_size
        granule = cfg.granule
        matched = self.pool.match(keys)
        limit = min(len(matched) * block, len(tokens) - 1)
        hit = limit // granule * granule
        if cfg.hybrid:
            # Only a saved recurrent state lets a hybrid model resume mid-prompt.
            while hit > 0 and not matched[hit // block - 1].checkpoint:
                hit -= granule
        return hit, matched[: hit // block]

    def _admit(self, seq: Request) -> bool:
        cfg = self.config
        resumed = seq.admitted_at is not None
        if seq.blocked_at == self.pool.version:
            return False  # nothing was freed since it last did not fit
        tokens = self._tokens_to_compute(seq)
        hit, hit_blocks = self._lookup(tokens, self._keys(seq, len(tokens)))
        total_blocks = -(-len(tokens) // cfg.block_size)
        new_blocks = total_blocks - len(hit_blocks)
        states = cfg.state_blocks * cfg.state_copies  # live + checkpoint
        needed = new_blocks + states
        if needed > self.pool.available(hit_blocks):
            seq.blocked_at = self.pool.version
            return False
        for block in hit_blocks:
            self.pool.acquire(block)
            if self.residency is not None:
                self.residency.hit(block, self.now)
        allocated = self._allocate(seq, needed)
        assert allocated, "availability was checked"
        seq.allocated_at = self.now
        seq.hashed = list(hit_blocks)
        seq.private_kv = new_blocks
        seq.state_held = states
        seq.hit_block = hit_blocks[-1] if hit_blocks else None
        seq.remaining_prefill = float(len(tokens) - hit)
        seq.state = PREFILL
        self.prefilling = seq
        self.running.append(seq)
        if not resumed:
            seq.admitted_at = self.now
            seq.hit_tokens = hit
            seq.computed_on_admission = len(tokens) - hit
        self._outbox.append(Admitted(seq, self.now, hit, resumed))
        return True

    def _prefill_done(self, seq: Request) -> None:
        self.prefilling = None
        self._cache_computed(seq, self._tokens_to_compute(seq))
        seq.state = DECODE
        self.decoding.append(seq)
        if seq.first_token_at is None:
            seq.first_token_at = self.now
            seq.generated = 1.0
            self._outbox.append(FirstToken(seq, self.now))
        if seq.generated + EPSILON >= seq.max_tokens:
            self._complete(seq)

    def _cache_computed(self, seq: Request, tokens: Sequence[int]) -> None:
        """Make the request's computed full blocks reusable and save its checkpoint."""
        cfg = self.config
        if not cfg.prefix_caching:
            return
        pool = self.pool
        start = len(seq.hashed)
        added = 0
        for key in self._keys(seq, len(tokens))[start:]:
            block = pool.register(key)
            if block is None:  # another request computed the same block meanwhile
                block = pool.blocks[key]
                pool.acquire(block)
                pool.give_back(1)
            else:
                added += 1
                if self.residency is not None:
                    self.residency.allocated(block, seq.allocated_at)
            seq.hashed.append(block)
            seq.private_kv -= 1
        seq.new_cached_tokens += added * cfg.block_size
        if not cfg.hybrid:
            return
        state = cfg.state_blocks
        checkpoint_at = (len(tokens) - 1) // cfg.granule * cfg.granule
        pending = state if seq.state_held > state else 0  # the checkpoint's reserved state
        if checkpoint_at > 0 and checkpoint_at // cfg.block_size <= len(seq.hashed):
            target = seq.hashed[checkpoint_at // cfg.block_size - 1]
            if not target.checkpoint:
                pool.add_checkpoint(target, pending)
                seq.state_held -= pending
                pending = 0
                old = seq.hit_block
                if old is not None and old is not target and old.checkpoint:
                    # The conversation moved on: keep only its latest replay point.
                    pool.drop_checkpoint(old, state)
        if pending:
            pool.give_back(pending)
            seq.state_held -= pending

    def _grow(self, seq: Request) -> None:
        """Give a decoding stream one more block, preempting others if the pool is full."""
        while not self._allocate(seq, 1):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return
        seq.private_kv += 1

    def _preempt(self, seq: Request) -> None:
        self._stop_running(seq)
        self._release(seq)
        seq.generated = float(seq.generated_tokens)
        seq.state = WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        self._outbox.append(Preempted(seq, self.now))

    def _complete(self, seq: Request) -> None:
        self._stop_running(seq)
        self._cache_output(seq)
        self._release(seq)
        # An answer that ended before the declared max_tokens stopped by itself.
        self._finish(seq, "stop" if seq.declared_max_tokens > seq.max_tokens else "length")

    def _cache_output(self, seq: Request) -> None:
        """Full blocks that now hold generated tokens become reusable too (dense models)."""
        cfg = self.config
        if not cfg.prefix_caching or seq.private_kv <= 0:
            return
        keys = self._keys(seq, seq.prompt_tokens + seq.generated_tokens)
        for key in keys[len(seq.hashed) :]:
            if seq.private_kv <= 0:
                break
            block = self.pool.register(key)
            if block is None:
                break
            if self.residency is not None:  # filled while decoding: followed from now
                self.residency.allocated(block, self.now)
            seq.hashed.append(block)
            seq.private_kv -= 1

    def _allocate(self, seq: Request, count: int) -> bool:
        """Take ``count`` blocks for ``seq``; report the sampled blocks this evicts."""
        allocated = self.pool.allocate(count)
        if self.residency is not None:
            for block in self.pool.just_evicted:
                residency = self.residency.evicted(block, self.now)
                if residency is not None:
                    self._outbox.append(Evicted(seq, self.now, residency))
        return allocated

    def _stop_running(self, seq: Request) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if self.prefilling is seq:
            self.prefilling = None
        if seq in self.decoding:
            self.decoding.remove(seq)

    def _release(self, seq: Request) -> None:
        pool = self.pool
        for block in reversed(seq.hashed):  # tail first: evicted before the prefix
            pool.release(block)
        pool.give_back(seq.private_kv + seq.state_held)
        seq.hashed = []
        seq.private_kv = 0
        seq.state_held = 0
        seq.hit_block = None

    def _finish(self, seq: Request, reason: str) -> None:
        seq.state = DONE
        seq.finished_at = self.now
        seq.finish_reason = reason
        self._by_id.pop(seq.request_id, None)
        self._outbox.append(Finished(seq, self.now, reason))

    def _reject(self, seq: Request, message: str) -> None:
        seq.state = DONE
        seq.finished_at = self.now
        seq.finish_reason = "error"
        self._by_id.pop(seq.request_id, None)
        self._outbox.append(Rejected(seq, self.now, message))
