"""Laneformer: a Llama-style decoder with one full-width residual stream per lane and a
delayed lane reduction (Delayed Tensor Parallelism, DTP).

Three views of the same model live here:
- `expected_tensors`: the checkpoint layout of the published `laneformer_tp` model;
- `lower`: one decode step as a decode program with lanes as first-class (lane-grouped
  matvecs, `collective` right after each partial that other lanes need, `lane_residual`);
- `forward`: a plain numpy float64 forward of a whole sequence, from the equations (tests)."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from kog_core.interfaces import ModelArchitecture
from kog_core.program import DecodeProgram, new_program
from kog_core.rope import inverse_frequencies

from .config import LaneformerConfig
from .rope import rope_interleaved


class Laneformer(ModelArchitecture):
    name = "laneformer"

    def __init__(self, hf_config: Mapping):
        super().__init__(hf_config)
        self.cfg = LaneformerConfig.from_hf(hf_config)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def context_length(self) -> int:
        return self.cfg.max_position_embeddings

    # ------------------------------------------------------------------ checkpoint layout
    def norm_name(self, prefix: str, per_lane: bool) -> str:
        return prefix + (".scale" if per_lane else ".weight")

    def head_name(self) -> str:
        c = self.cfg
        if c.lm_head_type == "lane":
            return "lm_head.linear.weight"
        if c.tie_word_embeddings:
            return "model.tok_embeddings.weight"
        return "lm_head.weight"

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        L, D, V, hd = c.num_lanes, c.hidden_size, c.vocab_size, c.hd
        q, kv, f = c.heads_per_lane * hd, c.kv_heads_per_lane * hd, c.ffn_per_lane
        norm = (L, D) if c.per_lane_norms else (D,)
        t = {"model.tok_embeddings.weight": (V, D)}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            t |= {self.norm_name(p + "attention_norm", c.per_lane_norms): norm,
                  p + "attention.wq.weight": (L, q, D), p + "attention.wk.weight": (L, kv, D),
                  p + "attention.wv.weight": (L, kv, D), p + "attention.wo.weight": (L, D, q),
                  self.norm_name(p + "ffn_norm", c.per_lane_norms): norm,
                  p + "feed_forward.w1.weight": (L, f, D), p + "feed_forward.w3.weight": (L, f, D),
                  p + "feed_forward.w2.weight": (L, D, f)}
        t[self.norm_name("model.norm", c.per_lane_final_norm)] = (L, D) if c.per_lane_final_norm else (D,)
        head = {"replicate": (V, D), "lane": (V, L * D), "vocab_parallel": (L, V // L, D)}[c.lm_head_type]
        if self.head_name() != "model.tok_embeddings.weight":
            t[self.head_name()] = head
        return t

    def random_weights(self, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
        w = super().random_weights(seed, dtype)
        rng = np.random.default_rng(seed + 1)  # unit-scale embeddings, like a trained model's
        w["model.tok_embeddings.weight"] = rng.standard_normal(w["model.tok_embeddings.weight"].shape,
                                                               dtype=np.float32).astype(dtype)
        return w

    # ------------------------------------------------------------------ decode program
    def lower(self, context_length: int | None = None, kv_dtype: str = "f32", weight_dtype: str = "bf16") -> DecodeProgram:
        c = self.cfg
        T = min(context_length or c.max_position_embeddings, c.max_position_embeddings)
        L, D, V, hd, N = c.num_lanes, c.hidden_size, c.vocab_size, c.hd, c.num_hidden_layers
        Hl, Kl, Fl = c.heads_per_lane, c.kv_heads_per_lane, c.ffn_per_lane
        p = new_program("laneformer", L, V, T, N, model_type=c.model_type, broadcast_delay=c.broadcast_delay,
                        lm_head_type=c.lm_head_type)
        shapes = self.expected_tensors()

        def weight(name):
            return p.add_tensor(name, shapes[name], weight_dtype, "weight")

        def buf(name, *shape, lanes=L):
            return p.add_tensor(name, (lanes, *shape), "f32", "buffer")

        def send(t, layer=None):
            """Make every lane of t visible to every rank (a no-op on one rank)."""
            p.add_op("collective", [t], [t], layer, kind="all_gather")

        def residual(x, kind, i):
            """x_l += the lane reduction of this block's partials (fresh of layer i, delayed of i - d)."""
            fresh = part[kind, i]
            mode = c.reduce_mode(i)
            if mode == "delayed":
                p.add_op("lane_residual", [x, fresh, part[kind, i - c.broadcast_delay]], [x], i, mode="delayed")
            elif mode == "allreduce":
                p.add_op("lane_residual", [x, fresh], [x], i, mode="allreduce")
            else:
                p.add_op("lane_residual", [x, fresh], [x], i, mode="local", scale=c.lane_scale)

        inv_freq = p.add_tensor("rope.inv_freq", (hd // 2,), "f32", "const")
        p.metadata["consts"] = {"rope.inv_freq": inverse_frequencies(hd, c.rope_theta).astype(np.float32).tolist()}
        x, h = buf("x", D), buf("h", D)
        q, k, v, att = buf("q", Hl * hd), buf("k", Kl * hd), buf("v", Kl * hd), buf("att", Hl * hd)
        g, u, a = buf("gate", Fl), buf("up", Fl), buf("act", Fl)
        # One partial buffer per layer and block: a partial lives until layer i + d consumes it.
        part = {(kind, i): buf(f"part.{kind}.{i}", D) for kind in ("attn", "mlp") for i in range(N)}

        p.add_op("embed", [weight("model.tok_embeddings.weight"), "token"], [x])
        for i in range(N):
            w = f"model.layers.{i}."
            ck = p.add_tensor(f"kv.{i}.k", (L, Kl, T, hd), kv_dtype, "kv")
            cv = p.add_tensor(f"kv.{i}.v", (L, Kl, T, hd), kv_dtype, "kv")
            # attention block: lane-row q/k/v, lane-local attention, lane-column output partial
            p.add_op("rmsnorm", [x, weight(self.norm_name(w + "attention_norm", c.per_lane_norms))], [h], i, eps=c.norm_eps)
            p.add_op("matvec", [h, weight(w + "attention.wq.weight")], [q], i)
            p.add_op("matvec", [h, weight(w + "attention.wk.weight")], [k], i)
            p.add_op("matvec", [h, weight(w + "attention.wv.weight")], [v], i)
            p.add_op("rope", [q, inv_freq], [q], i, n_heads=Hl, head_dim=hd, style="interleaved")
            p.add_op("rope", [k, inv_freq], [k], i, n_heads=Kl, head_dim=hd, style="interleaved")
            p.add_op("kv_append", [k, v, ck, cv], [ck, cv], i)
            p.add_op("attention", [q, ck, cv], [att], i, n_heads=Hl, n_kv_heads=Kl, head_dim=hd,
                     window=c.window(i), scale=hd ** -0.5)
            p.add_op("matvec", [att, weight(w + "attention.wo.weight")], [part["attn", i]], i)
            if c.must_send(i):
                send(part["attn", i], i)
            residual(x, "attn", i)
            # MLP block: the same pattern
            p.add_op("rmsnorm", [x, weight(self.norm_name(w + "ffn_norm", c.per_lane_norms))], [h], i, eps=c.norm_eps)
            p.add_op("matvec", [h, weight(w + "feed_forward.w1.weight")], [g], i)
            p.add_op("matvec", [h, weight(w + "feed_forward.w3.weight")], [u], i)
            p.add_op("swiglu", [g, u], [a], i)
            p.add_op("matvec", [a, weight(w + "feed_forward.w2.weight")], [part["mlp", i]], i)
            if c.must_send(i):
                send(part["mlp", i], i)
            residual(x, "mlp", i)

        logits = p.add_tensor("logits", (1, V), "f32", "output")
        self._lower_head(p, x, weight, buf, send, logits)
        nxt = p.add_tensor("next_token", (), "i32", "output")
        p.add_op("sample", [logits], [nxt])
        p.validate()
        return p

    def _lower_head(self, p, x, weight, buf, send, logits):
        c = self.cfg
        L, D, V = c.num_lanes, c.hidden_size, c.vocab_size
        norm = weight(self.norm_name("model.norm", c.per_lane_final_norm))
        head = weight(self.head_name())
        if c.pre_norm_lane_agg:                      # logits = W RMSNorm(sum_l x_l) g
            send(x)
            s, hn = buf("head.sum", D, lanes=1), buf("head.h", D, lanes=1)
            p.add_op("lane_sum", [x], [s])
            p.add_op("rmsnorm", [s, norm], [hn], eps=c.norm_eps)
            p.add_op("matvec", [hn, head], [logits])
            return
        xn = buf("head.xn", D)                       # RMSNorm(x_l) g, per lane
        p.add_op("rmsnorm", [x, norm], [xn], eps=c.norm_eps)
        if c.lm_head_type == "replicate":            # logits = W mean_l(RMSNorm(x_l) g)
            send(xn)
            hm = buf("head.h", D, lanes=1)
            p.add_op("lane_mean", [xn], [hm])
            p.add_op("matvec", [hm, head], [logits])
        elif c.lm_head_type == "lane":               # logits = W [n_0 | n_1 | ... | n_{L-1}]
            send(xn)
            cat = buf("head.cat", L * D, lanes=1)
            p.add_op("copy", [xn], [cat])
            p.add_op("matvec", [cat, head], [logits])
        else:                                        # vocab_parallel: lane l computes logits[l*V/L:(l+1)*V/L]
            lv = buf("head.lane_logits", V // L)
            p.add_op("matvec", [xn, head], [lv])
            send(lv)
            p.add_op("copy", [lv], [logits])

    # ------------------------------------------------------------------ plain forward (tests)
    def forward(self, weights: Mapping[str, np.ndarray], token_ids: Sequence[int]) -> np.ndarray:
        """Whole-sequence forward in float64, straight from the Laneformer equations."""
        c = self.cfg
        W = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
        n, L, hd, N, d = len(token_ids), c.num_lanes, c.hd, c.num_hidden_layers, c.broadcast_delay
        Hl, Kl = c.heads_per_lane, c.kv_heads_per_lane
        pos = np.arange(n)
        inv = inverse_frequencies(hd, c.rope_theta)

        def rms(t, g):  # per lane, no cross-lane statistics; g is [D] or [L, D]
            return t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True) + c.norm_eps) * g

        def lane_matvec(t, w):  # t [n, L, K], w [L, N, K] -> [n, L, N]: lane l uses its own slice
            return np.einsum("nlk,lok->nlo", t, w)

        def attention(a, p, i):  # a [n, L, D] -> the attention partials P^A(i, l) [n, L, D]
            q = rope_interleaved(lane_matvec(a, W[p + "attention.wq.weight"]).reshape(n, L, Hl, hd), pos, inv)
            k = rope_interleaved(lane_matvec(a, W[p + "attention.wk.weight"]).reshape(n, L, Kl, hd), pos, inv)
            v = lane_matvec(a, W[p + "attention.wv.weight"]).reshape(n, L, Kl, hd)
            q = q.reshape(n, L, Kl, Hl // Kl, hd)   # query head h of a lane reads kv head h // (Hl / Kl)
            s = np.einsum("qlkgd,tlkd->lkgqt", q, k) * hd ** -0.5
            visible = pos[None, :] <= pos[:, None]
            if c.window(i):
                visible &= pos[None, :] > pos[:, None] - c.window(i)
            s = np.where(visible, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = np.einsum("lkgqt,tlkd->qlkgd", s, v).reshape(n, L, Hl * hd)
            return lane_matvec(o, W[p + "attention.wo.weight"])

        def mlp(m, p):
            gate, up = lane_matvec(m, W[p + "feed_forward.w1.weight"]), lane_matvec(m, W[p + "feed_forward.w3.weight"])
            return lane_matvec(gate / (1 + np.exp(-gate)) * up, W[p + "feed_forward.w2.weight"])

        def reduce(i, fresh, past):
            mode = c.reduce_mode(i)
            if mode == "allreduce":   # true all-reduce over lanes
                return np.broadcast_to(fresh.sum(axis=1, keepdims=True), fresh.shape)
            if mode == "local":       # no communication: the lane's own partial, scaled by sqrt(L)
                return c.lane_scale * fresh
            old = past[i - d]         # own fresh partial + the other lanes' partials of layer i - d
            return fresh + (old.sum(axis=1, keepdims=True) - old)

        x = np.repeat(W["model.tok_embeddings.weight"][list(token_ids)][:, None, :], L, axis=1)  # [n, L, D]
        past_attn, past_mlp = [], []
        for i in range(N):
            p = f"model.layers.{i}."
            P = attention(rms(x, W[self.norm_name(p + "attention_norm", c.per_lane_norms)]), p, i)
            x = x + reduce(i, P, past_attn)
            past_attn.append(P)
            P = mlp(rms(x, W[self.norm_name(p + "ffn_norm", c.per_lane_norms)]), p)
            x = x + reduce(i, P, past_mlp)
            past_mlp.append(P)

        g, head = W[self.norm_name("model.norm", c.per_lane_final_norm)], W[self.head_name()]
        if c.pre_norm_lane_agg:
            logits = rms(x.sum(axis=1), g) @ head.T
        elif c.lm_head_type == "replicate":
            logits = rms(x, g).mean(axis=1) @ head.T
        elif c.lm_head_type == "lane":
            logits = rms(x, g).reshape(n, -1) @ head.T
        else:
            logits = np.einsum("nld,lvd->nlv", rms(x, g), head).reshape(n, c.vocab_size)
        return logits.astype(np.float32)
