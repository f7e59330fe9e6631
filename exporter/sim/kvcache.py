"""The KV pool as vLLM's V1 block manager keeps it: fixed blocks, a content-keyed prefix cache.

Every block of ``block_size`` tokens is keyed by the chain of block contents before it (the
key of block i covers tokens 0..(i+1)*B), so a cached block is only reusable behind the very
same prefix: reuse starts at the first token or not at all. Blocks a running request holds are
pinned; when it finishes its full blocks stay in the pool, unpinned and reusable, until an
allocation needs the room and takes the least recently released one. Blocks are released tail
first, as vLLM does, so the end of a conversation goes before its beginning.

A hybrid (Mamba / linear-attention) model can only resume a prefix where it saved the
recurrent state: such a "checkpoint" sits on one block and can cost extra pool blocks (the
state), and it goes when its block is evicted.

With ``--kv-cache-metrics`` vLLM follows a sample of its blocks from allocation to eviction
(``ResidencySampler``): how long each lived, how long it sat unused before it was evicted,
and the gaps between the prefix-cache hits on it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise


class CachedBlock:
    """A full block whose contents are known, so other requests can reuse it."""

    __slots__ = ("key", "refs", "weight", "checkpoint")

    def __init__(self, key: int) -> None:
        self.key = key
        self.refs = 1  # running requests holding it
        self.weight = 1  # pool blocks it occupies: 1, plus the state of a checkpoint
        self.checkpoint = False


def block_keys(
    tokens: Sequence[int], block_size: int, start_key: int = 0, start_block: int = 0
) -> list[int]:
    """Chain keys of the full blocks of ``tokens`` from ``start_block`` on.

    Tuples of ints hash the same in every process (only str/bytes hashing is salted).
    """
    keys = []
    key = start_key
    for begin in range(start_block * block_size, len(tokens) - block_size + 1, block_size):
        key = hash((key, tuple(tokens[begin : begin + block_size])))
        keys.append(key)
    return keys


class BlockPool:
    """Pool accounting in blocks: free, pinned (held by running requests) and evictable."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.free = num_blocks  # blocks that hold nothing
        self.blocks: dict[int, CachedBlock] = {}
        self.evictable: OrderedDict[int, CachedBlock] = OrderedDict()  # oldest release first
        self.evictable_weight = 0
        self.evicted_blocks = 0
        self.version = 0  # bumped whenever room is given back (a blocked admission may fit)
        # Blocks evicted by the last allocate(), for the engine to note (at most the pool).
        self.just_evicted: list[CachedBlock] = []

    @property
    def pinned(self) -> int:
        """Blocks held by running requests (vLLM's kv_cache_usage counts only these)."""
        return self.num_blocks - self.free - self.evictable_weight

    def available(self, excluding: Sequence[CachedBlock] = ()) -> int:
        """Blocks an allocation could get, if the given cached blocks were pinned first."""
        held_back = sum(block.weight for block in excluding if block.refs == 0)
        return self.free + self.evictable_weight - held_back

    def match(self, keys: Sequence[int]) -> list[CachedBlock]:
        """The cached blocks of the longest prefix of ``keys`` present in the pool."""
        found = []
        blocks = self.blocks
        for key in keys:
            block = blocks.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def acquire(self, block: CachedBlock) -> None:
        if block.refs == 0:
            del self.evictable[block.key]
            self.evictable_weight -= block.weight
        block.refs += 1

    def allocate(self, count: int) -> bool:
        """Take ``count`` empty blocks, evicting cached ones if needed; False if impossible."""
        self.just_evicted = []
        if count <= 0:
            return True
        if count > self.free + self.evictable_weight:
            return False
        while self.free < count:
            self._evict_oldest()
        self.free -= count
        return True

    def give_back(self, count: int) -> None:
        """Return blocks that held nothing reusable (partial blocks, a running state)."""
        self.free += count
        self.version += 1

    def register(self, key: int) -> CachedBlock | None:
        """Make a just-computed private block reusable; None if the pool already has it."""
        if key in self.blocks:
            return None
        block = CachedBlock(key)
        self.blocks[key] = block
        self.version += 1  # a waiting request may now find more of its prompt cached
        return block

    def release(self, block: CachedBlock) -> None:
        block.refs -= 1
        if block.refs == 0:
            self.evictable[block.key] = block
            self.evictable_weight += block.weight
            self.version += 1

    def add_checkpoint(self, block: CachedBlock, state_blocks: int) -> None:
        """Put a saved recurrent state on ``block``; its ``state_blocks`` are already allocated."""
        block.checkpoint = True
        block.weight += state_blocks
        if block.refs == 0:
            self.evictable_weight += state_blocks

    def drop_checkpoint(self, block: CachedBlock, state_blocks: int) -> None:
        if not block.checkpoint:
            return
        block.checkpoint = False
        block.weight -= state_blocks
        self.free += state_blocks
        self.version += 1
        if block.refs == 0:
            self.evictable_weight -= state_blocks

    def _evict_oldest(self) -> None:
        key, block = self.evictable.popitem(last=False)
        self.evictable_weight -= block.weight
        self.free += block.weight
        del self.blocks[key]
        self.evicted_blocks += 1
        self.just_evicted.append(block)


# vLLM's KV-residency buckets (vllm/v1/metrics/buckets.py, kv_cache_residency).
RESIDENCY_BUCKETS = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
)
# vLLM keeps a sampled block's last 4 hits (so at most 3 gaps per eviction).
RESIDENCY_HISTORY = 4
_HASH_SPACE = 1 << 64
_SPREAD = 0x9E3779B97F4A7C15  # Fibonacci hashing: chain keys spread evenly over [0, 2^64)


@dataclass(frozen=True)
class Residency:
    """One sampled block's life, reported when it is evicted (vLLM's KVCacheEvictionEvent)."""

    lifetime: float  # allocation to eviction
    idle: float  # last hit (or allocation) to eviction
    reuse_gaps: tuple[float, ...]  # between its last hits, oldest first


class _Life:
    __slots__ = ("born", "last_use", "hits")

    def __init__(self, born: float) -> None:
        self.born = born
        self.last_use = born
        self.hits: deque[float] = deque(maxlen=RESIDENCY_HISTORY)


class ResidencySampler:
    """vLLM's KVCacheMetricsCollector over the pool's reusable blocks.

    vLLM samples a fraction of its allocations at random; here a block is sampled when its
    chain key falls in the same fraction of the key space, which samples the same share of
    blocks without a random source (so a run is reproducible) and independently of how the
    block will fare. The blocks followed are the ones that can be hit: a block that never
    holds a full block of prompt is never reused, and vLLM reports it as idle for its whole
    life, which the simulator does not model. At most the pool's blocks are followed.
    """

    def __init__(self, sample_rate: float) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError("sample_rate must be in (0, 1]")
        self.threshold = sample_rate * _HASH_SPACE
        self.lives: dict[int, _Life] = {}

    def sampled(self, block: CachedBlock) -> bool:
        return (block.key * _SPREAD) % _HASH_SPACE < self.threshold

    def allocated(self, block: CachedBlock, born: float) -> None:
        if self.sampled(block):
            self.lives[block.key] = _Life(born)

    def hit(self, block: CachedBlock, now: float) -> None:
        life = self.lives.get(block.key)
        if life is not None:
            life.last_use = now
            life.hits.append(now)

    def evicted(self, block: CachedBlock, now: float) -> Residency | None:
        life = self.lives.pop(block.key, None)
        if life is None:
            return None
        gaps = tuple(later - earlier for earlier, later in pairwise(life.hits))
        return Residency(now - life.born, now - life.last_use, gaps)
