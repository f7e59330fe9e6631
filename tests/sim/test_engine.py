"""The engine model on its own: pure code, time handed in, every rule of the issue checked."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.sim.engine import (
    Admitted,
    Engine,
    EngineConfig,
    EngineConfigError,
    Finished,
    FirstToken,
    Preempted,
    Rejected,
    Request,
)

_ids = itertools.count()


def request(prompt: list[int], max_tokens: int = 4, at: float = 0.0) -> Request:
    output = [900_000 + next(_ids) * 10 + i for i in range(max_tokens)]
    return Request(f"r{next(_ids)}", prompt, output, at, max_tokens)


def settle(engine: Engine) -> list:
    """Play every pending event; return what happened."""
    while (when := engine.next_event_time()) is not None:
        engine.advance(when)
    return engine.drain()


def serve(engine: Engine, prompt: list[int], max_tokens: int = 4) -> Request:
    seq = request(prompt, max_tokens, engine.now)
    engine.submit(seq, engine.now)
    settle(engine)
    assert seq.finish_reason == "length", seq.finish_reason
    return seq


def dense(**overrides) -> Engine:
    values = {"block_size": 32, "kv_pool_tokens": 1 << 20, "enable_prefix_caching": True}
    values.update(overrides)
    return Engine(EngineConfig(**values))


def tokens(count: int, start: int = 1000) -> list[int]:
    return list(range(start, start + count))


def test_capture_sequence_gives_the_real_cached_counts():
    """The real vLLM 0.32 capture (block 32): chat 1,395 cold then 1,396 with 1,376 cached;
    completion 1,373 cold then 1,344 cached; an unrelated 221-token prompt 0."""
    engine = dense()
    chat = tokens(1395)
    assert serve(engine, chat).hit_tokens == 0
    assert serve(engine, chat[:-3] + [7] + chat[-3:]).hit_tokens == 1376
    completion = tokens(1373, start=50_000)
    assert serve(engine, completion).hit_tokens == 0
    assert serve(engine, completion).hit_tokens == 1344
    assert serve(engine, tokens(221, start=90_000)).hit_tokens == 0


@settings(max_examples=60, deadline=None)
@given(
    shared=st.integers(0, 600),
    first_len=st.integers(1, 600),
    second_len=st.integers(1, 600),
    granule_blocks=st.sampled_from([1, 2, 4]),
)
def test_cached_is_whole_granules_of_the_shared_prefix_never_the_last_token(
    shared, first_len, second_len, granule_blocks
):
    block = 16
    granule = block * granule_blocks
    engine = dense(block_size=block, granularity=granule)
    first = tokens(max(first_len, shared))
    second = first[:shared] + tokens(second_len, start=500_000)
    serve(engine, first, max_tokens=1)
    hit = serve(engine, second, max_tokens=1).hit_tokens
    in_cache = len(first) // block * block  # the first request's full blocks
    expected = min(shared, in_cache, len(second) - 1) // granule * granule
    assert hit == expected


def test_reuse_starts_at_the_first_token_only():
    engine = dense()
    base = tokens(640)
    serve(engine, base)
    assert serve(engine, [1] + base).hit_tokens == 0  # one token in front breaks it all


def test_prefix_caching_off_reuses_nothing_and_counts_no_queries():
    engine = dense(enable_prefix_caching=False)
    prompt = tokens(640)
    serve(engine, prompt)
    seq = request(prompt)
    engine.submit(seq, engine.now)
    events = settle(engine)
    assert seq.hit_tokens == 0
    assert not engine.pool.blocks, "nothing is kept in the pool"
    assert [e for e in events if isinstance(e, Admitted)][0].hit_tokens == 0


def test_hybrid_defaults_to_caching_off_as_vllm_before_0_26():
    assert EngineConfig(hybrid=True).prefix_caching is False
    assert EngineConfig(hybrid=True, enable_prefix_caching=True).prefix_caching is True
    assert EngineConfig().prefix_caching is True


def test_hybrid_resumes_only_at_a_saved_checkpoint():
    """A hybrid model reuses a prefix only where a recurrent state was saved: at the previous
    prompt's last whole granule, not at any shared block boundary."""
    engine = Engine(
        EngineConfig(
            hybrid=True,
            enable_prefix_caching=True,
            block_size=256,
            granularity=1024,
            kv_pool_tokens=1 << 20,
        )
    )
    conversation = tokens(5000)
    serve(engine, conversation)  # checkpoint at 4096, the last whole granule below 5,000
    # a prompt that shares 4,500 tokens then diverges: the blocks up to 4,352 are cached,
    # but only 4,096 has a state to resume from
    fork = conversation[:4500] + tokens(100, start=300_000)
    assert serve(engine, fork).hit_tokens == 4096
    # a prompt sharing only 3,000 tokens: cached blocks, but no checkpoint at or below 3,072
    short_fork = conversation[:3000] + tokens(2000, start=400_000)
    assert serve(engine, short_fork).hit_tokens == 0
    # the conversation goes on: it resumes at 4,096 and leaves a checkpoint at 7,168 ...
    longer = conversation + tokens(3000, start=200_000)
    assert serve(engine, longer).hit_tokens == 4096
    assert serve(engine, longer + [5]).hit_tokens == 7168
    # ... keeping only its latest replay point (vLLM's default retention): 4,096 is gone
    assert serve(engine, fork).hit_tokens == 0


def test_lru_evicts_the_least_recently_released_and_the_tail_first():
    # 40 blocks of 16 tokens; each prompt holds 16 blocks
    engine = dense(block_size=16, kv_pool_tokens=640)
    a, b, c = tokens(256, 1000), tokens(256, 5000), tokens(256, 9000)
    serve(engine, a, max_tokens=1)
    serve(engine, b, max_tokens=1)
    assert serve(engine, a, max_tokens=1).hit_tokens == 240  # touching a makes b the oldest
    serve(engine, c, max_tokens=1)  # needs 16 blocks: 8 free, 8 evicted from b's tail
    assert engine.pool.evicted_blocks == 8

    def cached_blocks(prompt: list[int]) -> int:
        return len(engine.pool.match(engine._keys(request(prompt), len(prompt))))

    # b lost its tail, not its beginning: 8 of its 16 blocks are left; a is untouched
    assert cached_blocks(a) == 16 and cached_blocks(b) == 8
    assert serve(engine, b, max_tokens=1).hit_tokens == 128


def test_ttft_is_queue_wait_plus_uncached_tokens_over_the_prefill_rate():
    engine = dense(prefill_rate=1000.0, decode_rate=10.0)
    first = request(tokens(2000), max_tokens=1)
    second = request(tokens(3000, start=100_000), max_tokens=1)
    engine.submit(first, 0.0)
    engine.submit(second, 0.0)
    settle(engine)
    assert first.first_token_at == pytest.approx(2.0)
    # prompts are read one at a time: the second waits 2 s, then reads 3,000 tokens
    assert second.admitted_at == pytest.approx(2.0)
    assert second.first_token_at == pytest.approx(5.0)
    warm = request(tokens(2000) + tokens(500, start=7000), max_tokens=1, at=10.0)
    engine.submit(warm, 10.0)
    settle(engine)
    assert warm.hit_tokens == 1984
    assert warm.first_token_at - 10.0 == pytest.approx((2500 - 1984) / 1000)


def test_decode_slows_with_concurrency():
    def finish_time(streams: int) -> float:
        engine = dense(decode_rate=50.0, decode_slowdown=0.2, prefill_rate=1e9)
        seqs = [request(tokens(64, start=10_000 * i), max_tokens=101) for i in range(streams)]
        for seq in seqs:
            engine.submit(seq, 0.0)
        settle(engine)
        return max(seq.finished_at for seq in seqs)

    alone = finish_time(1)
    assert alone == pytest.approx(100 / 50, rel=1e-3)
    assert finish_time(4) == pytest.approx(100 / (50 / (1 + 0.2 * 3)), rel=1e-3)


def test_preemption_when_running_sequences_outgrow_the_pool():
    # 64 blocks of 16; four 200-token prompts fit, their 400-token answers do not
    engine = dense(block_size=16, kv_pool_tokens=1024, prefill_rate=1e6, decode_rate=100.0)
    seqs = [request(tokens(200, start=10_000 * i), max_tokens=400) for i in range(4)]
    for seq in seqs:
        engine.submit(seq, 0.0)
    events = settle(engine)
    preempted = [e for e in events if isinstance(e, Preempted)]
    assert preempted and engine.preemptions == len(preempted)
    # the newest running request goes first, as in vLLM
    assert preempted[0].seq is seqs[-1]
    # preempted requests recompute and still finish with every token
    assert all(seq.finish_reason == "length" and seq.generated_tokens == 400 for seq in seqs)
    assert sum(1 for e in events if isinstance(e, FirstToken)) == 4
    assert engine.pool.pinned == 0


def test_a_request_that_cannot_fit_is_rejected_not_stuck():
    engine = dense(block_size=16, kv_pool_tokens=1024, max_model_len=4096)
    too_long = request(tokens(5000))
    engine.submit(too_long, 0.0)
    rejected = [e for e in engine.drain() if isinstance(e, Rejected)]
    assert rejected and "maximum context length is 4096" in rejected[0].message
    bigger_than_pool = request(tokens(2000))
    engine.submit(bigger_than_pool, 0.0)
    assert any(isinstance(e, Rejected) for e in engine.drain())
    # and the engine still serves what fits
    assert serve(engine, tokens(500)).first_token_at is not None


def test_abort_frees_everything():
    engine = dense(block_size=16, kv_pool_tokens=4096, decode_rate=1.0)
    seq = request(tokens(1000), max_tokens=1000)
    engine.submit(seq, 0.0)
    engine.advance(5.0)
    assert engine.pool.pinned > 0
    engine.abort(seq.request_id, 6.0)
    assert engine.pool.pinned == 0
    assert any(isinstance(e, Finished) and e.reason == "abort" for e in engine.drain())


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 900), st.integers(1, 300), st.integers(0, 3), st.floats(0, 5)),
        min_size=1,
        max_size=12,
    ),
    st.booleans(),
)
def test_pool_accounting_is_conserved_whatever_the_traffic(workload, hybrid):
    config = EngineConfig(
        block_size=16,
        kv_pool_tokens=2048,
        max_model_len=1200,
        hybrid=hybrid,
        enable_prefix_caching=True,
        state_tokens=32,
        granularity=64,
        prefill_rate=500.0,
        decode_rate=40.0,
    )
    engine = Engine(config)
    now = 0.0
    seqs = []
    for length, max_tokens, family, gap in workload:
        now += gap
        seq = request(tokens(length, start=family * 10_000), max_tokens=max_tokens, at=now)
        seqs.append(seq)
        engine.submit(seq, now)
        pool = engine.pool
        assert 0 <= pool.free <= pool.num_blocks and pool.pinned >= 0
    settle(engine)
    pool = engine.pool
    assert pool.pinned == 0
    assert pool.free + pool.evictable_weight == pool.num_blocks
    assert all(seq.finish_reason in ("length", "error") for seq in seqs)
    assert not engine.running and not engine.waiting


def test_time_cannot_go_backwards():
    engine = dense()
    engine.advance(5.0)
    with pytest.raises(ValueError):
        engine.advance(4.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"block_size": 0},
        {"granularity": 48, "block_size": 32},
        {"prefill_rate": 0},
        {"decode_rate": -1},
        {"kv_pool_tokens": 8, "block_size": 16},
        {"served_model_name": ""},
    ],
)
def test_impossible_configurations_are_refused(bad):
    with pytest.raises(EngineConfigError):
        EngineConfig(**bad)
