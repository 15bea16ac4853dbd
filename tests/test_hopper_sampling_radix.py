"""The radix selects of kernels/sample.cuh (block 0) and kernels/sample_grid.cuh (every block), emulated step for step in numpy: 8-bit bins of the
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


def pass_bins(keys, cand, p, prefix):
    """A pass's candidates (those under the prefix so far), their 8-bit bins, and the bins' counts."""
    shift = 56 - 8 * p
    m = cand if p == 0 else cand & ((keys >> np.uint64(shift + 8)) == np.uint64(prefix))
    bins = ((keys[m] >> np.uint64(shift)) & np.uint64(255)).astype(np.int64)
    return m, bins, np.bincount(bins, minlength=256)


def scan_bins(order, val, cnt, acc, crosses):
    """Walk bins in candidate order (skipping empty ones), adding each bin's value to the running
    total acc, and stop at the first bin where crosses(total) holds; if none does, the last bin with
    candidates. Returns (chosen bin, the total before it)."""
    chosen, last, acc_last = None, None, acc
    for b in order:
        if not cnt[b]:
            continue
        nx = acc + val[b]
        last, acc_last = b, acc
        if crosses(nx):
            chosen = b
            break
        acc = nx
    if chosen is None:
        chosen, acc = last, acc_last
    return chosen, acc


def radix_select(keys, w, floor, kind, target):
    """sample.cuh radix_select (without its shared-memory list, which changes where candidates are
    read from, not which)."""
    cand = keys >= np.uint64(floor)
    prefix, above = 0, 0
    for p in range(8):
        m, bins, cnt = pass_bins(keys, cand, p, prefix)
        hist = [0] * 256
        for b, v in zip(bins, w[m]):
            hist[b] += int(v)
        crosses = (lambda x: x > target) if kind == 2 else (lambda x: x >= target)
        chosen, above = scan_bins(range(255, -1, -1), hist, cnt, above, crosses)
        prefix = (prefix << 8) | chosen
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


def grid_select(keys, w, floor, kind, frac=None, target=None):
    """sample_grid.cuh's select: the same passes, the target of a mass select from its first pass
    (frac times the float32 mass of the candidates), warp 0's choice by lanes of 8 bins (ballot of
    the lanes that reach the target among those with candidates), and an early end when the chosen
    bin holds one candidate (its key: the XOR of the bin's keys, as the kernel keeps it). Returns (key, passes)."""
    cand = keys >= np.uint64(floor)
    prefix, above = 0, 0
    for p in range(8):
        m, bins, cnt = pass_bins(keys, cand, p, prefix)
        val = [0] * 256
        kx = [0] * 256
        for b, v, k in zip(bins, w[m], keys[m]):
            val[b] += 1 if kind == 0 else int(v)
            kx[b] ^= int(k)
        if p == 0 and kind != 0:
            target = to_fixed(np.float32(frac) * mass_f32(sum(val)))
        lanes = [list(range(255 - 8 * ln, 247 - 8 * ln, -1)) for ln in range(32)]
        ls = [sum(val[b] for b in lane) for lane in lanes]
        anyc = [any(cnt[b] for b in lane) for lane in lanes]
        reach = [above + sum(ls[:ln + 1]) for ln in range(32)]
        crosses = (lambda x: x > target) if kind == 2 else (lambda x: x >= target)
        hit = [ln for ln in range(32) if anyc[ln] and crosses(reach[ln])]
        nz = [ln for ln in range(32) if anyc[ln]]
        L = hit[0] if hit else nz[-1]
        # lane L's bins; without a hit, its last bin with candidates (none at all: its first, as the kernel)
        chosen, above = scan_bins(lanes[L], val, cnt, reach[L] - ls[L], crosses if hit else (lambda x: False))
        if chosen is None:
            chosen, above = lanes[L][0], reach[L] - ls[L]
        prefix = (prefix << 8) | chosen
        if cnt[chosen] == 1 or p == 7:
            return kx[chosen], p + 1
    raise AssertionError("unreachable")


def sample_grid(logits, params: SamplingParams, step: int, passes: list | None = None) -> int:
    z = np.asarray(logits, np.float32) / np.float32(params.temperature)
    w, keys, V = fixed(np.exp(z - z.max(), dtype=np.float32)), keys_of(z), z.size
    floor = 0
    for kind in range(3):
        if (kind == 0 and not 0 < params.top_k < V) or (kind == 1 and not params.top_p < 1.0):
            continue
        frac = params.top_p if kind == 1 else np.float32(philox_uniform(params.seed, step))
        floor, n = grid_select(keys, w, floor, kind, frac=frac, target=params.top_k)
        if passes is not None:
            passes.append(n)
    return 0xFFFFFFFF - (floor & 0xFFFFFFFF)


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


def test_grid_select_picks_what_a_full_sort_picks_and_ends_early():
    passes = []
    for logits, params, step in _cases(300, 3):
        assert sample_grid(logits, params, step, passes) == sample_sorted(logits, params, step), (params, step)
    assert np.mean(passes) < 4.5 and max(passes) == 8  # ties at the top need all 8 passes (the index bytes)


def test_grid_select_can_fail():
    """A choice among all lanes (not only those with candidates) picks an empty bin when the target
    is already reached before it: the emulation checks the ballot's condition."""
    keys = keys_of(np.array([3.0, 2.0, 1.0], np.float32))
    w = fixed(np.array([1.0, 1.0, 1.0], np.float32))
    key, _ = grid_select(keys, w, 0, 1, frac=np.float32(0.0))  # target 0: the first candidate
    assert 0xFFFFFFFF - (key & 0xFFFFFFFF) == 0
    key, _ = grid_select(keys, w, 0, 2, frac=np.float32(0.5))  # 1.5 of 3: the second
    assert 0xFFFFFFFF - (key & 0xFFFFFFFF) == 1


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
