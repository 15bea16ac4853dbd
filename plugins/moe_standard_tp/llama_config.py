"""The Llama-family hyper-parameters, read from a Hugging Face config.json dict."""
from __future__ import annotations

from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict


class LlamaConfig(BaseModel):
    """Llama, Qwen2/Qwen3 dense and SmolLM2 share this shape; differences are flags."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: Literal["llama", "qwen2", "qwen3", "mistral"] = "llama"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False        # llama: q/k/v/o biases (rare)
    sliding_window: Optional[int] = None
    use_sliding_window: bool = False

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def window(self) -> Optional[int]:
        return self.sliding_window if (self.use_sliding_window or self.model_type == "mistral") and self.sliding_window else None

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "LlamaConfig":
        return cls(**dict(cfg))
