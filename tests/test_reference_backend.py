"""The reference backend's decode path against each architecture's plain forward."""
import numpy as np
import pytest

from kog_core.plugins import load_registry
from kog_moe_standard_tp.llama import Llama

from conftest import small_llama_config

CONFIGS = {
    "llama": small_llama_config(),
    "llama-tied-gqa1": small_llama_config(num_key_value_heads=1, tie_word_embeddings=True),
    "llama3-rope-scaling": small_llama_config(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                                high_freq_factor=4.0, original_max_position_embeddings=16)),
    "qwen2-bias": small_llama_config("qwen2", tie_word_embeddings=True),
    "qwen3-qk-norm": small_llama_config("qwen3", head_dim=24),
    "mistral-window": small_llama_config("mistral", sliding_window=5),
    "smollm2-like": small_llama_config(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                                       tie_word_embeddings=True, rope_theta=100000.0),
}


def relative_error(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_plain_forward(name):
    model = Llama(CONFIGS[name])
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    weights = model.random_weights(seed=int(rng.integers(1 << 30)))
    backend = load_registry().create_backend("reference")
    backend.load(model.lower(32), weights)
    ids = [int(t) for t in rng.integers(0, model.vocab_size, 24)]
    got, want = backend.logits(ids), model.forward(weights, ids)
    assert got.shape == want.shape == (24, model.vocab_size)
    assert relative_error(got, want) < 1e-4


def test_reset_starts_a_fresh_sequence():
    model = Llama(small_llama_config())
    weights = model.random_weights(3)
    backend = load_registry().create_backend("reference")
    backend.load(model.lower(32), weights)
    a = backend.logits([5, 6, 7])
    backend.logits([9, 9, 9, 9, 9])
    np.testing.assert_array_equal(a, backend.logits([5, 6, 7]))


def test_step_outside_the_context_fails():
    model = Llama(small_llama_config())
    backend = load_registry().create_backend("reference")
    backend.load(model.lower(16), model.random_weights(0))
    with pytest.raises(IndexError):
        backend.step(1, 16)
