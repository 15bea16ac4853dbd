"""A tiny end-to-end run of the kernel (for compute-sanitizer): logits + greedy + sampled."""
from __future__ import annotations

import numpy as np


def main():
    from kog_core.interfaces import SamplingParams, StopCriteria
    from kog_moe_standard_tp.llama import Llama
    from kog_nvidia_hopper.backend import HopperBackend
    from kog_nvidia_hopper.plugin import CAPABILITIES
    cfg = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, intermediate_size=256, vocab_size=300, max_position_embeddings=256)
    arch = Llama(cfg)
    prog = arch.lower(context_length=256, kv_dtype="bf16")
    hb = HopperBackend()
    hb.capabilities = CAPABILITIES
    hb.load(prog, arch.random_weights(0))
    lg = hb.logits([1, 2, 3, 4, 5])
    g = list(hb.generate([1, 2, 3], None, SamplingParams(), StopCriteria(max_tokens=70)))
    s = list(hb.generate([1, 2, 3], None, SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=5), StopCriteria(max_tokens=8)))
    print("selfcheck ok", lg.shape, bool(np.isfinite(lg).all()), len(g), len(s))


if __name__ == "__main__":
    main()
