"""The counter-based noise: exact SplitMix64 bits, uniform, independent across every coordinate,
and a pure function of its coordinates (the same inside any batch layout)."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chi2_contingency, chisquare

from engine.sampler import SampleRow, Sampler
from engine.sampling_params import SamplingParams
from specbatch_kernels.counter_rng import GOLDEN, MASK64, keys_tensor, mix64, random_bits, row_key, uniforms
from tests.engine.fakes import make_seq

BINS = 64


def test_vectorised_bits_equal_python_splitmix64():
    keys = [row_key(seed, index, pos) for seed, index, pos in ((0, 0, 0), (2**70 + 5, 3, 9), (-1, 1, 2047))]
    tokens = torch.tensor([0, 1, 2, 49151, 2**20])
    bits = random_bits(keys_tensor(keys, "cpu")[:, None], tokens[None])
    for r, key in enumerate(keys):
        for c, v in enumerate(tokens.tolist()):
            assert int(bits[r, c]) & MASK64 == mix64((key & MASK64) + (v + 1) * GOLDEN)


def test_uniforms_are_uniform():
    keys = keys_tensor([row_key(seed, 0, pos) for seed in range(20) for pos in range(50)], "cpu")
    u = uniforms(keys[:, None], torch.arange(200)[None]).flatten()  # 200,000 values
    assert bool(((u > 0) & (u < 1)).all())
    counts = torch.bincount((u * BINS).long(), minlength=BINS).numpy()
    assert chisquare(counts).pvalue > 0.001


def joint_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square independence test of two uniform samples over an 8x8 grid."""
    table = np.zeros((8, 8))
    np.add.at(table, ((a * 8).long().numpy(), (b * 8).long().numpy()), 1)
    return float(chi2_contingency(table).pvalue)


def test_noise_is_independent_across_positions_indices_seeds_and_tokens():
    tokens = torch.arange(100)[None]
    base = [(seed, index, pos) for seed in range(40) for index in range(2) for pos in range(5, 30)]

    def u(shift):
        keys = [row_key(s + shift[0], i + shift[1], p + shift[2]) for s, i, p in base]
        return uniforms(keys_tensor(keys, "cpu")[:, None], tokens).flatten()

    ref = u((0, 0, 0))
    for shift in ((0, 0, 1), (0, 1, 0), (1, 0, 0)):  # next position, next sample, next seed
        other = u(shift)
        assert joint_pvalue(ref, other) > 0.001, shift
        assert abs(float(np.corrcoef(ref.numpy(), other.numpy())[0, 1])) < 0.01, shift
    neighbour = uniforms(keys_tensor([row_key(*c) for c in base], "cpu")[:, None], tokens + 1).flatten()
    assert joint_pvalue(ref, neighbour) > 0.001  # adjacent tokens of one row


def test_streams_differ():
    assert len({row_key(1, 0, 5, stream) for stream in range(3)}) == 3


def test_a_rows_token_is_the_same_in_any_batch_layout():
    """The same seeded rows sampled alone, in a batch, in reverse order and between strangers."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen)
    rows = []
    for i in range(6):
        seq = make_seq(list(range(3 + i)))
        seq.request.params = SamplingParams(temperature=1.0, top_p=0.9 if i % 2 else 1.0, seed=100 + i)
        rows.append(SampleRow(seq, [7] * (i % 3)))
    sampler = Sampler(set())
    alone = [sampler.sample(logits[i : i + 1], [rows[i]])[0] for i in range(6)]
    assert sampler.sample(logits, rows) == alone
    assert sampler.sample(logits.flip(0), rows[::-1]) == alone[::-1]
    strangers = [SampleRow(make_seq([1, 2]), []) for _ in range(3)]
    for s in strangers:
        s.seq.request.params = SamplingParams(temperature=0.7)
    mixed = sampler.sample(torch.cat([torch.randn(3, 300, generator=gen), logits]), strangers + rows)
    assert mixed[3:] == alone
