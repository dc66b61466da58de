"""From logits to tokens: penalties, temperature, top-k/top-p/min-p, seeded sampling, logprobs.

``target_probs`` gives the exact distribution a request samples from at one position. A sampled
token is ``argmax p / E`` over that distribution with noise ``E`` keyed by (seed, sample index,
absolute position) (``specbatch_kernels.counter_rng``), so it depends on the distribution and those
coordinates only: a seeded request draws the same tokens alone, inside any batch, with any
speculation, on any worker and on retry. Verification samples the target's rows the same way
and accepts a draft iff it equals the sampled token; a draft model drafts with the same noise.
Unseeded requests get a fresh seed from the OS (``fresh_seed``), never a process-wide stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import secrets

import torch

import specbatch_kernels
from engine.sequence import Sequence
from specbatch_kernels.counter_rng import SAMPLE, keys_tensor, row_key, sample_seed


@dataclass(slots=True)
class SampleRow:
    """One position to sample: ``seq`` followed by ``extra`` (drafts already placed before it)."""

    seq: Sequence
    extra: list[int]

    @property
    def position(self) -> int:
        """Absolute position (in prompt + output) of the token this row samples."""
        return self.seq.num_tokens + len(self.extra)


def fresh_seed() -> int:
    """A seed for an unseeded request, from the OS: workers never share a stream."""
    return secrets.randbits(63)


def seed_of(seq: Sequence) -> int:
    """The request's seed: the engine sets ``Request.seed`` at submission; one built elsewhere
    (tests) takes ``params.seed`` or a fresh one on first use."""
    request = seq.request
    if request.seed is None:
        request.seed = request.params.seed if request.params.seed is not None else fresh_seed()
    return request.seed


def noise_keys(rows: list[SampleRow], stream: int = SAMPLE) -> list[int]:
    """Each row's noise key: sample ``i`` of a request is keyed by its own seed
    (``sample_seed``), so it draws the same tokens as a one-sample request with that seed."""
    return [row_key(sample_seed(seed_of(row.seq), row.seq.index), 0, row.position, stream) for row in rows]


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Repetition (prompt + output), presence and frequency (output only) penalties, in place."""
    for r, row in enumerate(rows):
        params = row.seq.params
        if not params.needs_penalties:
            continue
        seq = row.seq
        device = logits.device
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids) | set(row.extra)), dtype=torch.long, device=device)
            vals = logits[r, seen]
            logits[r, seen] = torch.where(
                vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
            )
        if params.presence_penalty or params.frequency_penalty:
            out = seq.output_token_ids + row.extra
            if out:
                counts = torch.bincount(torch.tensor(out, device=device), minlength=logits.shape[1]).to(logits.dtype)
                logits[r] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Add each row's ``logit_bias`` in place, for the whole batch in three index operations.

    OpenAI's extremes are exact here: -100 bans a token (its logit becomes -inf) and +100
    makes the +100 tokens of a row its only candidates (every other logit -inf), so a file
    that relies on "-100 or 100 should result in a ban or exclusive selection" gets that.
    Ids past this model's vocabulary (a draft model with a smaller one) are skipped.
    """
    vocab = logits.shape[1]
    r_idx, t_idx, vals, forced_r, forced_t = [], [], [], [], []
    for r, row in enumerate(rows):
        bias = row.seq.params.logit_bias
        if not bias:
            continue
        for token, value in bias.items():
            if token >= vocab:
                continue
            r_idx.append(r)
            t_idx.append(token)
            vals.append(float("-inf") if value <= -100 else value)
            if value >= 100:
                forced_r.append(r)
                forced_t.append(token)
    if not r_idx:
        return
    device = logits.device
    if forced_r:  # keep only the forced tokens' logits in their rows
        fr = torch.tensor(forced_r, device=device)
        ft = torch.tensor(forced_t, device=device)
        keep = logits[fr, ft]
        logits[fr.unique()] = float("-inf")
        logits[fr, ft] = keep
    index = (torch.tensor(r_idx, device=device), torch.tensor(t_idx, device=device))
    logits.index_put_(index, torch.tensor(vals, device=device, dtype=logits.dtype), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: list[SampleRow], eos_ids: set[int]) -> None:
    """Forbid EOS and stop tokens until a sample has ``min_tokens`` output tokens."""
    for r, row in enumerate(rows):
        params = row.seq.params
        if params.min_tokens and row.seq.num_output_tokens + len(row.extra) < params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
            if banned:
                logits[r, sorted(banned)] = float("-inf")


def filter_and_normalise(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, then softmax: probabilities per row (fp32)."""
    temps = torch.tensor([max(row.seq.params.temperature, 1e-5) for row in rows], device=logits.device)
    logits = logits / temps[:, None]
    top_ks = [row.seq.params.top_k for row in rows]
    top_ps = [row.seq.params.top_p for row in rows]
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        k = torch.tensor([kk if kk > 0 else vocab for kk in top_ks], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= k[:, None]
        probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        p = torch.tensor(top_ps, device=logits.device, dtype=probs_sorted.dtype)
        # Keep the smallest prefix whose mass reaches p (the first token is always kept).
        mass_before = probs_sorted.cumsum(-1) - probs_sorted
        drop |= mass_before >= p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    min_ps = [row.seq.params.min_p for row in rows]
    if any(m > 0 for m in min_ps):
        m = torch.tensor(min_ps, device=logits.device, dtype=probs.dtype)
        threshold = m[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Sampler:
    def __init__(self, eos_ids: set[int], backend: str = "torch", vocab_size: int | None = None) -> None:
        self.eos_ids = eos_ids
        self.backend = backend  # kernels' backend for the sampling step (Triton on CUDA)
        self.vocab_size = vocab_size  # the grammar masks' width (the target's vocabulary)

    def processed_logits(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Logits after penalties, logit bias, min-token bans and the grammar's mask: what greedy
        takes the argmax of, and what every sampled distribution (plain, verification, drafts)
        starts from."""
        return self._processed(logits, rows)[0]

    def _processed(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[torch.Tensor, dict[int, int]]:
        """``processed_logits`` and ``{row: token}`` for rows a grammar forces to one token."""
        params = [row.seq.params for row in rows]
        biased = any(p.needs_penalties or p.min_tokens or p.logit_bias for p in params)
        constrained = any(row.seq.grammar is not None for row in rows)
        forced: dict[int, int] = {}
        if biased or constrained:
            raw = logits
            logits = logits.clone()
            if biased:
                apply_penalties(logits, rows)
                apply_logit_bias(logits, rows)
                apply_min_tokens(logits, rows, self.eos_ids)
            if constrained:
                forced = self._apply_grammar(logits, raw, rows, biased)
            if biased:
                self._end_cornered(logits, rows)
        return logits, forced

    def _end_cornered(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        """A row with no candidate left (every logit -inf: its bias and min-tokens bans cover
        the vocabulary) takes EOS, which ends its sample (``Sequence.cornered``). Without this
        the argmax of nothing was token 0, repeated to ``max_tokens``, and reported a success."""
        dead = torch.isneginf(logits).all(-1).nonzero().flatten().tolist()
        if not dead:
            return
        eos = min(self.eos_ids) if self.eos_ids else 0
        for r in dead:
            logits[r, eos] = 0.0
            rows[r].seq.cornered = True

    def _apply_grammar(self, logits: torch.Tensor, raw: torch.Tensor, rows: list[SampleRow],
                       biased: bool) -> dict[int, int]:
        """The grammar's mask, last: a row left with no candidate (a bias or min-tokens ban
        against everything the grammar admits) falls back to the grammar alone."""
        from engine.structured.mask import apply_grammar_mask

        words = -(-(self.vocab_size or raw.shape[1]) // 32)
        forced = apply_grammar_mask(logits, rows, words)
        if biased:
            dead = torch.isneginf(logits).all(-1).nonzero().flatten().tolist()
            if dead:
                fallback = raw[dead].clone()
                apply_grammar_mask(fallback, [rows[r] for r in dead], words)
                logits[dead] = fallback
        return forced

    def target_probs(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The exact sampling distribution of each row (rows of greedy requests are one-hot)."""
        processed = self.processed_logits(logits, rows)
        probs = filter_and_normalise(processed, rows)
        greedy = [r for r, row in enumerate(rows) if row.seq.params.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            one_hot = torch.zeros_like(probs[idx]).scatter_(-1, processed[idx].argmax(-1, keepdim=True), 1.0)
            probs[idx] = one_hot
        return probs

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
        """One token per row: greedy and grammar-forced rows the processed argmax, others the
        coupled draw."""
        processed, forced = self._processed(logits, rows)
        tokens = processed.argmax(-1).tolist()
        # A forced row is one-hot: its draw is decided, so its noise over the vocabulary is not
        # computed (the token is the one any noise would give).
        random_rows = [r for r, row in enumerate(rows) if not row.seq.params.greedy and r not in forced]
        if random_rows:
            sub = [rows[r] for r in random_rows]
            idx = torch.tensor(random_rows, device=logits.device)
            probs = filter_and_normalise(processed[idx], sub)
            drawn = self.draw(probs, noise_keys(sub))
            for r, token in zip(random_rows, drawn):
                tokens[r] = token
        return tokens

    def draw(self, probs: torch.Tensor, keys: list[int]) -> list[int]:
        """``argmax p / E`` per row with the counter-based noise of ``keys``."""
        return specbatch_kernels.coupled_sample(probs, keys_tensor(keys, probs.device), backend=self.backend).tolist()

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: list[int], num: list[int | None]) -> list[dict[int, float] | None]:
        """The model's log-probabilities of each sampled token and of its top ``num`` alternatives."""
        wanted = [r for r, n in enumerate(num) if n is not None]
        result: list[dict[int, float] | None] = [None] * len(tokens)
        if not wanted:
            return result
        lp = torch.log_softmax(logits[wanted], dim=-1)
        for j, r in enumerate(wanted):
            entry = {tokens[r]: float(lp[j, tokens[r]])}
            if num[r]:
                top = lp[j].topk(num[r])
                for value, token in zip(top.values.tolist(), top.indices.tolist()):
                    entry.setdefault(token, value)
            result[r] = entry
        return result
