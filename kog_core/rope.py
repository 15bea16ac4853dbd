"""RoPE inverse frequencies theta^(-2j/hd), with the rope_scaling kinds of Hugging Face configs
(Llama 3's frequency-dependent scaling, linear). Shared by the model plugins; float64, callers
round where their published model does (Llama: float32)."""
from __future__ import annotations

import math

import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv
