"""RoPE of the published model: interleaved pairs (2j, 2j+1) rotated as complex numbers
(torch.view_as_complex on [..., hd/2, 2]) by pos * theta^(-2j/hd)."""
from __future__ import annotations

import numpy as np


def rope_interleaved(t: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate t [n, ..., hd] at positions [n]: (a, b) at (2j, 2j+1) -> (a cos - b sin, b cos + a sin)."""
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]          # [n, hd/2]
    shape = (len(positions),) + (1,) * (t.ndim - 2) + (inv_freq.size,)
    cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    a, b = t[..., 0::2], t[..., 1::2]
    out = np.empty_like(t)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out
