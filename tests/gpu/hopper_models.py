"""Small random checkpoints and helpers shared by the nvidia_hopper GPU tests."""
from __future__ import annotations

import numpy as np

from kog_moe_standard_tp.llama import Llama

def _llama_head_dim(head_dim: int, heads: int, kv_heads: int, vocab: int) -> dict:
    """A two-layer Llama whose attention has this head size (hidden = heads x head_dim)."""
    return dict(model_type="llama", hidden_size=heads * head_dim, num_hidden_layers=2, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=512, vocab_size=vocab,
                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)


SMALL = {
    # GQA 4/2, untied head, head_dim 64: exercises fused q/k/v, rope+append+attention, gate/up+swiglu
    "llama": dict(model_type="llama", hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1000,
                  rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                  tie_word_embeddings=False),
    # tied embeddings, q/k/v bias
    "qwen2": dict(model_type="qwen2", hidden_size=192, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=32, intermediate_size=384, vocab_size=777,
                  rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=True),
    # per-head q/k norm (grouped rmsnorm), 8 query heads per kv head
    "qwen3": dict(model_type="qwen3", hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=1, head_dim=64, intermediate_size=512, vocab_size=1500,
                  rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=False),
    # head_dim 96 (laneformer-2b's): 3 columns a lane in the attention's rows by warp, which a vector
    # load would take misaligned (CUDA_ERROR_MISALIGNED_ADDRESS on laneformer-2b, session 13)
    "llama-hd96": _llama_head_dim(96, heads=4, kv_heads=2, vocab=800),
    # head_dim 256 with two query heads a group: 8 columns a lane, one 16-byte load (the most the
    # rows-by-warp path holds in registers); head_dim 80: not a multiple of 32, the block steps
    "llama-hd256": _llama_head_dim(256, heads=2, kv_heads=1, vocab=600),
    "llama-hd80": _llama_head_dim(80, heads=4, kv_heads=2, vocab=600),
    # sliding window of 48 positions
    "mistral": dict(model_type="mistral", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, head_dim=64, intermediate_size=512, vocab_size=900,
                    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                    sliding_window=48, tie_word_embeddings=False),
}


def bf16_round(w: dict) -> dict:
    import ml_dtypes
    return {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in w.items()}


def model(name: str, seed: int = 0, context: int = 512, **overrides):
    """A small random checkpoint; `overrides` change its config (e.g. a larger vocabulary)."""
    arch = Llama(dict(SMALL[name], **overrides))
    prog = arch.lower(context_length=context, kv_dtype="bf16")
    weights = bf16_round(arch.random_weights(seed))
    return arch, prog, weights


LANEFORMER_SMALL = {
    # 4 lanes, delayed-residual DTP, sliding-window layers, replicated and per-lane LM heads
    "laneformer-replicate": dict(model_type="laneformer_tp", hidden_size=256, num_hidden_layers=3,
                                 num_attention_heads=8, num_key_value_heads=4, intermediate_size=512,
                                 vocab_size=700, max_position_embeddings=512, num_lanes=4, broadcast_delay=2,
                                 lm_head_type="replicate", replicated_rmsn_scale=False, sliding_window=40, pre_norm_lane_agg=True,
                                 sliding_window_n_layers=2, eos_token_id=2),
    "laneformer-lane": dict(model_type="laneformer_tp", hidden_size=256, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, intermediate_size=512,
                            vocab_size=700, max_position_embeddings=512, num_lanes=4, broadcast_delay=1,
                            lm_head_type="lane", eos_token_id=2),
    # 4 layers of which 3 delayed: fused DTP residuals back to back, so KOG_HOPPER_TAG_X_LANES has
    # readers that poll (the two above have one fused write each, after an elementwise one)
    "laneformer-deep": dict(model_type="laneformer_tp", hidden_size=256, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, intermediate_size=512,
                            vocab_size=700, max_position_embeddings=512, num_lanes=4, broadcast_delay=1,
                            lm_head_type="lane", eos_token_id=2),
}


def laneformer_model(name: str, seed: int = 0, context: int = 512):
    from kog_core.interfaces import resolve_factory
    from kog_core.plugins import load_registry
    spec = load_registry().architectures["laneformer"]
    arch = resolve_factory(spec.factory)(LANEFORMER_SMALL[name])
    prog = arch.lower(context_length=context, kv_dtype="bf16")
    return arch, prog, bf16_round(arch.random_weights(seed))
