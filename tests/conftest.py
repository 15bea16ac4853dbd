"""Shared fixtures: the demo model (SmolLM2-135M GGUF) when present, small random Llama configs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


def demo_model_path() -> Path | None:
    """The demo GGUF: $KOG_TEST_GGUF, or the kog model cache (`kog pull smollm2-135m`)."""
    env = os.environ.get("KOG_TEST_GGUF")
    if env and Path(env).is_file():
        return Path(env)
    from kog_core.hub import cache_dir
    for p in (cache_dir() / "models" / "smollm2-135m").glob("*.gguf"):
        return p
    return None


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    p = demo_model_path()
    if p is None:
        pytest.skip("demo model not found: run `kog pull smollm2-135m` (or set KOG_TEST_GGUF)")
    return p


@pytest.fixture(scope="session")
def demo_engine(demo_gguf):
    from kog_core import Engine
    return Engine.load(model=str(demo_gguf), backend="reference")


def small_llama_config(model_type="llama", **overrides) -> dict:
    cfg = dict(model_type=model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=96, vocab_size=101, max_position_embeddings=64,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    cfg.update(overrides)
    return cfg
