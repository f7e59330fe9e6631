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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class CachedBlock:
    """A full block whose contents are known, so other requests can reuse it."""

    __slots__ = ("key", "refs", "weight", "checkpoint")

    def __init__(self, key: int) -> None:
        self.key = key
        self.refs = 1  # running requests holding it
        self.weight = 1  # pool blocks it occupies: 1, plus the state of a checkpoint
        self.checkpoint = False


def block_keys(tokens: Sequence[int], block_size: int, start_key: int = 0,
               start_block: int = 0) -> list[int]:
    """Chain keys of the full blocks of ``tokens`` from ``start_block`` on.

    Tuples of ints hash the same in every process (only str/bytes hashing is salted).
    """
    keys = []
    key = start_key
    for begin in range(start_block * block_size, len(tokens) - block_size + 1, block_size):
        key = hash((key, tuple(tokens[begin:begin + block_size])))
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
