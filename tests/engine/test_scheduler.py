from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.sequence import SequenceStatus
from tests.engine.fakes import make_seq


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=False), max_num_seqs, budget)


def step(sched: Scheduler, max_out: int = 4, cache_blocks: bool = False):
    """One simulated engine step: computed catches up, sampled sequences grow, finished ones
    leave; with ``cache_blocks`` full blocks enter the prefix cache (a finishing sequence's too,
    before it frees them), as the engine does."""
    out = sched.schedule()
    for item in out.scheduled:
        seq = item.seq
        samples = item.samples
        seq.num_computed_tokens += item.num_new_tokens
        if samples:
            seq.token_ids.append(7)
        if cache_blocks:
            sched.block_manager.cache_full_blocks(seq)
        if samples and seq.num_output_tokens >= max_out:
            seq.status = SequenceStatus.FINISHED
            sched.remove(seq)
    return out


def test_token_budget_and_seq_limit_are_respected():
    sched = make_scheduler(max_num_seqs=3, budget=32)
    seqs = [make_seq(list(range(30)), f"r{i}") for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    out = step(sched)
    assert out.num_tokens <= 32
    assert [(s.seq.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 30), ("r1", 2)]
    for _ in range(20):
        out = step(sched)
        assert out.num_tokens <= 32
        assert len(sched.running) <= 3


def test_long_prompt_is_chunked_and_samples_only_at_the_end():
    sched = make_scheduler(budget=32)
    seq = make_seq(list(range(100)))
    sched.add(seq)
    chunks = []
    for _ in range(4):
        out = step(sched)
        chunks.append((out.scheduled[0].num_new_tokens, seq.num_output_tokens))
    assert chunks == [(32, 0), (32, 0), (32, 0), (4, 1)]


def test_prefill_and_decode_share_a_step_running_first():
    sched = make_scheduler(budget=16)
    a = make_seq(list(range(8)), "a")
    sched.add(a)
    step(sched)
    b = make_seq(list(range(40)), "b")
    sched.add(b)
    out = step(sched)
    assert [(s.seq.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 15)]


def test_preemption_by_recompute_and_resumption():
    # 6 blocks of 4 tokens: two sequences of 8 prompt tokens that grow to 16 cannot both fit.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = make_seq(list(range(8)), "a"), make_seq(list(range(8)), "b")
    sched.add(a)
    sched.add(b)
    preempted = []
    for _ in range(40):
        out = step(sched, max_out=8)
        preempted += [s.request.request_id for s in out.preempted]
        if not sched.has_unfinished():
            break
    assert preempted and preempted[0] == "b"  # the latest admitted yields
    assert b.request.metrics.num_preemptions >= 1
    assert a.is_finished and b.is_finished
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert sched.block_manager.num_free_blocks == 6


def test_preempted_sequence_recomputes_its_output_too():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64)
    a, b = make_seq(list(range(8)), "a"), make_seq(list(range(8)), "b")
    sched.add(a)
    sched.add(b)
    while not b.request.metrics.num_preemptions:
        step(sched, max_out=8)
    assert b.num_computed_tokens == 0 and sched.waiting[0] is b
    tokens_before = b.num_tokens
    # Once a finishes, b comes back and recomputes prompt + output generated so far.
    while b.num_computed_tokens == 0:
        out = step(sched, max_out=8)
    resumed = [s for s in out.scheduled if s.seq is b][0]
    assert resumed.num_new_tokens == tokens_before


def test_no_starvation_under_a_stream_of_arrivals():
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=4, budget=24)
    finished_order = []
    arrivals = 0
    live = []
    for t in range(300):
        if arrivals < 60:
            seq = make_seq(list(range(10)), f"r{arrivals}")
            arrivals += 1
            sched.add(seq)
            live.append(seq)
        step(sched, max_out=6)
        for seq in list(live):
            if seq.is_finished:
                finished_order.append(int(seq.request.request_id[1:]))
                live.remove(seq)
        if arrivals == 60 and not sched.has_unfinished():
            break
    assert sorted(finished_order) == list(range(60))
    # FIFO admission: nobody finishes more than max_num_seqs places after its arrival rank.
    assert all(abs(pos - rid) <= 4 for pos, rid in enumerate(finished_order))


def test_request_larger_than_the_cache_fails_alone():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    big = make_seq(list(range(20)), "big")
    small = make_seq(list(range(4)), "small")
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert [s.request.request_id for s, _ in out.failed] == ["big"]
    assert "KV-cache blocks" in out.failed[0][1]
    assert [s.seq.request.request_id for s in out.scheduled] == ["small"]


def test_drafts_are_scheduled_tokens_and_trimmed_to_the_budget():
    sched = make_scheduler(budget=4)
    seq = make_seq(list(range(3)))
    sched.add(seq)
    step(sched)  # prefill 3 tokens (budget 4), samples one
    seq.draft_token_ids = [5, 6, 7, 8, 9]
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 4  # 1 new token + 3 drafts that fit
    assert seq.draft_token_ids == [5, 6, 7]
    assert out.scheduled[0].samples


def step_and_cache(sched: Scheduler, max_out: int = 4):
    """``step`` plus what the engine does after a forward: register fully computed blocks."""
    out = step(sched, max_out)
    for seq in sched.running:
        sched.block_manager.cache_full_blocks(seq)
    return out


def test_requests_sharing_a_prompt_prefix_in_one_step_compute_it_once():
    """b's first two blocks are what a computes in the same step: b waits one step and takes
    them from the prefix cache; c shares nothing and is not held back."""
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=True), 8, 64)
    shared = [9, 8, 7, 6, 5, 4, 3, 2]
    a = make_seq(shared + [1, 1, 1], "a")
    c = make_seq([50, 51, 52, 53, 54, 55], "c")
    b = make_seq(shared + [2, 2, 2, 2, 2], "b")
    for seq in (a, c, b):
        sched.add(seq)
    out = step_and_cache(sched)
    assert [(s.seq.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 11), ("c", 6)]
    out = step_and_cache(sched)
    got = {s.seq.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert got == {"a": 1, "c": 1, "b": 5}  # b computes only what it does not share
    assert b.request.metrics.num_cached_tokens == 8


def test_no_hold_back_without_prefix_caching():
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), 8, 64)
    shared = [9, 8, 7, 6, 5, 4, 3, 2]
    for name in ("a", "b"):
        sched.add(make_seq(shared + [1], name))
    out = step(sched)
    assert [(s.seq.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 9), ("b", 9)]


def test_waiting_prefix_hit_never_makes_a_running_request_too_large():
    # 4 blocks of 4 tokens. A waiting request matches two cached blocks and then cannot be
    # admitted; the one running request later needs a third block. The empty cache holds it,
    # so it must not fail as "too large" (the blocked waiter's hits used to pin those blocks).
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)

    def run(max_out: int) -> list:
        failed = []
        for _ in range(40):
            failed += step(sched, max_out, cache_blocks=True).failed
            if not sched.has_unfinished():
                break
        return failed

    sched.add(make_seq(list(range(1, 9)), "cached"))  # leaves its two full blocks in the cache
    assert run(max_out=2) == []
    grower = make_seq(list(range(50, 58)), "grower")  # grows to 12 tokens: 3 blocks
    waiter = make_seq(list(range(1, 13)), "waiter")  # hits 2 cached blocks, grows to 4 blocks
    sched.add(grower)
    sched.add(waiter)
    failed = run(max_out=4)
    assert [(s.request.request_id, msg) for s, msg in failed] == []
    assert grower.num_output_tokens == 4 and waiter.num_output_tokens == 4
    assert bm.num_free_blocks == 4
