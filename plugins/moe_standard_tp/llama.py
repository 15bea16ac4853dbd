"""The Llama family (Llama 2/3, SmolLM2, Qwen2, Qwen3 dense): checkpoint layout, decode-program
lowering, and a plain numpy forward written straight from the math (for tests)."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from kog_core.interfaces import ModelArchitecture
from kog_core.program import DecodeProgram, new_program

from .llama_config import LlamaConfig
from kog_core.rope import inverse_frequencies


class Llama(ModelArchitecture):
    name = "llama"

    def __init__(self, hf_config: Mapping):
        super().__init__(hf_config)
        self.cfg = LlamaConfig.from_hf(hf_config)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def context_length(self) -> int:
        return self.cfg.max_position_embeddings

    # ------------------------------------------------------------------ checkpoint layout
    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        D, hd, F = c.hidden_size, c.hd, c.intermediate_size
        q, kv = c.num_attention_heads * hd, c.n_kv_heads * hd
        t = {"model.embed_tokens.weight": (c.vocab_size, D), "model.norm.weight": (D,)}
        if not c.tie_word_embeddings:
            t["lm_head.weight"] = (c.vocab_size, D)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            t |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                  p + "self_attn.q_proj.weight": (q, D), p + "self_attn.k_proj.weight": (kv, D),
                  p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, q),
                  p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                  p + "mlp.down_proj.weight": (D, F)}
            if c.qkv_bias:
                t |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                      p + "self_attn.v_proj.bias": (kv,)}
            if c.qk_norm:
                t |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        return t

    def random_weights(self, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
        w = super().random_weights(seed, dtype)
        rng = np.random.default_rng(seed + 1)
        for name in w:  # embeddings of unit scale, like a trained model's, keep logits informative
            if name == "model.embed_tokens.weight":
                w[name] = rng.standard_normal(w[name].shape, dtype=np.float32).astype(dtype)
        return w

    # ------------------------------------------------------------------ decode program
    def lower(self, context_length: int | None = None, kv_dtype: str = "f32", weight_dtype: str = "bf16") -> DecodeProgram:
        c = self.cfg
        T = min(context_length or c.max_position_embeddings, c.max_position_embeddings)
        D, hd, F, V = c.hidden_size, c.hd, c.intermediate_size, c.vocab_size
        Hq, Hkv = c.num_attention_heads, c.n_kv_heads
        p = new_program("llama", 1, V, T, c.num_hidden_layers, model_type=c.model_type)

        def weight(name):
            return p.add_tensor(name, self.expected_tensors()[name], weight_dtype, "weight")

        def buf(name, *shape):
            return p.add_tensor(name, (1, *shape), "f32", "buffer")

        inv_freq = p.add_tensor("rope.inv_freq", (hd // 2,), "f32", "const")
        p.metadata["consts"] = {"rope.inv_freq": inverse_frequencies(hd, c.rope_theta, c.rope_scaling).astype(np.float32).tolist()}
        x, h = buf("x", D), buf("h", D)
        q, k, v, att = buf("q", Hq * hd), buf("k", Hkv * hd), buf("v", Hkv * hd), buf("att", Hq * hd)
        g, u, a = buf("gate", F), buf("up", F), buf("act", F)
        p.add_op("embed", [weight("model.embed_tokens.weight"), "token"], [x])
        for i in range(c.num_hidden_layers):
            w = f"model.layers.{i}."
            ck = p.add_tensor(f"kv.{i}.k", (1, Hkv, T, hd), kv_dtype, "kv")
            cv = p.add_tensor(f"kv.{i}.v", (1, Hkv, T, hd), kv_dtype, "kv")
            p.add_op("rmsnorm", [x, weight(w + "input_layernorm.weight")], [h], i, eps=c.rms_norm_eps)
            for out, proj in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
                ins = [h, weight(w + f"self_attn.{proj}.weight")]
                if c.qkv_bias:
                    ins.append(weight(w + f"self_attn.{proj}.bias"))
                p.add_op("matvec", ins, [out], i, has_bias=c.qkv_bias)
            if c.qk_norm:
                p.add_op("rmsnorm", [q, weight(w + "self_attn.q_norm.weight")], [q], i, eps=c.rms_norm_eps, group=hd)
                p.add_op("rmsnorm", [k, weight(w + "self_attn.k_norm.weight")], [k], i, eps=c.rms_norm_eps, group=hd)
            p.add_op("rope", [q, inv_freq], [q], i, n_heads=Hq, head_dim=hd, style="half")
            p.add_op("rope", [k, inv_freq], [k], i, n_heads=Hkv, head_dim=hd, style="half")
            p.add_op("kv_append", [k, v, ck, cv], [ck, cv], i)
            p.add_op("attention", [q, ck, cv], [att], i, n_heads=Hq, n_kv_heads=Hkv, head_dim=hd,
                     window=c.window, scale=hd ** -0.5)
            p.add_op("matvec", [att, weight(w + "self_attn.o_proj.weight"), x], [x], i, has_residual=True)
            p.add_op("rmsnorm", [x, weight(w + "post_attention_layernorm.weight")], [h], i, eps=c.rms_norm_eps)
            p.add_op("matvec", [h, weight(w + "mlp.gate_proj.weight")], [g], i)
            p.add_op("matvec", [h, weight(w + "mlp.up_proj.weight")], [u], i)
            p.add_op("swiglu", [g, u], [a], i)
            p.add_op("matvec", [a, weight(w + "mlp.down_proj.weight"), x], [x], i, has_residual=True)
        p.add_op("rmsnorm", [x, weight("model.norm.weight")], [h], eps=c.rms_norm_eps)
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else weight("lm_head.weight")
        logits = p.add_tensor("logits", (1, V), "f32", "output")
        p.add_op("matvec", [h, head], [logits])
        nxt = p.add_tensor("next_token", (), "i32", "output")
        p.add_op("sample", [logits], [nxt])
        p.validate()
        return p

    # ------------------------------------------------------------------ plain forward (tests)
    def forward(self, weights: Mapping[str, np.ndarray], token_ids: Sequence[int]) -> np.ndarray:
        """Whole-sequence causal forward in float64, straight from the Llama equations."""
        c = self.cfg
        W = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
        n, hd, Hq, Hkv = len(token_ids), c.hd, c.num_attention_heads, c.n_kv_heads

        def rms(x, w):
            return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps) * w

        inv = inverse_frequencies(hd, c.rope_theta, c.rope_scaling).astype(np.float32).astype(np.float64)
        ang = np.arange(n)[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

        def rope(t):  # t [n, heads, hd], rotate-half pairing
            a, b = t[..., : hd // 2], t[..., hd // 2:]
            return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

        pos = np.arange(n)
        mask = pos[None, :] <= pos[:, None]
        if c.window:
            mask &= pos[None, :] > pos[:, None] - c.window
        x = W["model.embed_tokens.weight"][list(token_ids)]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = rms(x, W[p + "input_layernorm.weight"])
            proj = {}
            for name in ("q", "k", "v"):
                y = h @ W[p + f"self_attn.{name}_proj.weight"].T
                if c.qkv_bias:
                    y = y + W[p + f"self_attn.{name}_proj.bias"]
                proj[name] = y.reshape(n, -1, hd)
            q, k, v = proj["q"], proj["k"], proj["v"]
            if c.qk_norm:
                q, k = rms(q, W[p + "self_attn.q_norm.weight"]), rms(k, W[p + "self_attn.k_norm.weight"])
            q, k = rope(q), rope(k)
            rep = Hq // Hkv
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            s = np.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
            s = np.where(mask[None], s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = np.einsum("hqk,khd->qhd", s, v).reshape(n, Hq * hd)
            x = x + o @ W[p + "self_attn.o_proj.weight"].T
            h = rms(x, W[p + "post_attention_layernorm.weight"])
            gate, up = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ W[p + "mlp.down_proj.weight"].T
        h = rms(x, W["model.norm.weight"])
        head = W["model.embed_tokens.weight"] if c.tie_word_embeddings else W["lm_head.weight"]
        return (h @ head.T).astype(np.float32)
