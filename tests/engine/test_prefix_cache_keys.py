"""Prefix-cache keys: digests are only an index; exact content and chain decide a hit; salts isolate."""

from array import array

import pytest

import engine.block_manager as block_manager
from engine import LLM, LLMEngine, SamplingParams
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from tests.engine.fakes import make_seq


def _compute(bm: BlockManager, seq) -> None:
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def _salted(tokens, request_id, salt):
    seq = make_seq(tokens, request_id)
    seq.request.cache_salt = salt
    return seq


def test_different_salts_share_no_blocks_and_the_same_salt_shares():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(13))
    a = _salted(prompt, "a", "tenant-1")
    _compute(bm, a)
    other = _salted(prompt, "b", "tenant-2")
    assert bm.match_prefix(other) == 0 and other.block_table == []
    unsalted = _salted(prompt, "c", None)
    assert bm.match_prefix(unsalted) == 0
    same = _salted(prompt, "d", "tenant-1")
    assert bm.match_prefix(same) == 12
    assert same.block_table == a.block_table[:3]


def test_digests_are_salted_and_chained():
    tokens = (1, 2, 3, 4)
    root = block_manager.root_digest(None)
    assert block_manager.root_digest("x") != root != block_manager.root_digest("y")
    first = block_manager.block_digest(root, tokens)
    assert block_manager.block_digest(first, tokens) != first
    assert block_manager.block_digest(root, (1, 2, 3, 5)) != first


@pytest.mark.parametrize("fake", ["constant", "tokens_only"])
def test_colliding_digests_never_hand_out_the_wrong_block(monkeypatch, fake):
    digest = (lambda parent, tokens: b"same") if fake == "constant" else (
        lambda parent, tokens: array("q", tokens).tobytes()
    )
    monkeypatch.setattr(block_manager, "block_digest", digest)
    bm = BlockManager(num_blocks=32, block_size=4)
    a = make_seq([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 9], "a")
    _compute(bm, a)
    # Its first block equals a's *second* block: same tokens, different parent.
    b = make_seq([2, 2, 2, 2, 3, 3, 3, 3, 9], "b")
    assert bm.match_prefix(b) == 0
    c = make_seq([7, 7, 7, 7, 9], "c")
    assert bm.match_prefix(c) == 0
    salted = _salted([1, 1, 1, 1, 2], "s", "tenant")
    assert bm.match_prefix(salted) == 0
    # The genuine prefix still hits (the whole chain under a parent-blind digest).
    d = make_seq([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 5], "d")
    assert bm.match_prefix(d) == (12 if fake == "tokens_only" else 4)
    assert d.block_table == a.block_table[: len(d.block_table)]


def test_a_reused_parent_block_orphans_its_cached_children(monkeypatch):
    monkeypatch.setattr(block_manager, "block_digest", lambda parent, tokens: array("q", tokens).tobytes())
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq([1, 1, 2, 2, 9], "a")
    _compute(bm, a)
    parent, child = a.block_table[:2]
    bm.free(a)
    a_tail = ({0, 1, 2} - {parent, child}).pop()
    bm.allocate(make_seq([8], "holder"), 1)  # takes the never-cached tail (empty blocks go first)
    bm.cached_free[0].move_to_end(child)  # the parent is reused next, the child stays cached
    filler = make_seq([5, 5], "filler")
    _compute(bm, filler)
    assert filler.block_table == [parent] and a_tail not in bm.empty_free and child in bm.cached.values()
    # [5, 5] hits the reused parent block; [2, 2] after it must not revive the old child.
    b = make_seq([5, 5, 2, 2, 9], "b")
    assert bm.match_prefix(b) == 2 and b.block_table == [parent]


def _generate(llm: LLM, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("fake", ["constant", "tokens_only"])
def test_engine_output_is_exact_under_colliding_digests(tiny_model_dir, monkeypatch, fake):
    digest = (lambda parent, tokens: b"same") if fake == "constant" else (
        lambda parent, tokens: array("q", tokens).tobytes()
    )
    monkeypatch.setattr(block_manager, "block_digest", digest)
    p1, p2, common = "first block 16ch", "second block 16c", "a shared middle."
    warm = [p1 + p2 + common + " tail one"]
    prompts = [p2 + common + " tail two", p1 + p2 + common + " tail three", "another prompt entirely here!!"]
    cached = LLM(tiny_model_dir, device="cpu", block_size=16, max_num_seqs=4)
    config = EngineConfig(model=tiny_model_dir, device="cpu", max_num_seqs=4, enable_prefix_caching=False)
    plain = LLM.from_engine(LLMEngine(config, model=cached.engine.model, tokenizer=cached.engine.tokenizer))
    assert _generate(cached, warm) == _generate(plain, warm)
    outs = cached.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _generate(plain, prompts)
    assert outs[0].num_cached_tokens == 0  # its first block is the warm prompt's second block
    assert outs[1].num_cached_tokens == (48 if fake == "tokens_only" else 16)


def test_engine_cache_salt_isolates_requests(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", block_size=16)
    prompt = "a prompt that is long enough for two blocks of sixteen"
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False, cache_salt="tenant-1")[0]
    other = llm.generate(prompt, params, use_tqdm=False, cache_salt="tenant-2")[0]
    same = llm.generate({"prompt": prompt, "cache_salt": "tenant-1"}, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert same.num_cached_tokens == 48
    assert first.outputs[0].token_ids == other.outputs[0].token_ids == same.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate(prompt, params, use_tqdm=False, cache_salt=3)


def test_engine_loop_submit_takes_a_cache_salt(tiny_model_dir):
    from engine import EngineLoop

    loop = EngineLoop(LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", block_size=16))).start()
    try:
        prompt = "a prompt that is long enough for two blocks of sixteen"
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        assert loop.submit(prompt, params=params, cache_salt="a").result(timeout=60).num_cached_tokens == 0
        assert loop.submit(prompt, params=params, cache_salt="b").result(timeout=60).num_cached_tokens == 0
        assert loop.submit(prompt, params=params, cache_salt="a").result(timeout=60).num_cached_tokens == 48
    finally:
        loop.shutdown(drain_timeout=5)


def test_one_token_requests_sharing_a_prefix_run_together(tiny_model_dir):
    """A request that ends in its prefill step (max_tokens=1) still leaves its prompt blocks in
    the prefix cache: the requests that waited a step to share them find them there. (They were
    freed uncached, so each waiting request computed the prefix alone: one request per step.)"""
    shared = "an instruction shared by every line of this bulk job, longer than 3 blocks. "
    prompts = [shared + f"item {i}" for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=1)
    llm = LLM(tiny_model_dir, device="cpu", block_size=16, max_num_seqs=32)
    steps_before = llm.engine.scheduler.num_steps
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_steps - steps_before <= 3
    assert min(o.num_cached_tokens for o in outs[1:]) >= 48
    config = EngineConfig(model=tiny_model_dir, device="cpu", max_num_seqs=32, enable_prefix_caching=False)
    plain = LLM.from_engine(LLMEngine(config, model=llm.engine.model, tokenizer=llm.engine.tokenizer))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in
                                                       plain.generate(prompts, params, use_tqdm=False)]
