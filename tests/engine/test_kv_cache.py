"""Block pool and prefix cache: exact states on a tiny pool, then random operations.

Block size 4 and 10 blocks, so every block id, ref count and eviction can be
written down by hand. The stateful test drives the manager the way the scheduler
does and checks, after every step, that sharing is only ever of identical content.
"""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from twospeed.engine.kv_cache import BlockPool, KVCacheManager, hash_block_tokens

BS = 4


def make(num_blocks=10, enable_caching=True):
    return KVCacheManager(num_blocks, BS, enable_caching)


def compute(m, rid, tokens, num_tokens, cached=()):
    """As the scheduler does: allocate, 'run' the tokens, register full blocks."""
    ok = m.allocate_slots(rid, num_tokens, cached)
    if ok:
        m.cache_full_blocks(rid, tokens, num_tokens)
    return ok


def admit(m, rid, tokens):
    """Prefix lookup + allocation of the whole prompt."""
    cached = m.find_cached_prefix(tokens)
    assert compute(m, rid, tokens, len(tokens), cached)
    return cached


def snapshot(m):
    pool = m.pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        pool.free_block_ids,
        sorted((h, b.block_id) for h, b in pool.cached_blocks.items()),
        {rid: m.block_ids(rid) for rid in list(m._tables)},
        dict(m._hashes),
    )


A = list(range(100, 112))  # 3 full blocks
B = list(range(200, 208))  # 2 full blocks


def test_hash_is_a_chain():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4])
    assert len(h0) == 32
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 5])


def test_allocation_ids_and_growth():
    m = make()
    assert m.blocks_needed(0) == 0 and m.blocks_needed(4) == 1 and m.blocks_needed(5) == 2
    assert m.allocate_slots("a", 10)
    assert m.block_ids("a") == [0, 1, 2]
    assert m.allocate_slots("a", 12)  # still inside block 2
    assert m.block_ids("a") == [0, 1, 2]
    assert m.allocate_slots("a", 13)
    assert m.block_ids("a") == [0, 1, 2, 3]
    assert m.allocate_slots("b", 1)
    assert m.block_ids("b") == [4]
    assert m.num_free_blocks == 5 and m.usage == 0.5
    assert m.block_ids("nobody") == []


def test_a_hash_memo_finds_the_same_blocks_and_holds_the_chain():
    """Request.block_hashes: a lookup with the memo finds what one without finds, records the chain's hashes up to
    the first miss, and a later lookup (more blocks cached meanwhile) reuses them and goes on."""
    m = make()
    admit(m, "a", A[:8] + [1])
    tokens = A + [9]  # blocks 0-1 cached, block 2 not yet
    memo: list[bytes] = []
    assert m.find_cached_prefix(tokens, memo) == m.find_cached_prefix(tokens) and len(memo) == 3
    chain = [hash_block_tokens(None, A[:4])]
    for i in (1, 2):
        chain.append(hash_block_tokens(chain[-1], A[4 * i:4 * i + 4]))
    assert memo == chain
    admit(m, "b", A + [2])  # now block 2 is cached too
    memo[0] = b"stale"  # the memo is trusted: a lookup reads it rather than hashing block 0 again
    assert [b.block_id for b in m.find_cached_prefix(tokens, memo)] == []
    memo[0] = chain[0]
    assert len(m.find_cached_prefix(tokens, memo)) == 3 and memo == chain


def test_prefix_hit_shares_blocks_and_counts_tokens():
    m = make()
    assert admit(m, "a", A[:10]) == []
    assert m.block_ids("a") == [0, 1, 2]
    assert m.num_cached_blocks == 2  # the partial third block has no hash
    assert m.pool.blocks[2].block_hash is None

    cached = admit(m, "b", A[:8] + [7, 7])
    assert [b.block_id for b in cached] == [0, 1]
    assert m.block_ids("b") == [0, 1, 3]
    assert [b.ref_cnt for b in m.pool.blocks[:4]] == [2, 2, 1, 1]
    assert m.prefix_cache_queries == 20 and m.prefix_cache_hits == 8

    # b's own third block continues the chain from the cached prefix.
    m.allocate_slots("b", 12)
    m.cache_full_blocks("b", A[:8] + [7, 7, 7, 7], 12)
    expect = hash_block_tokens(m.pool.blocks[1].block_hash, [7, 7, 7, 7])
    assert m.pool.blocks[3].block_hash == expect
    assert [b.block_id for b in m.find_cached_prefix(A[:8] + [7, 7, 7, 7, 9])] == [0, 1, 3]


def test_find_takes_no_references():
    m = make()
    admit(m, "a", A)
    m.free("a")
    before = snapshot(m)
    assert len(m.find_cached_prefix(A + [1])) == 3
    assert snapshot(m) == before


def test_last_token_is_never_a_hit():
    m = make()
    admit(m, "a", B)  # exactly 2 blocks, both cached
    assert m.num_cached_blocks == 2
    assert [b.block_id for b in m.find_cached_prefix(B)] == [0]  # the last token must be computed
    assert [b.block_id for b in m.find_cached_prefix(B + [1])] == [0, 1]
    assert m.find_cached_prefix(B[:4]) == []
    assert m.find_cached_prefix([]) == []


def test_lru_eviction_order():
    m = make()
    admit(m, "a", A)  # blocks 0, 1, 2
    admit(m, "b", B)  # blocks 3, 4
    m.free("a")
    m.free("b")
    # Never-used blocks first, then by time freed; within one request, tail first.
    assert m.pool.free_block_ids == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    assert m.num_cached_blocks == 5 and m.num_free_blocks == 10

    assert m.allocate_slots("c", 20)
    assert m.block_ids("c") == [5, 6, 7, 8, 9]
    assert m.num_cached_blocks == 5

    assert m.allocate_slots("d", 1)
    assert m.block_ids("d") == [2]  # a's tail is evicted first
    assert m.pool.blocks[2].block_hash is None and m.num_cached_blocks == 4
    assert [b.block_id for b in m.find_cached_prefix(A + [1])] == [0, 1]

    assert m.allocate_slots("d", 5)
    assert m.block_ids("d") == [2, 1]
    assert [b.block_id for b in m.find_cached_prefix(A + [1])] == [0]
    assert [b.block_id for b in m.find_cached_prefix(B + [1])] == [3, 4]  # b's blocks survive


def test_hit_on_free_block_takes_it_out_of_the_queue():
    m = make()
    admit(m, "a", A)
    m.free("a")
    cached = admit(m, "b", A[:8] + [1])
    assert [b.block_id for b in cached] == [0, 1]
    assert m.block_ids("b") == [0, 1, 3]
    assert m.pool.free_block_ids == [4, 5, 6, 7, 8, 9, 2]
    m.free("b")
    # Re-freed: tail (3) first, then the shared head, after the untouched block 2.
    assert m.pool.free_block_ids == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]


def test_allocate_failure_changes_nothing():
    m = make()
    admit(m, "a", A)  # 0, 1, 2 cached
    m.free("a")
    assert m.allocate_slots("x", 20)  # 5 blocks: 3..7; free = 8, 9, 2, 1, 0
    assert m.num_free_blocks == 5

    # 3 cached blocks hit, 3 new needed; 5 are free, but 3 of those are the hit itself.
    prompt = A + [1] * 10
    cached = m.find_cached_prefix(prompt)
    assert [b.block_id for b in cached] == [0, 1, 2]
    before = snapshot(m)
    assert not m.allocate_slots("b", len(prompt), cached)
    assert snapshot(m) == before
    assert m.block_ids("b") == []

    # Growing an existing request past the pool fails the same way.
    assert not m.allocate_slots("x", 20 + 6 * BS)
    assert snapshot(m) == before

    # Two new blocks fit.
    assert m.allocate_slots("b", 20, cached)
    assert m.block_ids("b") == [0, 1, 2, 8, 9]
    assert m.num_free_blocks == 0


def test_duplicate_content_is_not_registered_twice():
    m = make()
    # Both look up before either has computed: both miss and compute the same blocks.
    assert m.find_cached_prefix(B + [1]) == [] and m.find_cached_prefix(B + [1]) == []
    compute(m, "a", B + [1], 9)
    compute(m, "b", B + [1], 9)
    assert m.block_ids("a") == [0, 1, 2] and m.block_ids("b") == [3, 4, 5]
    assert m.num_cached_blocks == 2
    assert m.pool.blocks[3].block_hash is None and m.pool.blocks[4].block_hash is None
    assert [b.block_id for b in m.find_cached_prefix(B + [1])] == [0, 1]

    pool = BlockPool(3)
    x, y = pool.get_new_blocks(2)
    pool.cache_block(x, b"h" * 32)
    pool.cache_block(y, b"h" * 32)
    assert pool.get_cached_block(b"h" * 32) is x and y.block_hash is None


def test_reset_prefix_cache():
    m = make()
    admit(m, "a", A)
    assert not m.reset_prefix_cache()  # a block is in use
    assert m.num_cached_blocks == 3
    m.free("a")
    assert m.reset_prefix_cache()
    assert m.num_cached_blocks == 0
    assert all(b.block_hash is None for b in m.pool.blocks)
    assert m.find_cached_prefix(A + [1]) == []
    assert m.num_free_blocks == 10


def test_free_unknown_double_free_and_stale_prefix():
    m = make()
    m.free("nobody")
    admit(m, "a", B)
    blocks = [m.pool.blocks[i] for i in m.block_ids("a")]
    m.free("a")
    m.free("a")  # already forgotten: no-op
    with pytest.raises(RuntimeError, match=f"^double free of block {blocks[0].block_id}$"):
        m.pool.free_blocks(blocks)
    with pytest.raises(ValueError, match="^asked for 11 blocks, only 10 free$"):
        m.pool.get_new_blocks(11)

    cached = m.find_cached_prefix(B + [1])
    assert m.allocate_slots("evictor", 40)  # evicts everything, including the hit
    with pytest.raises(ValueError, match=rf"^cached block 0 \({cached[0].block_id}\) is no longer cached$"):
        m.allocate_slots("late", 9, cached)
    with pytest.raises(ValueError, match="^cached_blocks given for 'evictor', which already has blocks$"):
        m.allocate_slots("evictor", 41, m.find_cached_prefix(A + [1]) or [m.pool.blocks[0]])
    with pytest.raises(ValueError, match="^'evictor': 11 full blocks but only 10 allocated$"):
        m.cache_full_blocks("evictor", list(range(44)), 44)
    m.free("evictor")
    assert m._tables == {} and m._hashes == {}  # nothing kept for requests that are gone


def test_sizes_must_be_positive():
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"^num_blocks must be positive, got {bad}$"):
            BlockPool(bad)
        with pytest.raises(ValueError, match=f"^block_size must be positive, got {bad}$"):
            KVCacheManager(4, bad)
    assert BlockPool(1).num_free_blocks == 1 and KVCacheManager(1, 1).block_size == 1


def test_caching_disabled():
    m = make(enable_caching=False)
    assert not m.pool.enable_caching
    admit(m, "a", A)
    assert m.num_cached_blocks == 0
    pool = BlockPool(2, enable_caching=False)  # the pool alone refuses to register, too
    [block] = pool.get_new_blocks(1)
    pool.cache_block(block, hash_block_tokens(None, A[:BS]))
    assert block.block_hash is None and pool.num_cached_blocks == 0
    assert m.find_cached_prefix(A + [1]) == []
    m.free("a")
    assert m.num_free_blocks == 10


# --- random operations -------------------------------------------------------

ALPHABET = st.integers(0, 2)
NUM_BLOCKS = 12


class KVCacheMachine(RuleBasedStateMachine):
    """Drives KVCacheManager like the scheduler and mirrors what the runner would
    write into each physical block slot."""

    @initialize(bases=st.lists(st.lists(ALPHABET, min_size=24, max_size=24), min_size=3, max_size=3))
    def setup(self, bases):
        self.m = KVCacheManager(NUM_BLOCKS, BS)
        self.bases = bases
        self.reqs: dict[str, dict] = {}  # rid -> {"tokens": [...], "computed": int}
        self.slots: dict[int, list] = {i: [None] * BS for i in range(NUM_BLOCKS)}  # what the runner wrote
        self.next_id = 0

    def _run(self, rid, tokens, start, end, cached=()):
        """allocate_slots, write tokens [start, end) into their slots, cache full blocks."""
        before = snapshot(self.m)
        if not self.m.allocate_slots(rid, end, cached):
            assert snapshot(self.m) == before
            return False
        table = self.m.block_ids(rid)
        assert len(table) == self.m.blocks_needed(end)
        for pos in range(start, end):
            block = self.m.pool.blocks[table[pos // BS]]
            assert block.ref_cnt == 1, "writing into a shared block"
            # The KV of a position depends on every token up to it, so the slot holds that prefix.
            self.slots[block.block_id][pos % BS] = tuple(tokens[: pos + 1])
        self.m.cache_full_blocks(rid, tokens, end)
        return True

    @rule(
        base=st.integers(0, 2),
        prefix_len=st.integers(0, 24),
        suffix=st.lists(ALPHABET, max_size=6),
        chunk=st.integers(1, 32),
    )
    def add_request(self, base, prefix_len, suffix, chunk):
        tokens = self.bases[base][:prefix_len] + suffix
        if not tokens:
            return
        queries, hits = self.m.prefix_cache_queries, self.m.prefix_cache_hits
        cached = self.m.find_cached_prefix(tokens)
        assert len(cached) <= (len(tokens) - 1) // BS
        assert self.m.prefix_cache_queries == queries + len(tokens)
        assert self.m.prefix_cache_hits == hits + len(cached) * BS
        for i, block in enumerate(cached):  # a hit holds exactly this prompt's prefix
            assert self.slots[block.block_id] == [tuple(tokens[: p + 1]) for p in range(i * BS, (i + 1) * BS)]
        rid = f"r{self.next_id}"
        self.next_id += 1
        start = len(cached) * BS
        end = min(len(tokens), start + chunk)
        if self._run(rid, tokens, start, end, cached):
            self.reqs[rid] = {"tokens": tokens, "computed": end}

    @rule(data=st.data(), k=st.integers(1, 10))
    def grow_request(self, data, k):
        if not self.reqs:
            return
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        start, end = req["computed"], req["computed"] + k
        tokens = req["tokens"]
        if end > len(tokens):  # decoding past the prompt: new tokens appear
            tokens = tokens + data.draw(st.lists(ALPHABET, min_size=end - len(tokens), max_size=end - len(tokens)))
        if self._run(rid, tokens, start, end):
            req["tokens"], req["computed"] = tokens, end

    @rule(data=st.data())
    def free_request(self, data):
        if not self.reqs:
            self.m.free("unknown")
            return
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.m.free(rid)
        del self.reqs[rid]
        assert self.m.block_ids(rid) == []

    @rule()
    def reset_prefix_cache(self):
        assert self.m.reset_prefix_cache() == (not self.reqs)
        if not self.reqs:
            assert self.m.num_cached_blocks == 0

    @invariant()
    def ref_counts_match_tables(self):
        count = Counter(b for rid in self.reqs for b in self.m.block_ids(rid))
        pool = self.m.pool
        assert [b.ref_cnt for b in pool.blocks] == [count[i] for i in range(NUM_BLOCKS)]
        free = pool.free_block_ids
        assert len(free) == len(set(free))
        assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        assert self.m.num_free_blocks + len(count) == NUM_BLOCKS
        assert self.m.usage == pytest.approx(len(count) / NUM_BLOCKS)

    @invariant()
    def tables_are_sane(self):
        for rid, req in self.reqs.items():
            table = self.m.block_ids(rid)
            assert len(table) == len(set(table))
            assert len(table) == self.m.blocks_needed(req["computed"])

    @invariant()
    def hash_map_is_consistent(self):
        cached = self.m.pool.cached_blocks
        for h, block in cached.items():
            assert block.block_hash == h
        for block in self.m.pool.blocks:
            if block.block_hash is not None:
                assert cached[block.block_hash] is block
        assert self.m.num_cached_blocks == len(cached)

    @invariant()
    def shared_blocks_hold_each_readers_tokens(self):
        """Every computed position of every live request reads back KV computed from
        its own prefix, so a block shared by two requests holds the same prefix for
        both; and a block's hash is the chain hash of exactly that prefix."""
        for rid, req in self.reqs.items():
            table, tokens = self.m.block_ids(rid), req["tokens"]
            for pos in range(req["computed"]):
                assert self.slots[table[pos // BS]][pos % BS] == tuple(tokens[: pos + 1]), (rid, pos)
            parent = None
            for i, block_id in enumerate(table[: req["computed"] // BS]):
                parent = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS])
                assert self.m.pool.blocks[block_id].block_hash in (parent, None)

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for rid in list(self.reqs):
            self.m.free(rid)
        assert self.m.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.m.pool.blocks)
        assert self.m.usage == 0.0


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
