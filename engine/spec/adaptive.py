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


class LinearCost:
    """Online least squares of ``seconds ~ a + b * n`` with exponential forgetting.

    ``prior`` points (e.g. a start-up calibration) anchor the fit until enough steps were seen.
    """

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.w = self.sn = self.snn = self.st = self.snt = 0.0

    def observe(self, n: float, seconds: float, weight: float = 1.0) -> None:
        d = self.decay
        self.w = self.w * d + weight
        self.sn = self.sn * d + weight * n
        self.snn = self.snn * d + weight * n * n
        self.st = self.st * d + weight * seconds
        self.snt = self.snt * d + weight * n * seconds

    @property
    def ready(self) -> bool:
        return self.w > 0

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``, both kept non-negative; a single distinct ``n`` gives ``b = 0``."""
        if self.w <= 0:
            return 0.0, 0.0
        mean_n, mean_t = self.sn / self.w, self.st / self.w
        var = self.snn / self.w - mean_n * mean_n
        b = (self.snt / self.w - mean_n * mean_t) / var if var > 1e-9 * max(1.0, mean_n * mean_n) else 0.0
        b = max(b, 0.0)
        a = mean_t - b * mean_n
        if a < 0:  # a line through the origin instead
            a, b = 0.0, self.snt / self.snn if self.snn > 0 else 0.0
        return a, b

    def predict(self, n: float) -> float:
        a, b = self.coefficients()
        return a + b * n


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
