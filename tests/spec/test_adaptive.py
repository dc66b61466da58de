"""Adaptive k: Leviathan's expected speedup, the choice of k, the cost fit, acceptance tracking."""

import math

import pytest

from engine.spec.adaptive import (
    Acceptance,
    RealizedCost,
    StepCost,
    best_k,
    best_k_for_costs,
    expected_speedup,
    expected_tokens,
)


def test_expected_tokens_and_speedup_follow_leviathan():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert math.isclose(expected_tokens(0.5, 2), 1 + 0.5 + 0.25)
    # (1 - a^(k+1)) / ((1 - a)(k c + 1)): c divides, it is a cost ratio, not a speed ratio.
    assert math.isclose(expected_speedup(0.8, 4, 0.1), (1 - 0.8**5) / (0.2 * 1.4))
    assert expected_speedup(0.8, 4, 0.5) < expected_speedup(0.8, 4, 0.1)


def test_k_is_zero_when_drafts_are_expensive_or_rarely_accepted():
    assert best_k(0.9, 1.0, 10) == 0  # a draft as costly as the target never pays
    assert best_k(0.1, 0.2, 10) == 0  # almost nothing accepted
    assert best_k(0.5, 0.6, 10) == 0


def test_k_grows_with_acceptance_and_shrinks_with_cost():
    ks = [best_k(a, 0.05, 32) for a in (0.5, 0.7, 0.9, 0.97)]
    assert ks == sorted(ks) and ks[0] >= 1 and ks[-1] > ks[0]
    assert best_k(0.9, 0.3, 32) < best_k(0.9, 0.02, 32)
    assert best_k(1.0, 0.01, 7) == 7  # capped by k_max


def test_best_k_for_costs_equals_leviathan_for_linear_costs():
    for alpha in (0.3, 0.6, 0.8, 0.95):
        for c in (0.01, 0.1, 0.4):
            assert best_k_for_costs(alpha, [1 + k * c for k in range(11)]) == best_k(alpha, c, 10)


def test_min_speedup_guards_against_marginal_gains():
    assert best_k(0.5, 0.3, 10, min_speedup=1.0) >= 1
    assert best_k(0.5, 0.3, 10, min_speedup=1.2) == 0


def test_step_cost_recovers_a_linear_machine():
    cost = StepCost()
    a, b, s = 0.05, 0.004, 0.002
    for batch, q in ((1, 2), (1, 8), (4, 1), (4, 4), (16, 1)):
        cost.observe(batch * q, batch, a + b * batch * q + s * batch, calibration=True)
    got = cost.coefficients()
    assert got == pytest.approx((a, b, s), rel=0.05, abs=1e-4)
    cost.observe(1, 1, 0.03, calibration=True)  # a matrix-vector step: tracked on its own
    assert cost.predict(1, 1) == 0.03
    assert cost.predict(32, 8) == pytest.approx(a + 32 * b + 8 * s, rel=0.05)


def test_step_cost_follows_the_machine_when_it_slows_down():
    cost = StepCost()
    for batch, q in ((1, 2), (1, 8), (4, 1), (4, 4)):
        cost.observe(batch * q, batch, 0.01 * batch * q, calibration=True)
    for _ in range(200):
        for n in (8, 16, 32):
            cost.observe(n, 8, 0.02 * n)
    assert cost.predict(16, 8) == pytest.approx(0.32, rel=0.1)


def test_acceptance_estimate_tracks_each_sequence_and_seeds_new_ones():
    acc = Acceptance(decay=0.7)
    for _ in range(20):
        acc.update(1, num_drafts=5, num_accepted=5)
        acc.update(2, num_drafts=5, num_accepted=0)
    assert acc.alpha(1) > 0.95 and acc.alpha(2) < 0.05
    # A new sequence starts from the run-wide estimate: 100 accepted of 120 drafts tested.
    assert acc.alpha(3) == acc.global_alpha == pytest.approx(100 / 121, abs=0.05)
    acc.forget(1)
    assert acc.alpha(1) == acc.global_alpha


def test_realized_cost_ignores_a_machine_that_slows_everything_alike():
    realized = RealizedCost()
    for i in range(40):
        busy = 1.0 if i < 20 else 2.5  # another process arrives halfway
        realized.observe(False, 0.1 * busy, 0.1)
        realized.observe(True, 0.3 * busy, 0.3)
    assert realized.factor() == pytest.approx(1.0)


def test_realized_cost_sees_speculative_steps_the_model_underprices():
    realized = RealizedCost()
    assert realized.factor() == 1.0  # nothing measured: trust the model
    for _ in range(20):
        realized.observe(False, 0.1, 0.1)
        realized.observe(True, 0.45, 0.3)
    assert realized.factor() == pytest.approx(1.5)


def test_one_slow_step_does_not_move_the_realized_cost():
    realized = RealizedCost()
    for _ in range(16):
        realized.observe(False, 0.1, 0.1)
        realized.observe(True, 0.3, 0.3)
    realized.observe(True, 3.0, 0.3)  # a ten-times slower step (the machine stalled once)
    realized.observe(False, 0.01, 0.1)
    assert realized.factor() == pytest.approx(1.0)


def test_calibrated_ratio_survives_an_online_fit_that_lost_the_cost_per_token():
    cost = StepCost()
    for batch, q in ((1, 2), (1, 8), (4, 1), (4, 4), (16, 1)):
        cost.observe(batch * q, batch, 0.01 + 0.001 * batch * q, calibration=True)
    for _ in range(300):  # a busy machine: every step ~0.2 s whatever its size
        for n in (32, 64, 160):
            cost.observe(n, 32, 0.2)
    assert cost.predict(160, 32) / cost.predict(32, 32) == pytest.approx(1.0, abs=0.05)
    assert cost.calibrated_ratio(160, 32) == pytest.approx((0.01 + 0.16) / (0.01 + 0.032), rel=0.05)
