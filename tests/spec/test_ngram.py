"""Prompt-lookup proposer: which n-gram matches, what it proposes, and that the index is incremental."""

from engine.spec.ngram import NgramIndex, NgramProposer, continuation
from tests.engine.fakes import make_seq


def propose(tokens, k=4, n_min=1, n_max=3):
    return NgramProposer(n_min, n_max).propose([make_seq(tokens)], [k])[0].tokens


def test_copies_what_followed_the_last_tokens():
    #          the suffix [1, 2, 3] was seen at the start, followed by 4 5 6 7
    assert propose([1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3]) == [4, 5, 6, 7]


def test_longest_n_wins_over_a_later_shorter_match():
    # [8, 2, 3] matches at the start (n=3); [2, 3] alone also matches later, followed by 0.
    assert propose([8, 2, 3, 4, 4, 2, 3, 0, 0, 8, 2, 3], k=2) == [4, 4]


def test_latest_occurrence_of_the_same_n_gram_is_used():
    assert propose([5, 6, 1, 5, 6, 2, 9, 5, 6], k=1, n_min=2, n_max=2) == [2]


def test_no_match_below_prompt_lookup_min_gives_nothing():
    assert propose([1, 2, 3, 4, 3], n_min=2, n_max=3) == []
    assert propose([1, 2, 3, 4, 3], n_min=1, n_max=3) == [4, 3, 4, 3]


def test_continuation_past_the_end_repeats_with_the_match_period():
    assert continuation([7, 8, 9, 7, 8], 2, 6) == [9, 7, 8, 9, 7, 8]
    assert propose([0, 1, 1, 1, 1], k=5) == [1, 1, 1, 1, 1]


def test_k_zero_proposes_nothing_and_short_contexts_are_safe():
    assert NgramProposer(1, 3).propose([make_seq([1])], [0])[0].tokens == []
    assert propose([1]) == []
    assert propose([1, 1]) == [1, 1, 1, 1]


def test_index_grows_incrementally_as_tokens_arrive():
    seq = make_seq([1, 2, 3, 1])
    proposer = NgramProposer(1, 3)
    assert proposer.propose([seq], [2])[0].tokens == [2, 3]
    seq.token_ids.extend([2, 3, 9, 1, 2])
    index = proposer.indexes[seq.seq_id]
    assert proposer.propose([seq], [3])[0].tokens == [3, 9, 1]
    assert index.indexed == len(seq.token_ids)
    fresh = NgramIndex(1, 3)
    fresh.extend(seq.token_ids, len(seq.token_ids))
    assert fresh.maps == index.maps
    proposer.finished(seq)
    assert seq.seq_id not in proposer.indexes


def test_lookahead_drafts_after_the_forced_tokens_and_indexes_only_committed_ones():
    # Committed [7, 1, 2, 3, 4, 9]; a grammar forces [1, 2] next: the match is on [.., 1, 2] -> 3 4.
    seq = make_seq([7, 1, 2, 3, 4, 9])
    proposer = NgramProposer(1, 3)
    assert proposer.propose([seq], [2], lookahead=[[1, 2]])[0].tokens == [3, 4]
    index = proposer.indexes[seq.seq_id]
    assert index.indexed == len(seq.token_ids)  # the forced tokens are not in the index
    assert proposer.propose([seq], [2], lookahead=[[]])[0].tokens == []  # 9 was never followed
