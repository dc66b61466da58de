import pytest

from engine.block_manager import BlockManager
from tests.engine.fakes import make_seq


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert bm.can_allocate(seq, 10)
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert len(set(seq.block_table)) == 3
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_allocate_grows_only_when_a_block_fills():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(4)))
    bm.allocate(seq, 4)
    seq.num_computed_tokens = 4
    assert len(seq.block_table) == 1
    bm.allocate(seq, 1)  # token 5 opens block 2
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    bm.allocate(seq, 3)  # tokens 6..8 still fit block 2
    assert len(seq.block_table) == 2


def test_exhaustion_is_reported_not_raised_by_can_allocate():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(12)))
    assert not bm.can_allocate(seq, 12)
    with pytest.raises(RuntimeError):
        bm.allocate(seq, 12)
    assert not bm.can_ever_fit(12) and bm.can_ever_fit(8)


def _compute(bm: BlockManager, seq) -> None:
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(10)), "a")
    _compute(bm, a)
    b = make_seq(list(range(8)) + [99, 98, 97], "b")
    hit = bm.match_prefix(b)
    assert hit == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1]


def test_prefix_hit_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(8)), "a")
    _compute(bm, a)
    b = make_seq(list(range(8)), "b")
    assert bm.match_prefix(b) == 4  # the last full block is not used: its last token must run


def test_prefix_cache_checks_tokens_and_chain():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    _compute(bm, a)
    # Same second block, different first block: the chain must not match block 2.
    b = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")
    assert bm.match_prefix(b) == 0


def test_freed_cached_blocks_revive_until_evicted_in_lru_order():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(list(range(9)), "a")
    _compute(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = make_seq(list(range(9)), "b")
    assert bm.match_prefix(b) == 8  # revived from the free queue
    assert bm.num_free_blocks == 2
    bm.free(b)
    # Fill the cache with other content: the cached blocks are evicted, oldest free first.
    c = make_seq([50 + i for i in range(16)], "c")
    bm.allocate(c, 16)
    assert bm.cached == {}
    d = make_seq(list(range(9)), "d")
    bm.free(c)
    assert bm.match_prefix(d) == 0


def test_lru_prefers_evicting_blocks_freed_longest_ago():
    bm = BlockManager(num_blocks=4, block_size=2)
    old = make_seq([1, 2, 3], "old")
    _compute(bm, old)
    new = make_seq([7, 8, 9], "new")
    _compute(bm, new)
    bm.free(old)
    bm.free(new)
    filler = make_seq([40, 41, 42, 43, 44], "filler")
    # Three blocks: the two never-cached tails first, then the cached block freed first ("old").
    bm.allocate(filler, 5)
    assert bm.match_prefix(make_seq([1, 2, 3], "q1")) == 0
    assert bm.match_prefix(make_seq([7, 8, 9], "q2")) == 2


def test_trim_drops_blocks_of_rejected_drafts():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(4)))
    seq.draft_token_ids = [1, 2, 3, 4, 5]
    bm.allocate(seq, 9)
    assert len(seq.block_table) == 3
    seq.num_computed_tokens = 5
    seq.draft_token_ids = []
    bm.trim(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
