import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fw.kv_cache import BlockPool, KVCacheManager, NoFreeBlocksError
from fw.sdk.block_hash import hash_block_tokens

CORE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core")


def run_request(mgr, rid, tokens, extra_keys=()):
    """Admit a prompt, allocate its slots and mark it fully computed."""
    cached = mgr.get_computed_blocks(rid, tokens, extra_keys)
    assert mgr.allocate_slots(rid, len(tokens))
    mgr.cache_blocks(rid, tokens, len(tokens), extra_keys)
    return cached


# ---------------------------------------------------------------- hashing


def test_hash_is_64bit_and_sensitive_to_every_input():
    h = hash_block_tokens(None, [1, 2, 3])
    assert 0 <= h < 2**64
    assert h == hash_block_tokens(None, (1, 2, 3))
    assert h != hash_block_tokens(0, [1, 2, 3])
    assert h != hash_block_tokens(None, [1, 2, 4])
    assert h != hash_block_tokens(None, [1, 2, 3], ("lora-a",))
    assert hash_block_tokens(None, [1], ("lora-a",)) != hash_block_tokens(None, [1], ("lora-b",))
    # Tagged encoding: these must not collide by concatenation or type.
    assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))
    assert hash_block_tokens(None, [1], (1,)) != hash_block_tokens(None, [1], ("1",))


def test_hash_rejects_unencodable_extra_key():
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (object(),))


def test_hash_equal_across_processes():
    args = "(None, [1, 2, 3, 4], ('lora', 7, b'img', 1.5, None, ('nested', True)))"
    code = f"from fw.sdk.block_hash import hash_block_tokens as h; p = h{args}; print(p, h(p, [5, 6, 7, 8], ('lora', 7)))"
    outs = set()
    for seed in ("0", "12345"):  # different str hash() randomization per process
        env = dict(os.environ, PYTHONPATH=CORE_DIR, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outs.add(res.stdout.strip())
    p = eval("hash_block_tokens" + args)
    assert outs == {f"{p} {hash_block_tokens(p, [5, 6, 7, 8], ('lora', 7))}"}


# ---------------------------------------------------------------- block pool


def test_no_free_blocks_error_message():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(NoFreeBlocksError, match=r"need 2 .* only 1"):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])
    assert b.ref_cnt == 0


def test_lru_eviction_order_and_referenced_blocks_survive():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for b in blocks:
        pool.cache_full_block(b, 100 + b.block_id)
    pinned = blocks[1]
    for i in (2, 0, 3):
        pool.free_blocks([blocks[i]])
    assert pool.usage() == 0.25

    # Oldest freed (block 2) goes first and loses its hash; the rest stay cached.
    (b,) = pool.get_new_blocks(1)
    assert b.block_id == 2 and b.block_hash is None
    assert pool.get_cached_block(102) is None
    assert pool.get_cached_block(100) is blocks[0]
    assert pool.get_cached_block(103) is blocks[3]

    # A cache hit pulls block 0 out of the free queue, so block 3 is next.
    pool.touch([blocks[0]])
    assert [b.block_id for b in pool.get_new_blocks(1)] == [3]
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)
    assert pinned.ref_cnt == 1 and pool.get_cached_block(101) is pinned


def test_cache_full_block_keeps_first_mapping():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 7)
    pool.cache_full_block(b, 7)
    assert pool.get_cached_block(7) is a
    assert b.block_hash is None


def test_reset_prefix_cache():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 1)
    pool.free_blocks([a])
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(1) is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(1) is None and a.block_hash is None


# ---------------------------------------------------------------- manager


def test_prefix_hit_after_finished_request_shares_blocks():
    mgr = KVCacheManager(num_blocks=100, block_size=16)
    prefix = list(range(1000, 1512))
    assert run_request(mgr, "a", prefix + [1, 2, 3]) == 0
    a_ids = mgr.block_ids("a")
    mgr.free("a")

    assert mgr.get_computed_blocks("b", prefix + [7, 8]) == 512
    assert mgr.block_ids("b") == a_ids[:32]
    assert mgr.prefix_cache_hits == 512
    assert mgr.prefix_cache_queries == 515 + 514
    assert mgr.prefix_cache_hit_rate() == pytest.approx(512 / 1029)
    assert mgr.allocate_slots("b", 514)
    assert mgr.block_ids("b")[:32] == a_ids[:32]
    # Concurrent sharing: a second request holds the same blocks.
    assert mgr.get_computed_blocks("c", prefix + [9]) == 512
    assert all(mgr.pool.blocks[i].ref_cnt == 2 for i in a_ids[:32])


def test_extra_keys_separate_cache_namespaces():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    run_request(mgr, "a", list(range(9)), extra_keys=("lora-1",))
    mgr.free("a")
    assert mgr.get_computed_blocks("b", list(range(9)), ("lora-2",)) == 0
    assert mgr.get_computed_blocks("c", list(range(9)), ("lora-1",)) == 8


def test_partial_block_prompts():
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    prompt = list(range(40))
    run_request(mgr, "a", prompt)
    assert len(mgr.block_ids("a")) == 3
    # Only the two full blocks were registered.
    assert sum(b.block_hash is not None for b in mgr.pool.blocks) == 2
    mgr.free("a")
    assert mgr.get_computed_blocks("b", prompt) == 32
    assert mgr.get_computed_blocks("c", prompt[:20]) == 16
    assert mgr.get_computed_blocks("d", prompt[:15]) == 0
    # Diverging inside the second block stops the walk after the first.
    assert mgr.get_computed_blocks("e", prompt[:16] + [99] * 24) == 16


def test_never_whole_prompt_hit():
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    prompt = list(range(32))
    run_request(mgr, "a", prompt)
    mgr.free("a")
    assert mgr.get_computed_blocks("same", prompt) == 16
    assert mgr.get_computed_blocks("longer", prompt + [5]) == 32
    assert mgr.get_computed_blocks("one", prompt[:1]) == 0
    assert mgr.get_computed_blocks("empty", []) == 0


def test_decode_steps_cache_blocks_incrementally():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    tokens = [1, 2, 3]
    run_request(mgr, "a", tokens)
    for t in range(4, 13):  # 12 tokens: three full blocks
        tokens.append(t)
        assert mgr.allocate_slots("a", len(tokens))
        mgr.cache_blocks("a", tokens, len(tokens))
    mgr.free("a")
    assert mgr.get_computed_blocks("b", tokens + [0]) == 12


def test_free_releases_tail_first():
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    run_request(mgr, "a", [1, 2, 3, 4, 5, 6])
    ids = mgr.block_ids("a")
    mgr.free("a")
    assert mgr.num_free_blocks() == 3 and mgr.usage() == 0.0
    # Allocating one block evicts the last block of "a"; its prefix still hits.
    assert mgr.allocate_slots("x", 1)
    assert mgr.block_ids("x") == [ids[2]]
    assert mgr.get_computed_blocks("b", [1, 2, 3, 4, 5, 6, 7]) == 4


def test_unknown_request_is_noop():
    mgr = KVCacheManager(num_blocks=2, block_size=2)
    mgr.free("nope")
    assert mgr.block_ids("nope") == []


def test_copy_on_write_after_fork():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    run_request(mgr, "p", [1, 2, 3, 4, 5, 6])  # second block half full
    p_ids = mgr.block_ids("p")
    mgr.fork("p", "c")
    assert mgr.block_ids("c") == p_ids
    assert [mgr.pool.blocks[i].ref_cnt for i in p_ids] == [2, 2]
    assert mgr.take_pending_copies() == []

    assert mgr.allocate_slots("c", 7)
    c_ids = mgr.block_ids("c")
    assert c_ids[0] == p_ids[0] and c_ids[1] != p_ids[1]
    assert mgr.take_pending_copies() == [(p_ids[1], c_ids[1])]
    assert mgr.take_pending_copies() == []
    assert mgr.block_ids("p") == p_ids
    assert [mgr.pool.blocks[i].ref_cnt for i in p_ids] == [2, 1]

    # The parent now owns its block alone and writes in place.
    assert mgr.allocate_slots("p", 7)
    assert mgr.block_ids("p") == p_ids and mgr.take_pending_copies() == []


def test_fork_at_block_boundary_needs_no_copy():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    run_request(mgr, "p", list(range(8)))
    mgr.fork("p", "c")
    assert mgr.allocate_slots("c", 9)
    assert mgr.take_pending_copies() == []
    assert mgr.block_ids("c")[:2] == mgr.block_ids("p")


def test_allocate_failure_leaves_state_unchanged():
    mgr = KVCacheManager(num_blocks=3, block_size=4)
    assert mgr.allocate_slots("a", 8)
    assert not mgr.can_allocate("b", 12)
    assert not mgr.allocate_slots("b", 12)
    assert mgr.block_ids("b") == [] and mgr.num_free_blocks() == 1
    assert mgr.allocate_slots("b", 4)  # nothing leaked from the failed attempt

    # A copy-on-write that cannot get its fresh block fails atomically too.
    mgr2 = KVCacheManager(num_blocks=2, block_size=4)
    assert mgr2.allocate_slots("p", 6)
    mgr2.fork("p", "c")
    assert not mgr2.can_allocate("c", 7)
    assert not mgr2.allocate_slots("c", 7)
    assert mgr2.block_ids("c") == mgr2.block_ids("p")
    assert [b.ref_cnt for b in mgr2.pool.blocks] == [2, 2]
    assert mgr2.take_pending_copies() == []


def test_allocate_cannot_shrink():
    mgr = KVCacheManager(num_blocks=3, block_size=4)
    assert mgr.allocate_slots("a", 8)
    with pytest.raises(ValueError):
        mgr.allocate_slots("a", 4)


def test_caching_disabled():
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    assert run_request(mgr, "a", list(range(9))) == 0
    mgr.free("a")
    assert run_request(mgr, "b", list(range(9))) == 0
    assert all(b.block_hash is None for b in mgr.pool.blocks)
    assert mgr.prefix_cache_hit_rate() == 0.0


# ---------------------------------------------------------------- property test


class KVCacheMachine(RuleBasedStateMachine):
    """Drives the manager like a scheduler would, against a fake KV memory.

    `memory` simulates the GPU cache: writes land in the block table's slots,
    pending copies are applied before writes. Reading every request back
    through its block table then checks sharing, eviction and COW end to end.
    """

    @initialize(
        num_blocks=st.integers(1, 10),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks, block_size, caching):
        self.mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.memory = {i: [None] * block_size for i in range(num_blocks)}
        self.tokens: dict[str, list[int]] = {}  # request -> tokens that have slots
        self.next_id = 0

    def _pick(self, idx):
        return sorted(self.tokens)[idx % len(self.tokens)]

    def _write(self, rid, start):
        for src, dst in self.mgr.take_pending_copies():
            self.memory[dst] = list(self.memory[src])
        ids = self.mgr.block_ids(rid)
        for pos in range(start, len(self.tokens[rid])):
            block = self.mgr.pool.blocks[ids[pos // self.bs]]
            assert block.ref_cnt == 1, "write into a shared block"
            assert block.block_hash is None, "write into a cached block"
            self.memory[block.block_id][pos % self.bs] = self.tokens[rid][pos]

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def new_request(self, prompt):
        rid = f"r{self.next_id}"
        self.next_id += 1
        free_before = self.mgr.num_free_blocks()
        cached = self.mgr.get_computed_blocks(rid, prompt)
        assert cached % self.bs == 0 and cached <= len(prompt) - 1
        hit_ids = self.mgr.block_ids(rid)
        if not self.mgr.allocate_slots(rid, len(prompt)):
            assert self.mgr.block_ids(rid) == hit_ids
            assert self.mgr.take_pending_copies() == []
            self.mgr.free(rid)
            assert self.mgr.num_free_blocks() == free_before
            return
        self.tokens[rid] = list(prompt)
        self._write(rid, cached)

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 20))
    def compute(self, idx):
        rid = self._pick(idx)
        self.mgr.cache_blocks(rid, self.tokens[rid], len(self.tokens[rid]))

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 20), new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def append(self, idx, new):
        rid = self._pick(idx)
        old_ids = self.mgr.block_ids(rid)
        old_refs = [b.ref_cnt for b in self.mgr.pool.blocks]
        n = len(self.tokens[rid]) + len(new)
        can = self.mgr.can_allocate(rid, n)
        assert self.mgr.allocate_slots(rid, n) == can
        if not can:
            assert self.mgr.block_ids(rid) == old_ids
            assert [b.ref_cnt for b in self.mgr.pool.blocks] == old_refs
            return
        start = len(self.tokens[rid])
        self.tokens[rid] += new
        self._write(rid, start)

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 20))
    def fork(self, idx):
        parent = self._pick(idx)
        child = f"r{self.next_id}"
        self.next_id += 1
        self.mgr.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 20))
    def free(self, idx):
        rid = self._pick(idx)
        self.mgr.free(rid)
        del self.tokens[rid]

    @rule()
    def reset_prefix_cache(self):
        assert self.mgr.pool.reset_prefix_cache() == (not self.tokens)

    @invariant()
    def refcounts_match_block_tables(self):
        pool = self.mgr.pool
        expected = [0] * pool.num_blocks
        for rid in self.tokens:
            for i in self.mgr.block_ids(rid):
                expected[i] += 1
        assert [b.ref_cnt for b in pool.blocks] == expected
        free_ids = set(pool._free_queue)
        assert len(free_ids) == len(pool._free_queue) == pool.get_num_free_blocks()
        # Free queue holds exactly the unreferenced blocks: no leak, no overlap.
        assert free_ids == {i for i, n in enumerate(expected) if n == 0}
        assert self.mgr.usage() == pytest.approx(1 - len(free_ids) / pool.num_blocks)

    @invariant()
    def cache_map_consistent(self):
        pool = self.mgr.pool
        for h, block in pool._cached_blocks.items():
            assert block.block_hash == h
        for block in pool.blocks:
            if block.block_hash is not None:
                assert pool._cached_blocks[block.block_hash] is block

    @invariant()
    def requests_read_back_their_tokens(self):
        for rid, toks in self.tokens.items():
            ids = self.mgr.block_ids(rid)
            assert len(ids) == -(-len(toks) // self.bs)
            got = [self.memory[ids[p // self.bs]][p % self.bs] for p in range(len(toks))]
            assert got == toks
            # A cached hash on one of its blocks must describe this exact prefix.
            parent = None
            for i, block_id in enumerate(ids[: len(toks) // self.bs]):
                parent = hash_block_tokens(parent, toks[i * self.bs : (i + 1) * self.bs])
                h = self.mgr.pool.blocks[block_id].block_hash
                assert h is None or h == parent

    @invariant()
    def hit_rate_in_range(self):
        assert 0.0 <= self.mgr.prefix_cache_hit_rate() <= 1.0
        assert self.mgr.prefix_cache_hits <= self.mgr.prefix_cache_queries

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for rid in list(self.tokens):
            self.mgr.free(rid)
        self.mgr.take_pending_copies()
        pool = self.mgr.pool
        assert pool.get_num_free_blocks() == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert pool.reset_prefix_cache()


KVCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_state_machine = KVCacheMachine.TestCase
