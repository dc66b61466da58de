"""Suffix index: occurrence counts, most frequent continuation, bounded depth and FIFO eviction."""

from engine.spec.suffix import Node, SuffixIndex, SuffixProposer
from tests.engine.fakes import make_seq


def dump(node: Node, prefix=()) -> dict:
    out = {}
    for token, child in node.children.items():
        out[prefix + (token,)] = child.count
        out.update(dump(child, prefix + (token,)))
    return out


def substrings(tokens, depth):
    counts = {}
    for i in range(len(tokens)):
        for j in range(i + 1, min(len(tokens), i + depth) + 1):
            key = tuple(tokens[i:j])
            counts[key] = counts.get(key, 0) + 1
    return counts


def test_counts_every_substring_up_to_the_depth_even_when_appended_piecewise():
    index = SuffixIndex(max_depth=3)
    index.extend("a", [1, 2, 1, 2])
    index.extend("a", [3])
    index.extend("b", [1, 2, 3])
    expected = substrings([1, 2, 1, 2, 3], 3)
    for key, count in substrings([1, 2, 3], 3).items():
        expected[key] = expected.get(key, 0) + count
    assert dump(index.root) == expected
    assert max(len(k) for k in dump(index.root)) == 3


def test_proposes_the_most_frequent_continuation_of_the_longest_suffix():
    index = SuffixIndex(max_depth=8)
    index.extend(1, [5, 1, 2, 3, 4])
    index.extend(2, [6, 1, 2, 3, 9])
    index.extend(3, [7, 1, 2, 3, 9])
    assert index.speculate([0, 1, 2, 3], k=1) == [9]  # 9 followed "1 2 3" twice, 4 once
    assert index.speculate([5, 1, 2, 3], k=1) == [4]  # the longer suffix "5 1 2 3" decides
    assert index.speculate([8, 8], k=3) == []


def test_stops_when_the_continuation_becomes_unlikely():
    index = SuffixIndex(max_depth=8)
    for i in range(10):
        index.extend(i, [1, 2, 3, 100 + i])  # after "1 2 3" each continuation has p = 0.1
    assert index.speculate([1, 2, 3], k=4, min_prob=0.5) == []
    assert index.speculate([0, 1, 2], k=4, min_prob=0.5) == [3]
    assert index.speculate([1, 2], k=1, min_prob=0.05) in ([3],)


def test_match_length_caps_the_draft_length():
    index = SuffixIndex(max_depth=16)
    index.extend(0, list(range(20)))
    assert index.speculate([99, 4], k=10, spec_factor=1.0) == [5]
    assert index.speculate([3, 4], k=10, spec_factor=2.0) == [5, 6, 7, 8]


def test_fifo_eviction_of_finished_lists_restores_exact_counts():
    index = SuffixIndex(max_depth=4, max_tokens=10)
    index.extend("old", [1, 2, 3, 4, 5])
    index.close("old")
    index.extend("running", [6, 7, 8])
    index.extend("new", [1, 2, 9])
    index.close("new")
    assert "old" not in index.entries and index.num_tokens == 6  # 11 > 10: the oldest went
    fresh = SuffixIndex(max_depth=4)
    fresh.extend("running", [6, 7, 8])
    fresh.extend("new", [1, 2, 9])
    assert dump(index.root) == dump(fresh.root)


def test_running_lists_are_never_evicted():
    index = SuffixIndex(max_depth=4, max_tokens=3)
    index.extend("a", [1, 2, 3, 4, 5])
    assert "a" in index.entries
    index.extend("a", [6])
    assert dump(index.root) == substrings([1, 2, 3, 4, 5, 6], 4)


def test_proposer_learns_from_finished_sequences_and_its_own_context():
    proposer = SuffixProposer(max_depth=24, max_tokens=10_000, min_prob=0.1, spec_factor=4.0)
    first = make_seq([1, 2])
    first.token_ids.extend([10, 11, 12, 13])
    assert proposer.propose([first], [3])[0].tokens == []  # nothing seen yet
    first.finish_reason = "stop"
    proposer.finished(first)
    second = make_seq([1, 2, 10])
    assert proposer.propose([second], [3])[0].tokens == [11, 12, 13]
    # Its own earlier tokens count too (a per-request index).
    third = make_seq([42, 43, 44, 45, 42, 43])
    assert proposer.propose([third], [2])[0].tokens == [44, 45]
