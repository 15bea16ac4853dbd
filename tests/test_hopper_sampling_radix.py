"""The radix select of kernels/sample.cuh (SAMPLE_RADIX), emulated step for step in numpy: 8-bit bins of the
64-bit candidate key (float order of z, then lower index), MSB first, fixed-point masses (p 2^40),
bins without candidates never chosen, the lowest candidate when a target is never reached, targets
as the float32 products of kog_core/sampling.py. Checked against a full sort on the same fixed
point (always equal) and against the CPU sampler itself (equal on these cases). The CUDA code is
checked on the GPU (tests/gpu/test_hopper_gpu.py)."""
from __future__ import annotations

import numpy as np

from kog_core.interfaces import SamplingParams
from kog_core.sampling import philox_uniform, sample_token

ONE = 2.0 ** 40  # sample.cuh fixed_mass


def fkey(z):
    u = z.view(np.uint32).astype(np.uint64)
    return np.where(u & 0x80000000, (~u) & 0xFFFFFFFF, u | 0x80000000).astype(np.uint64)


def keys_of(z):
    return (fkey(z) << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - np.arange(z.size, dtype=np.uint64))


def fixed(p):
    return np.floor(np.asarray(p, np.float64) * ONE).astype(np.uint64)


def to_fixed(f32):
    return int(np.floor(np.float64(np.float32(f32)) * ONE))


def mass_f32(m):
    return np.float32(m / ONE)


def radix_select(keys, w, floor, kind, target):
    """sample.cuh radix_select (without its shared-memory list, which changes where candidates are
    read from, not which)."""
    cand = keys >= np.uint64(floor)
    prefix, above = 0, 0
    for p in range(8):
        shift = 56 - 8 * p
        m = cand if p == 0 else cand & ((keys >> np.uint64(shift + 8)) == np.uint64(prefix))
        bins = ((keys[m] >> np.uint64(shift)) & np.uint64(255)).astype(np.int64)
        cnt = np.bincount(bins, minlength=256)
        hist = [0] * 256
        for b, v in zip(bins, w[m]):
            hist[b] += int(v)
        acc, chosen, lastnz, acc_last = above, None, None, None
        for b in range(255, -1, -1):
            if cnt[b] == 0:
                continue
            nx = acc + hist[b]
            lastnz, acc_last = b, acc
            if (nx > target) if kind == 2 else (nx >= target):
                chosen = b
                break
            acc = nx
        if chosen is None:
            chosen, acc = lastnz, acc_last
        prefix, above = (prefix << 8) | chosen, acc
    return prefix


def sample_radix(logits, params: SamplingParams, step: int) -> int:
    z = np.asarray(logits, np.float32) / np.float32(params.temperature)
    p = np.exp(z - z.max(), dtype=np.float32)
    w, keys, V = fixed(p), keys_of(z), z.size
    cmin = radix_select(keys, np.ones(V, np.uint64), 0, 0, params.top_k) if 0 < params.top_k < V else 0
    ckeep = cmin
    if params.top_p < 1.0:
        total = int(w[keys >= np.uint64(cmin)].astype(object).sum())
        ckeep = max(cmin, radix_select(keys, w, cmin, 1, to_fixed(np.float32(params.top_p) * mass_f32(total))))
    kept = int(w[keys >= np.uint64(ckeep)].astype(object).sum())
    u = np.float32(philox_uniform(params.seed, step))
    ce = radix_select(keys, w, ckeep, 2, to_fixed(u * mass_f32(kept)))
    return 0xFFFFFFFF - (ce & 0xFFFFFFFF)


def sample_sorted(logits, params: SamplingParams, step: int) -> int:
    """The same fixed-point definition by a full sort."""
    z = np.asarray(logits, np.float32) / np.float32(params.temperature)
    w = fixed(np.exp(z - z.max(), dtype=np.float32))
    order = np.lexsort((np.arange(z.size), -z))
    if 0 < params.top_k < z.size:
        order = order[:params.top_k]
    cs = np.cumsum(w[order].astype(object))
    if params.top_p < 1.0:
        t = to_fixed(np.float32(params.top_p) * mass_f32(int(cs[-1])))
        keep = next(i for i, c in enumerate(cs) if c >= t) + 1
        cs, order = cs[:keep], order[:keep]
    tu = to_fixed(np.float32(philox_uniform(params.seed, step)) * mass_f32(int(cs[-1])))
    return int(order[next((i for i, c in enumerate(cs) if c > tu), len(cs) - 1)])


def _cases(n, seed):
    rng = np.random.default_rng(seed)
    for trial in range(n):
        V = int(rng.integers(2, 700))
        logits = (rng.standard_normal(V) * rng.uniform(0.1, 30)).astype(np.float32)
        if trial % 5 == 0:
            logits[rng.integers(0, V, 5)] = logits.max()  # ties at the top
        if trial % 7 == 0:
            logits[:] = np.float32(1.5)  # all equal
        params = SamplingParams(temperature=float(rng.uniform(0.1, 2)), top_k=int(rng.choice([0, 1, 5, 40, V + 3])),
                                top_p=float(rng.choice([1.0, 0.9, 0.5, 0.05])), seed=int(rng.integers(0, 2 ** 63)))
        yield logits, params, int(rng.integers(0, 100))


def test_radix_select_picks_what_a_full_sort_picks():
    for logits, params, step in _cases(300, 1):
        assert sample_radix(logits, params, step) == sample_sorted(logits, params, step), (params, step)


def test_radix_sampling_follows_the_cpu_sampler():
    got = [(sample_radix(lg, pr, st), sample_token(lg, pr, st)) for lg, pr, st in _cases(300, 2)]
    assert sum(a == b for a, b in got) >= len(got) - 1  # a float32 rounding boundary at most once


def test_radix_select_can_fail():
    """The emulation is not vacuous: a wrong comparison (>= for the draw) picks differently."""
    keys = keys_of(np.array([3.0, 2.0, 1.0], np.float32))
    w = fixed(np.array([1.0, 1.0, 1.0], np.float32))
    draw = int(ONE)  # exactly the first candidate's mass: '>' moves on to the second
    assert 0xFFFFFFFF - (radix_select(keys, w, 0, 2, draw) & 0xFFFFFFFF) == 1
    assert 0xFFFFFFFF - (radix_select(keys, w, 0, 1, draw) & 0xFFFFFFFF) == 0
