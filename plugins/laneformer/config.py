"""Laneformer hyper-parameters, read from a `laneformer_tp` config.json dict.

Field names and defaults follow the published remote code's `LaneformerTPConfig`
(configuration_laneformer.py); `unclamped_layers` is read there with getattr(..., []).
Training-only fields (multiple_of, depth_init, use_flex_attn, attn_mask_type, use_cache)
are accepted and ignored."""
from __future__ import annotations

import math
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, model_validator



class LaneformerConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: Literal["laneformer_tp", "laneformer"] = "laneformer_tp"
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    intermediate_size: int = 4 * 4096
    vocab_size: int = 128256
    max_position_embeddings: int = 131072
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, list[int], None] = 0

    # lanes and the delayed lane reduction (DTP)
    num_lanes: int = 1
    broadcast_delay: int = 1
    use_comm: bool = True
    use_early_comm: bool = True

    # norms and head
    replicated_rmsn_scale: bool = True
    lm_head_type: Literal["replicate", "lane", "vocab_parallel"] = "replicate"
    pre_norm_lane_agg: bool = False

    # attention span
    sliding_window: Optional[int] = None
    sliding_window_n_layers: int = 0
    unclamped_layers: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> "LaneformerConfig":
        L, H, Hkv, D = self.num_lanes, self.num_attention_heads, self.n_kv_heads, self.hidden_size
        problems = []
        if L < 1:
            problems.append(f"num_lanes must be >= 1, got {L}")
        elif H % L or Hkv % L:
            problems.append(f"num_lanes {L} must divide num_attention_heads {H} and num_key_value_heads {Hkv}")
        if H % Hkv:
            problems.append(f"num_key_value_heads {Hkv} must divide num_attention_heads {H}")
        if D % H or (D // H) % 2:
            problems.append(f"hidden_size {D} / num_attention_heads {H} must be an even head dimension")
        if L >= 1 and self.intermediate_size % L:
            problems.append(f"num_lanes {L} must divide intermediate_size {self.intermediate_size}")
        if self.lm_head_type == "vocab_parallel" and L >= 1 and self.vocab_size % L:
            problems.append(f"lm_head_type vocab_parallel needs num_lanes {L} to divide vocab_size {self.vocab_size}")
        if self.pre_norm_lane_agg and self.lm_head_type != "replicate":
            problems.append("pre_norm_lane_agg is only supported with lm_head_type='replicate'")
        if self.tie_word_embeddings and self.lm_head_type != "replicate":
            problems.append("tie_word_embeddings needs lm_head_type='replicate' (the only head of shape [V, D])")
        if self.broadcast_delay < 0 or (self.use_comm and self.broadcast_delay < 1):
            problems.append(f"broadcast_delay must be >= 1 (>= 0 with use_comm false), got {self.broadcast_delay}")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window must be >= 1, got {self.sliding_window}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ---------------------------------------------------------------- derived shapes
    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def hd(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def heads_per_lane(self) -> int:
        return self.num_attention_heads // self.num_lanes

    @property
    def kv_heads_per_lane(self) -> int:
        return self.n_kv_heads // self.num_lanes

    @property
    def ffn_per_lane(self) -> int:
        return self.intermediate_size // self.num_lanes

    @property
    def lane_scale(self) -> float:
        """The factor of an un-reduced partial (ReduceMode.NO_REDUCE): sqrt(L)."""
        return math.sqrt(self.num_lanes)

    @property
    def per_lane_norms(self) -> bool:
        return not self.replicated_rmsn_scale

    @property
    def per_lane_final_norm(self) -> bool:
        return not (self.replicated_rmsn_scale or self.pre_norm_lane_agg)

    # ---------------------------------------------------------------- per-layer rules
    def window(self, layer: int) -> Optional[int]:
        """Sliding window of layer i, or None for plain causal attention."""
        if self.sliding_window is None or layer in self.unclamped_layers:
            return None
        n, N = self.sliding_window_n_layers, self.num_hidden_layers
        if layer < n or layer >= N + n:
            return self.sliding_window
        return None

    def reduce_mode(self, layer: int) -> str:
        """How layer i's partials enter the residual: "allreduce" (present), "local" (x sqrt(L))
        or "delayed" (own fresh partial + the other lanes' partials of layer i - d)."""
        if layer < self.broadcast_delay:
            return "allreduce" if self.use_early_comm else "local"
        return "delayed" if self.use_comm else "local"

    def must_send(self, layer: int) -> bool:
        """Whether layer i's partials must reach the other lanes at all."""
        d, N = self.broadcast_delay, self.num_hidden_layers
        now = self.reduce_mode(layer) == "allreduce"
        later = layer + d < N and self.reduce_mode(layer + d) == "delayed"
        return self.num_lanes > 1 and (now or later)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "LaneformerConfig":
        cfg = dict(cfg)
        if cfg.get("unclamped_layers") is None:
            cfg.pop("unclamped_layers", None)
        return cls(**cfg)
