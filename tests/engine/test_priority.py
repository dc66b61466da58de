"""Priority scheduling (vLLM's ``scheduling_policy="priority"``): urgent requests first, less
urgent ones preempted and recomputed with identical output, aging against starvation, a reserve
of sequence slots, and prefix-cache retention by priority."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from tests.engine.fakes import make_seq
from tests.engine.test_scheduler import step  # one simulated engine step

INTERACTIVE, BULK = 0, 1


def prio_seq(tokens, request_id, priority):
    seq = make_seq(tokens, request_id)
    seq.request.priority = priority
    return seq


def ids(out) -> list[str]:
    return [s.seq.request.request_id for s in out.scheduled]


def make_sched(policy="priority", **kw) -> Scheduler:
    bm = BlockManager(kw.pop("num_blocks", 1024), 4, enable_prefix_caching=False, by_priority=policy == "priority")
    return Scheduler(bm, kw.pop("max_num_seqs", 4), kw.pop("budget", 64), policy=policy, **kw)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_an_urgent_request_is_admitted_ahead_of_queued_bulk(policy):
    sched = make_sched(policy, max_num_seqs=2)
    for i in range(10):
        sched.add(prio_seq([1, 2, 3], f"bulk{i}", BULK))
    step(sched)
    sched.add(prio_seq([1, 2, 3], "urgent", INTERACTIVE))
    admitted = ids(step(sched))
    if policy == "priority":  # it takes a slot at once (a bulk one is preempted for it)
        assert "urgent" in admitted
    else:  # FIFO: it waits behind all ten
        assert "urgent" not in admitted


def test_the_least_urgent_most_recent_running_request_is_the_one_preempted():
    sched = make_sched(max_num_seqs=3)
    for name, prio in (("b0", BULK), ("b1", BULK), ("mid", 0)):
        sched.add(prio_seq([1, 2, 3], name, prio))
    step(sched)
    assert [s.request.request_id for s in sched.running] == ["mid", "b0", "b1"]  # by priority
    sched.add(prio_seq([1, 2, 3], "urgent", -1))
    out = step(sched)
    assert [s.request.request_id for s in out.preempted] == ["b1"]
    assert "urgent" in ids(out) and "b0" in ids(out) and "mid" in ids(out)


def test_a_less_urgent_request_never_preempts_a_more_urgent_one():
    sched = make_sched(max_num_seqs=2)
    sched.add(prio_seq([1, 2, 3], "i0", INTERACTIVE))
    sched.add(prio_seq([1, 2, 3], "i1", INTERACTIVE))
    step(sched)
    sched.add(prio_seq([1, 2, 3], "bulk", BULK))
    for _ in range(3):
        out = step(sched)
        assert not out.preempted and "bulk" not in ids(out)


def test_urgent_waiting_requests_get_the_token_budget_before_less_urgent_running_ones():
    # A running bulk prefill would take the whole budget; the urgent request goes first.
    sched = make_sched(max_num_seqs=4, budget=16)
    sched.add(prio_seq(list(range(200)), "bulk", BULK))
    step(sched)
    sched.add(prio_seq(list(range(10)), "urgent", INTERACTIVE))
    out = step(sched)
    assert out.scheduled[0].seq.request.request_id == "urgent" and out.scheduled[0].num_new_tokens == 10
    assert ids(out) == ["urgent", "bulk"] and out.num_tokens == 16


def test_reserved_slots_are_left_to_urgent_requests_while_urgent_work_is_about(monkeypatch):
    import engine.scheduler as scheduler_module

    clock = [1000.0]
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: clock[0])
    sched = make_sched(max_num_seqs=4, reserved_seqs=1)
    for i in range(6):
        sched.add(prio_seq([1, 2, 3], f"bulk{i}", BULK))
    step(sched, max_out=100)
    assert len(sched.running) == 4  # no urgent work yet: bulk has the whole batch
    sched.add(prio_seq([1, 2, 3], "urgent0", INTERACTIVE))
    out = step(sched, max_out=100)
    assert "urgent0" in ids(out) and [s.request.request_id for s in out.preempted] == ["bulk3"]
    sched.remove(next(s for s in sched.running if s.request.request_id == "urgent0"))
    step(sched, max_out=100)
    assert len(sched.running) == 3  # urgent work is about: background work leaves one slot free
    sched.add(prio_seq([1, 2, 3], "urgent", INTERACTIVE))
    out = step(sched, max_out=100)
    assert "urgent" in ids(out) and not out.preempted and len(sched.running) == 4
    # A quiet spell longer than the hold gives bulk the slot back.
    sched.remove(next(s for s in sched.running if s.request.request_id == "urgent"))
    clock[0] += scheduler_module.URGENT_RESERVE_HOLD_S + 1
    step(sched, max_out=100)
    assert len(sched.running) == 4 and not sched.reserve_active()


def test_aging_bounds_a_bulk_requests_wait_under_a_steady_urgent_stream():
    def bulk_finished_at(aging_steps: int, horizon: int = 200) -> int | None:
        sched = make_sched(max_num_seqs=1, aging_steps=aging_steps)
        bulk = prio_seq([1, 2, 3], "bulk", BULK)
        sched.add(bulk)
        sched.add(prio_seq([1, 2, 3], "i-first", INTERACTIVE))
        for t in range(horizon):
            sched.add(prio_seq([1, 2, 3], f"i{t}", INTERACTIVE))  # one urgent arrival per step...
            step(sched, max_out=4)  # ...each needing four steps: an ever-growing backlog
            if bulk.is_finished:
                return t
        return None

    assert bulk_finished_at(aging_steps=10**6) is None  # without aging it starves
    done = bulk_finished_at(aging_steps=20)
    # Only the 21 urgent requests that arrived within 20 steps after it go first (4 steps each);
    # once admitted it is not preempted by later arrivals and finishes in 4 more steps.
    assert done is not None and done <= 4 * 21 + 4


def test_an_urgent_prefix_survives_a_bulk_sweep_that_fills_the_cache():
    def survives(by_priority: bool) -> bool:
        bm = BlockManager(num_blocks=16, block_size=4, by_priority=by_priority)
        conversation = list(range(100, 112))  # three full blocks
        live = prio_seq(conversation + [1], "live", INTERACTIVE)
        bm.allocate(live, live.num_tokens)
        live.num_computed_tokens = live.num_tokens
        bm.cache_full_blocks(live)
        bm.free(live)  # the turn is over; its prefix stays cached for the next turn
        for i in range(40):  # 40 bulk jobs x 3 blocks: the cache over seven times
            job = prio_seq([1000 * i + t for t in range(12)], f"bulk{i}", BULK)
            bm.allocate(job, 12)
            job.num_computed_tokens = 12
            bm.cache_full_blocks(job)
            bm.free(job)
        next_turn = prio_seq(conversation + [1, 2, 3], "next", INTERACTIVE)
        return bm.match_prefix(next_turn) == 12

    assert survives(by_priority=True)
    assert not survives(by_priority=False)  # plain LRU: the sweep evicted it


@pytest.fixture(scope="module")
def prio_llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", max_num_seqs=3, max_num_batched_tokens=64,
               scheduling_policy="priority")


def test_engine_starts_an_urgent_request_within_one_step_and_preempted_bulk_output_is_unchanged(prio_llm):
    engine = prio_llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [f"bulk prompt number {i} " * 2 for i in range(8)]
    alone = {o.prompt: o.outputs[0].token_ids for o in prio_llm.generate(prompts, params, use_tqdm=False)}

    bulk_ids = [engine.add_request(p, params=params, priority=BULK) for p in prompts]
    for _ in range(6):
        engine.step()
    assert len(engine.scheduler.running) == 3 and len(engine.scheduler.waiting) == 5
    urgent = engine.make_request("answer me now", params=SamplingParams(temperature=0, max_tokens=4),
                                 priority=INTERACTIVE)
    engine.add(urgent)
    outputs = {}
    while engine.has_unfinished():
        for request in engine.step():
            if request.is_finished:
                outputs[request.request_id] = engine.make_output(request)
    assert outputs[urgent.request_id].metrics.num_waiting_steps == 0
    preempted = [rid for rid in bulk_ids if outputs[rid].metrics.num_preemptions > 0]
    assert preempted, "the full engine should have preempted a bulk request for the urgent one"
    for rid in bulk_ids:
        out = outputs[rid]
        assert out.outputs[0].token_ids == alone[out.prompt]


def test_llm_generate_takes_one_priority_per_prompt(prio_llm):
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        prio_llm.generate(["a", "b"], priority=[0], use_tqdm=False)
    with pytest.raises(ValueError, match="priority must be an integer"):
        prio_llm.generate(["a"], priority=["high"], use_tqdm=False)


def test_urgent_only_steps_leave_bulk_out_k_of_every_k_plus_1_steps():
    sched = make_sched(max_num_seqs=8, urgent_only_steps=2)
    for i in range(3):
        sched.add(prio_seq([1, 2, 3], f"bulk{i}", BULK))
    step(sched, max_out=100)
    sched.add(prio_seq([1, 2, 3], "urgent", INTERACTIVE))
    pattern = []
    for _ in range(9):
        out = step(sched, max_out=100)
        assert "urgent" in ids(out)  # every step
        pattern.append(any(n.startswith("bulk") for n in ids(out)))
    assert pattern == [False, False, True] * 3
    # Without urgent work, bulk runs every step.
    sched.remove(sched.running[-1] if sched.running[-1].request.request_id == "urgent"
                 else next(s for s in sched.running if s.request.request_id == "urgent"))
    assert all(len(ids(step(sched, max_out=100))) == 3 for _ in range(4))


def test_a_stream_of_urgent_work_that_never_lets_up_leaves_bulk_half_the_time():
    """k = 16 would give bulk one step in 17 for as long as urgent work runs; the share cap
    keeps urgent-only steps to at most half of every window of recent step *time*: here an
    urgent-only step takes 10 ms and a full one 50 ms, as on a CPU, so a cap in steps would
    have bound long before urgent work had half the engine."""
    from engine.scheduler import URGENT_ONLY_MAX_SHARE, URGENT_ONLY_WINDOW_S

    urgent_s, full_s = 0.01, 0.05
    sched = make_sched(max_num_seqs=8, urgent_only_steps=16, num_blocks=4096)
    sched.add(prio_seq([1, 2, 3], "bulk", BULK))
    step(sched, max_out=100_000)
    sched.add(prio_seq([1, 2, 3], "urgent", INTERACTIVE))
    timeline: list[tuple[float, bool]] = []  # (seconds, urgent-only)
    while sum(t for t, _ in timeline) < 4 * URGENT_ONLY_WINDOW_S:
        out = step(sched, max_out=100_000)
        assert "urgent" in ids(out)
        urgent_only = "bulk" not in ids(out)
        seconds = urgent_s if urgent_only else full_s
        sched.record_step_time(seconds)
        timeline.append((seconds, urgent_only))
    assert [u for _, u in timeline[:17]] == [True] * 16 + [False]  # k of every k + 1 at first
    # In every window of URGENT_ONLY_WINDOW_S seconds, urgent-only steps took at most the share
    # (plus the one step that crossed it).
    for end in range(len(timeline)):
        total = urgent = 0.0
        for seconds, urgent_only in reversed(timeline[:end + 1]):
            if total + seconds > URGENT_ONLY_WINDOW_S:
                break
            total += seconds
            urgent += seconds if urgent_only else 0.0
        assert urgent <= URGENT_ONLY_MAX_SHARE * URGENT_ONLY_WINDOW_S + urgent_s
    # And the cap did bind: bulk got steps beyond one in 17 once the share was spent.
    late = [u for _, u in timeline[len(timeline) // 2:]]
    assert late.count(False) / len(late) > 1 / 17 + 0.1
