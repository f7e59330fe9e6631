"""How a vLLM's KV pool holds a conversation, read from its ``vllm:cache_config_info``.

Two things the foresight and the classifier need from vLLM, and no flag:

**The granule.** vLLM resumes a cached prefix only at whole granules: the prefix-cache hit
alignment (``cache_hit_alignment_tokens``, else ``prefix_match_unit``) where vLLM reports one,
else the block size. On a hybrid model (``mamba_cache_mode="align"``) the block size *is* the
granule: vLLM raises the attention block until one attention page holds one recurrent-state
page, and keeps a state only at block boundaries. The ``mamba_block_size`` label is stale
there (it reads 16 on every hybrid server vLLM 0.32 was seen to run, whatever the block), so
it is never read. Granules need not be powers of two (384 and 640 on real hybrids).

**What a conversation holds.** vLLM hands out one pool of ``num_gpu_blocks`` blocks; a
sequence of T tokens holds ``ceil(T / block_size)`` attention blocks and, on a hybrid model,
one block per recurrent-state group (measured on vLLM 0.32 serving GraniteMoeHybrid,
NemotronH and Qwen3-Next while conversations decoded: ``kv_cache_usage_perc x
(num_gpu_blocks - 1)`` was exactly that, e.g. 2 x 4 + 2 x 1 blocks for two 7,050-token
conversations at a 2,048-token granule, 17 + 2 x 2 for two ~3,100-token ones at 384 with two
state groups). vLLM's own ``kv_cache_size_tokens`` counts the pool in tokens of a full-length
request, state included (``kv_cache_max_concurrency`` such requests of ``max_model_len``
tokens), so one block is worth ``kv_cache_size_tokens / num_gpu_blocks`` of those tokens,
and that is the rate at which a conversation's blocks are set against the pool.

The number of state groups is not a label; vLLM's arithmetic gives it away. It sizes
``kv_cache_max_concurrency`` by the blocks one request of ``max_model_len`` tokens may take:
``ceil(max_model_len / block_size)`` attention blocks plus, per state group, the copies it
reserves (in align mode a live state and a checkpoint, and a third for Mamba2's prefill
checkpoint; one with prefix caching off). So ``num_gpu_blocks / kv_cache_max_concurrency``
less the attention blocks is the reserve, and the reserve over the copies is the number of
groups (``max_model_len`` itself is ``kv_cache_size_tokens / kv_cache_max_concurrency``).
Which of two or three copies a model reserves does not show; a reserve divisible by three
is read as three (Mamba2: Granite-4.0-H, NemotronH, Bamba), any other as two (gated
DeltaNet: Qwen3-Next). A gated-DeltaNet model whose groups number a multiple of three is
then read with two thirds of its state: one block short per conversation.

Pure: values in, values out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exporter.values import CacheConfig

HYBRID_CACHE_MODE = "align"  # mamba_cache_mode of a hybrid model with prefix caching on
# Recurrent-state copies vLLM reserves per state group for one request, by how it is cached.
RESERVED_COPIES_MAMBA2 = 3  # align: live state, checkpoint, prefill checkpoint
RESERVED_COPIES_ALIGN = 2  # align: live state, checkpoint
RESERVED_COPIES_UNCACHED = 1  # mamba_cache_mode "none": the live state only


def granule(config: CacheConfig) -> int | None:
    """The unit vLLM resumes a cached prefix in, from its cache configuration (None when it
    reports no block size). Never ``mamba_block_size``: see the module docstring."""
    return (
        config.positive("cache_hit_alignment_tokens")
        or config.prefix_match_unit
        or config.block_size
    )


def is_hybrid(config: CacheConfig) -> bool:
    """A hybrid (attention + recurrent state) model with prefix caching on."""
    return config.fields.get("mamba_cache_mode") == HYBRID_CACHE_MODE


@dataclass(frozen=True)
class PoolLayout:
    """How one vLLM's pool is spent: whole blocks of ``block_tokens`` tokens, each worth
    ``block_pool_tokens`` of the pool's tokens, and ``state_blocks`` blocks of recurrent
    state per sequence (0 on a dense model)."""

    block_tokens: int
    block_pool_tokens: float
    state_blocks: int = 0

    def context_tokens(self, tokens: int) -> float:
        """Pool tokens the attention blocks of a ``tokens``-long sequence take."""
        return -(-tokens // self.block_tokens) * self.block_pool_tokens

    @property
    def state_tokens(self) -> float:
        """Pool tokens one sequence's recurrent state takes (all its groups)."""
        return self.state_blocks * self.block_pool_tokens


def layout(config: CacheConfig) -> PoolLayout | None:
    """The pool layout one engine's ``vllm:cache_config_info`` implies, or None without a
    block size and a pool. Without ``num_gpu_blocks`` a block is worth its own tokens;
    without ``kv_cache_max_concurrency`` (vLLM before it had one) no state is known."""
    block = config.block_size
    pool = config.pool_tokens
    if not block or not pool:
        return None
    blocks = config.num_gpu_blocks
    if not blocks:
        return PoolLayout(block, float(block))
    return PoolLayout(block, pool / blocks, state_groups(config, block, pool, blocks))


def state_groups(config: CacheConfig, block: int, pool: int, blocks: int) -> int:
    """Blocks of recurrent state one sequence holds: the state groups vLLM's concurrency
    arithmetic implies (module docstring); 0 on a dense model or when it does not add up."""
    concurrency = config.positive_float("kv_cache_max_concurrency")
    if not concurrency:
        return 0
    max_model_len = math.ceil(pool / concurrency - 1e-6)
    reserve = round(blocks / concurrency) - -(-max_model_len // block)
    if reserve <= 0:
        return 0
    mode = config.fields.get("mamba_cache_mode")
    if mode == HYBRID_CACHE_MODE:
        copies = (
            RESERVED_COPIES_MAMBA2
            if reserve % RESERVED_COPIES_MAMBA2 == 0
            else RESERVED_COPIES_ALIGN
        )
    elif mode in (None, "none", "None", ""):
        copies = RESERVED_COPIES_UNCACHED
    else:  # a mode this release does not know: say nothing rather than guess
        return 0
    return -(-reserve // copies)
