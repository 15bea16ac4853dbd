"""Token sampling, defined exactly so a GPU backend can reproduce the same draws.

For generation step n (0-based) of a request with seed s:
1. temperature <= 0: the argmax of the logits (lowest index on ties). Done.
2. z = logits / temperature (float32). Candidates are all tokens sorted by z descending, ties
   by lower index; with top_k > 0 only the first top_k stay.
3. p = exp(z - z_max) over the candidates, summed in sorted order (float32).
4. With top_p < 1 only the shortest sorted prefix whose mass reaches top_p * sum(p) stays.
5. u = philox_uniform(s, n) in [0, 1); the token is the first candidate whose running sum of p
   exceeds u * (mass of the kept candidates).
philox_uniform is Philox4x32-10 keyed by the 64-bit seed with counter (n, 0, 0, 0); the first
32-bit word's top 24 bits make u = w >> 8 / 2^24, exact in float32.
"""
from __future__ import annotations

import numpy as np

from .interfaces import Sampler, SamplingParams

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def philox4x32(counter: tuple[int, int, int, int], key: tuple[int, int], rounds: int = 10) -> tuple[int, int, int, int]:
    c0, c1, c2, c3 = (c & _MASK for c in counter)
    k0, k1 = key[0] & _MASK, key[1] & _MASK
    for _ in range(rounds):
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _MASK, p1 & _MASK, ((p0 >> 32) ^ c3 ^ k1) & _MASK, p0 & _MASK
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c0, c1, c2, c3


def philox_uniform(seed: int, step: int) -> float:
    seed &= (1 << 64) - 1
    w = philox4x32((step, 0, 0, 0), (seed & _MASK, seed >> 32))[0]
    return (w >> 8) * (1.0 / (1 << 24))


def sample_token(logits: np.ndarray, params: SamplingParams, step: int) -> int:
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    if params.temperature <= 0:
        return int(np.argmax(logits))
    z = logits / np.float32(params.temperature)
    order = np.lexsort((np.arange(z.size), -z))  # z descending, then index ascending
    if params.top_k and params.top_k > 0:
        order = order[: params.top_k]
    zs = z[order]
    p = np.exp(zs - zs[0], dtype=np.float32)
    csum = np.cumsum(p, dtype=np.float32)
    if params.top_p < 1.0:
        keep = int(np.searchsorted(csum, np.float32(params.top_p) * csum[-1], side="left")) + 1
        csum = csum[:min(keep, csum.size)]
    u = np.float32(philox_uniform(params.seed, step))
    i = int(np.searchsorted(csum, u * csum[-1], side="right"))
    return int(order[min(i, csum.size - 1)])


class DefaultSampler(Sampler):
    def sample(self, logits: np.ndarray, params: SamplingParams, step: int) -> int:
        return sample_token(logits, params, step)
