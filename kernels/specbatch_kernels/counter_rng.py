"""Counter-based noise: a pure function of (seed, sample index, position, stream, token).

Seeded sampling must not depend on batch layout, speculation, worker or retry, so no noise may
come from generator *state*. Each sampled row gets a 64-bit key derived from its coordinates
(``row_key``, exact Python integer arithmetic, the same on every machine), and the noise for
token ``v`` of that row is SplitMix64's ``v``-th output for that key:
``mix64(key + (v + 1) * GOLDEN)`` (Steele, Lea, Flood 2014; passes BigCrush). Vectorised over
rows and vocabulary with torch int64 ops (two's-complement wrap-around is the mod-2^64
arithmetic; logical right shifts are arithmetic shifts masked), and identically in the Triton
kernel with uint64.

``exponentials`` turns the top 53 bits into ``u`` in (0, 1) exactly and ``E = -log(u)`` in
float64, so a token is ``argmax_v p_v / E_v`` (the exponential race: exactly a draw from ``p``).
Integer bits are identical everywhere; float64 ``log`` may differ across libraries in the last
ulp (~1e-16 relative), which can only flip a race whose two best scores tie to 1e-16.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
# Streams: independent noise for the same coordinates.
SAMPLE = 0  # the token race (coupled sampling, drafting and verification)
ACCEPT = 1  # Leviathan/Chen acceptance uniforms (acceptance="rejection" only)
RESAMPLE = 2  # Leviathan/Chen residual and bonus draws (acceptance="rejection" only)


def mix64(z: int) -> int:
    """SplitMix64's finaliser on a Python int (mod 2^64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded ``seed``: ``seed`` itself for the first,
    a distinct 63-bit seed derived from both for the others. Samples are keyed by their own
    seed (``row_key(sample_seed(seed, i), 0, ...)``), so a one-sample request seeded
    ``sample_seed(seed, i)`` draws exactly sample ``i``'s tokens: each sample of ``n`` can be
    recorded, and rerun, on its own."""
    if index == 0:
        return seed
    return mix64(mix64(seed & MASK64) ^ mix64((index + 1) * GOLDEN)) >> 1


def row_key(seed: int, index: int, position: int, stream: int = SAMPLE) -> int:
    """The 64-bit key of one (seed, sample index, absolute position, stream), as a signed int64."""
    k = mix64(seed & MASK64)
    k = mix64(k + (index + 1) * GOLDEN)
    k = mix64(k + (position + 1) * GOLDEN)
    k = mix64(k + (stream + 1) * GOLDEN)
    return k - (1 << 64) if k >= 1 << 63 else k


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def random_bits(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """64 random bits (as int64) for each ``(keys[i], tokens[i])``; shapes broadcast."""
    z = keys + (tokens + 1) * _signed(GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(MIX1)
    z = (z ^ _shr(z, 27)) * _signed(MIX2)
    return z ^ _shr(z, 31)


def uniforms(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Float64 uniforms in (0, 1): the top 53 bits, centred in their cell (never 0 or 1)."""
    return (_shr(random_bits(keys, tokens), 11).double() + 0.5) * 2.0**-53


def exponentials(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Float64 Exp(1) noise ``-log(u)``."""
    return -torch.log(uniforms(keys, tokens))


def keys_tensor(keys: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(keys, dtype=torch.int64, device=device)
