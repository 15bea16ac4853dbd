"""Random checkpoints of a model's exact shapes, for benchmarks and tests.

Small models get independent normal draws (arch.random_weights). Billion-parameter presets
would spend minutes in the random generator, so above POOLED_ABOVE parameters every large
tensor is a different slice of one 16M-value random pool: every tensor still has its own
memory and random-looking values (decode speed does not depend on the values; zeros would be
wrong, see the device notes), and loading takes seconds."""
from __future__ import annotations

import numpy as np

POOLED_ABOVE = 64_000_000
POOL_SIZE = 1 << 24


def random_weights(arch, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    shapes = arch.expected_tensors()
    total = sum(int(np.prod(s)) for s in shapes.values())
    if total <= POOLED_ABOVE:
        return arch.random_weights(seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal(POOL_SIZE, dtype=np.float32)
    pools = {1.0: normal.astype(dtype), 0.02: (0.02 * normal).astype(dtype)}
    out = {}
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        if "norm" in name or n < 1 << 20:
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(dtype) if "norm" in name \
                else (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
            continue
        pool = pools[1.0 if "embed" in name else 0.02]
        out[name] = _tile(pool[int(rng.integers(0, POOL_SIZE // 2)):], n).reshape(shape)
    return out


def _tile(src: np.ndarray, n: int) -> np.ndarray:
    """n values: src repeated (a distinct window of the pool per tensor), copied as raw bits."""
    raw = src.view(np.uint8).reshape(src.size, -1)  # custom dtypes (bf16) copy slowly; bytes don't
    out = np.empty((n, raw.shape[1]), np.uint8)
    for i in range(0, n, src.size):
        m = min(src.size, n - i)
        out[i:i + m] = raw[:m]
    return out.view(src.dtype).reshape(n)
