"""Named Laneformer models. `laneformer-2b` has the published 2B shapes (2,320,069,632
parameters); values the release does not state for certain (delay, theta, eps) come from the
checkpoint's config.json when it is present and from here for --random-weights."""
from kog_core.interfaces import ModelPreset

LANEFORMER_2B = ModelPreset(
    name="laneformer-2b",
    architecture="laneformer",
    hf_repo="kogai/laneformer-2b-it",
    config=dict(model_type="laneformer_tp", architectures=["LaneformerTPForCausalLM"],
                hidden_size=3072, num_hidden_layers=15, num_attention_heads=32, num_key_value_heads=16,
                intermediate_size=12288, vocab_size=32000, max_position_embeddings=4096,
                rope_theta=10000.0, norm_eps=1e-5, num_lanes=8, broadcast_delay=2,
                use_comm=True, use_early_comm=True, lm_head_type="replicate", pre_norm_lane_agg=False,
                replicated_rmsn_scale=True, tie_word_embeddings=False,
                sliding_window=512, sliding_window_n_layers=10, unclamped_layers=[],
                bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16"),
    description="Laneformer 2B instruct: 8 lanes, DTP delay 2 (Hugging Face checkpoint kogai/laneformer-2b-it)",
)

PRESETS = (LANEFORMER_2B,)
