"""Adaptive k: how many tokens to propose per sequence, from measured acceptance and cost.

Leviathan et al. 2023 (arXiv 2211.17192, section 3.4): with per-token acceptance ``alpha`` and
``c`` = cost of one speculative token relative to a plain step, k drafts return on average
``(1 - alpha^(k+1)) / (1 - alpha)`` tokens for ``k*c + 1`` steps' worth of time, so the expected
speedup is ``(1 - alpha^(k+1)) / ((1 - alpha)(k*c + 1))``. (The form that treats ``c`` as a speed
ratio, multiplying instead of dividing, is wrong: it rewards slow drafts.)

Inside a continuous batch ``c`` is not only the proposer's cost: every draft token is also one
more token in the target's flat forward. On a CPU a step costs about ``a + b*N`` for ``N``
scheduled tokens, so at batch ``B`` one more draft token for every sequence costs
``B*b + t_draft(B)`` against a step of ``a + b*B``: ``c`` is small at batch 1 (memory-bound,
``a`` dominates) and near 1 for big batches (compute-bound), where the formula says k = 0.
"""

from __future__ import annotations

import statistics
from collections import deque

import numpy as np


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits on average with k drafts (accepted ones plus the bonus/correction)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float) -> float:
    return expected_tokens(alpha, k) / (k * c + 1.0)


def best_k(alpha: float, c: float, k_max: int, min_speedup: float = 1.0) -> int:
    """The k in ``0..k_max`` with the highest expected speedup; 0 unless it beats ``min_speedup``."""
    best, best_value = 0, 1.0
    for k in range(1, k_max + 1):
        value = expected_speedup(alpha, k, c)
        if value > best_value:
            best, best_value = k, value
    return best if best_value >= min_speedup else 0


def best_k_for_costs(alpha: float, step_ratios: list[float], min_speedup: float = 1.0) -> int:
    """Like ``best_k`` with measured costs: ``step_ratios[k]`` = (step with k drafts) / (plain step).

    ``step_ratios[k] == k*c + 1`` for a linear cost, where this is exactly Leviathan's formula.
    """
    best, best_value = 0, 1.0
    for k in range(1, len(step_ratios)):
        value = expected_tokens(alpha, k) / step_ratios[k]
        if value > best_value:
            best, best_value = k, value
    return best if best_value >= min_speedup else 0


class StepCost:
    """Seconds of a step as ``a + b*N + s*B`` (N scheduled tokens, B sequences), fit online.

    ``b`` is what a draft token costs in verification; ``s`` is a sequence's own cost per step
    (its attention reads its whole context whatever its query length, plus bookkeeping).
    Weighted least squares: calibration points keep a fixed weight, observed steps decay, so the
    fit follows the machine but stays determined when k and B stop varying. A one-token step
    (batch 1, no drafts) is a matrix-vector product on the CPU, markedly cheaper than the line
    predicts, so it is tracked on its own.
    """

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        # Weighted sums [X^T W X | X^T W y | y^T W y] over x = (1, N, B): calibration, online.
        self.fixed = np.zeros((3, 5))
        self.online = np.zeros((3, 5))
        self.single: float | None = None  # EMA of one-token steps
        self.single_calibrated: float | None = None
        self._coefficients: tuple[float, float, float] | None = None  # cached until the next observation
        self._calibrated: tuple[float, float, float] | None = None

    @staticmethod
    def _outer(n: float, b: float, seconds: float) -> np.ndarray:
        x = np.array([1.0, n, b])
        return np.concatenate([np.outer(x, x), (x * seconds)[:, None], np.full((3, 1), seconds * seconds)], axis=1)

    def observe(self, n: int, batch: int, seconds: float, calibration: bool = False) -> None:
        self._coefficients = None
        if n == 1:
            self.single = seconds if self.single is None or calibration else 0.8 * self.single + 0.2 * seconds
            if calibration:
                self.single_calibrated = seconds
            return
        if calibration:
            self._calibrated = None
            self.fixed += self._outer(n, batch, seconds)
        else:
            self.online = self.online * self.decay + self._outer(n, batch, seconds)

    @property
    def ready(self) -> bool:
        return bool((self.fixed[0, 0] + self.online[0, 0]) > 0)

    def coefficients(self) -> tuple[float, float, float]:
        """``(a, b, s)``: non-negative least squares, solved exactly over the 7 active sets."""
        if self._coefficients is None:
            self._coefficients = self._solve()
        return self._coefficients

    def _solve(self, m: np.ndarray | None = None) -> tuple[float, float, float]:
        m = self.fixed + self.online if m is None else m
        if m[0, 0] <= 0:
            return 0.0, 0.0, 0.0
        xtx, xty, yty = m[:, :3], m[:, 3], m[0, 4]
        best, best_residual = np.zeros(3), yty
        for mask in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)):
            idx = list(mask)
            sub = xtx[np.ix_(idx, idx)]
            if abs(np.linalg.det(sub)) < 1e-12 * max(1.0, float(np.abs(sub).max())) ** len(idx):
                continue
            theta = np.zeros(3)
            theta[idx] = np.linalg.solve(sub, xty[idx])
            if (theta < 0).any():
                continue
            residual = yty - 2 * theta @ xty + theta @ xtx @ theta
            if residual < best_residual - 1e-15:
                best, best_residual = theta, residual
        return float(best[0]), float(best[1]), float(best[2])

    def predict(self, n: int, batch: int) -> float:
        if n == 1 and self.single is not None:
            return self.single
        a, b, s = self.coefficients()
        return a + b * n + s * batch

    def calibrated_ratio(self, n: int, batch: int) -> float | None:
        """Cost of ``n`` tokens over ``batch`` tokens by the start-up calibration alone: timings
        taken back to back (best of repeats), so a ratio of them survives a busy machine that
        the online fit may not (seen: another process made it fit a zero cost per token)."""
        if self.fixed[0, 0] <= 0:
            return None
        if self._calibrated is None:
            self._calibrated = self._solve(self.fixed)
        a, b, s = self._calibrated

        def cost(tokens: int) -> float:
            if tokens == 1 and self.single_calibrated is not None:
                return self.single_calibrated
            return a + b * tokens + s * batch

        base = cost(batch)
        return cost(n) / base if base > 0 else None


class RealizedCost:
    """How far the cost model is off for speculative steps *relative to* plain ones, right now.

    Each decode step reports ``observed / predicted`` seconds (its "slowness"), speculative and
    plain steps apart; ``factor`` is the ratio of the two medians over the last ``window`` of
    each. A busy machine slows both kinds alike and leaves the factor near 1, whatever the
    absolute timings; a speculative step that costs more than the model said (measured: extra
    tokens slow down far more than fixed overheads when another process takes a core) raises
    it, and the speculator multiplies its step ratios by it. Medians over a window mean no
    single slow step moves it; until both kinds have ``min_samples`` it is 1 (trust the model).
    """

    def __init__(self, window: int = 16, min_samples: int = 5, bounds: tuple[float, float] = (0.5, 4.0)) -> None:
        self.plain: deque[float] = deque(maxlen=window)
        self.spec: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples
        self.bounds = bounds

    def observe(self, speculative: bool, observed: float, predicted: float) -> None:
        if predicted > 0 and observed > 0:
            (self.spec if speculative else self.plain).append(observed / predicted)

    def factor(self) -> float:
        if len(self.plain) < self.min_samples or len(self.spec) < self.min_samples:
            return 1.0
        ratio = statistics.median(self.spec) / statistics.median(self.plain)
        return min(max(ratio, self.bounds[0]), self.bounds[1])


class Acceptance:
    """Per-sequence acceptance estimate: decayed counts of accepted / verified drafts.

    A new sequence starts from the run-wide estimate (weight ``prior_weight``), so a job whose
    drafts are good ramps up at once and a bad one does not waste its first steps.
    """

    def __init__(self, decay: float = 0.7, prior_weight: float = 2.0) -> None:
        self.decay = decay
        self.prior_weight = prior_weight
        self.per_seq: dict[int, tuple[float, float]] = {}
        self.global_acc, self.global_total = 0.7, 1.0

    def alpha(self, seq_id: int) -> float:
        state = self.per_seq.get(seq_id)
        if state is None:
            return self.global_alpha
        acc, total = state
        return acc / total if total > 0 else self.global_alpha

    @property
    def global_alpha(self) -> float:
        return self.global_acc / self.global_total

    def update(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """Record one verification: ``num_accepted`` of ``num_drafts`` drafts passed.

        Trials are the draft tokens actually tested: the accepted ones plus the first rejected
        one (later drafts were never tested).
        """
        if num_drafts <= 0:
            return
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        state = self.per_seq.get(seq_id)
        if state is None:
            g = self.global_alpha
            state = (g * self.prior_weight, self.prior_weight)
        acc, total = state
        d = self.decay ** trials
        self.per_seq[seq_id] = (acc * d + num_accepted, total * d + trials)
        gd = 0.98 ** trials
        self.global_acc = self.global_acc * gd + num_accepted
        self.global_total = self.global_total * gd + trials

    def forget(self, seq_id: int) -> None:
        self.per_seq.pop(seq_id, None)
