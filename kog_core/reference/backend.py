"""Executes a decode program op by op in numpy float32.

Multi-rank: rank r of R holds lanes [r*L/R, (r+1)*L/R). Buffers hold only the local lanes,
except tensors written by a `collective` op, which hold all L lanes (the rank writes its own
slice, the collective fills in the rest). Lane-mixing ops sum lanes in index order, so R ranks
give bit-for-bit the same numbers as one."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from kog_core.interfaces import Collective, KernelBackend
from kog_core.program import DecodeProgram, Op


class ReferenceBackend(KernelBackend):
    name = "reference"

    def load(self, program: DecodeProgram, weights: Mapping[str, np.ndarray], *, rank: int = 0,
             ranks: int = 1, collective: Collective | None = None) -> None:
        L = program.lanes
        if L % ranks:
            raise ValueError(f"{ranks} ranks do not divide {L} lanes")
        self.program, self.rank, self.ranks, self.collective = program, rank, ranks, collective
        self.lanes = L // ranks
        self.lo, self.hi = rank * self.lanes, (rank + 1) * self.lanes
        self.gathered = {op.outputs[0] for op in program.ops if op.kind == "collective"}
        per_lane_weights = self._per_lane_weights(program)
        consts = program.metadata.get("consts", {})
        self.t: dict[str, np.ndarray] = {}
        for spec in program.tensors.values():
            if spec.kind == "weight":
                w = np.asarray(weights[spec.name])
                if spec.name in per_lane_weights and ranks > 1:
                    w = w[self.lo:self.hi]
                # The embedding table stays in its dtype (one row is read per token).
                self.t[spec.name] = w if spec.name in self._embed_tables(program) else np.ascontiguousarray(w, dtype=np.float32)
            elif spec.kind == "const":
                self.t[spec.name] = np.asarray(consts[spec.name], dtype=np.float32).reshape(spec.shape)
            elif spec.shape:
                self.t[spec.name] = np.zeros(self._local_shape(spec.name, spec.shape), np.float32)
        self._ops = [self._compile(op) for op in program.ops if op.kind != "sample"]

    @staticmethod
    def _embed_tables(program):
        """Tables read one row per token (kept in their dtype); a tied LM head is converted."""
        matvec_weights = {op.inputs[1] for op in program.ops if op.kind == "matvec"}
        return {op.inputs[0] for op in program.ops if op.kind == "embed"} - matvec_weights

    @staticmethod
    def _per_lane_weights(program) -> set[str]:
        """Weights with one slice per lane (split across ranks)."""
        out = set()
        for op in program.ops:
            if op.kind == "matvec" and len(program.tensors[op.inputs[1]].shape) == 3:
                out.update(op.inputs[1:])  # weight and its bias [L, N]
            if op.kind == "rmsnorm" and len(program.tensors[op.inputs[1]].shape) == 2:
                out.add(op.inputs[1])
        return out

    def _local_shape(self, name, shape):
        P = self.program
        if P.lanes > 1 and shape[0] == P.lanes and name not in self.gathered:
            return (self.lanes, *shape[1:])
        return shape

    def _local(self, name) -> np.ndarray:
        """This rank's lanes of a tensor (a view)."""
        a = self.t[name]
        if name in self.gathered:
            return a[self.lo:self.hi]
        return a

    def reset(self) -> None:
        for spec in self.program.tensors.values():
            if spec.kind == "kv":
                self.t[spec.name][...] = 0.0

    def step(self, token: int, pos: int) -> np.ndarray:
        if not 0 <= pos < self.program.context_length:
            raise IndexError(f"position {pos} outside the context of {self.program.context_length}")
        self.token, self.pos = int(token), int(pos)
        for run in self._ops:
            run()
        return self.t[self.program.logits].reshape(-1).copy()

    # ------------------------------------------------------------------ op implementations
    def _compile(self, op: Op):
        return getattr(self, "_op_" + op.kind)(op)

    def _op_embed(self, op):
        table, out = op.inputs[0], op.outputs[0]

        def run():
            self._local(out)[...] = np.asarray(self.t[table][self.token], dtype=np.float32)
        return run

    def _op_rmsnorm(self, op):
        x, w, out = op.inputs[0], op.inputs[1], op.outputs[0]
        eps, group = op.attr("eps"), op.attr("group")

        def run():
            a = self._local(x)
            g = a.reshape(*a.shape[:-1], -1, group) if group else a[..., None, :]
            r = g / np.sqrt(np.mean(g * g, axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))
            wt = self.t[w]
            if wt.ndim == 2:  # per-lane scale [L, row]
                r = r.reshape(a.shape) * wt
            else:
                r = (r * wt).reshape(a.shape)
            self._local(out)[...] = r
        return run

    def _op_matvec(self, op):
        x, w, out = op.inputs[0], op.inputs[1], op.outputs[0]
        extra = list(op.inputs[2:])
        bias = extra.pop(0) if op.attr("has_bias") else None
        residual = extra.pop(0) if op.attr("has_residual") else None

        def run():
            W, a = self.t[w], self._local(x)
            if W.ndim == 3:
                y = np.matmul(W, a[..., None])[..., 0]
            elif a.shape[0] == 1:
                y = (W @ a[0])[None]  # a plain gemv: BLAS is ~10x faster here than a @ W.T
            else:
                y = (W @ a.T).T
            if bias is not None:
                y = y + self.t[bias]
            if residual is not None:
                y = y + self._local(residual)
            self._local(out)[...] = y
        return run

    def _op_rope(self, op):
        x, inv, out = op.inputs[0], op.inputs[1], op.outputs[0]
        hd, style = op.attr("head_dim"), op.attr("style")

        def run():
            a = self._local(x)
            lanes = a.shape[0]
            t = a.reshape(lanes, -1, hd)
            ang = np.float64(self.pos) * self.t[inv].astype(np.float64)
            cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
            if style == "half":
                p, q = t[..., : hd // 2], t[..., hd // 2:]
                r = np.concatenate([p * cos - q * sin, q * cos + p * sin], axis=-1)
            else:
                p, q = t[..., 0::2], t[..., 1::2]
                r = np.empty_like(t)
                r[..., 0::2], r[..., 1::2] = p * cos - q * sin, q * cos + p * sin
            self._local(out)[...] = r.reshape(a.shape)
        return run

    def _op_kv_append(self, op):
        k, v, ck, cv = op.inputs
        store = _storage_rounding(self.program.tensors[ck].dtype)

        def run():
            K, Vc = self.t[ck], self.t[cv]
            lanes, hkv, T, hd = K.shape
            K[:, :, self.pos, :] = store(self._local(k).reshape(lanes, hkv, hd))
            Vc[:, :, self.pos, :] = store(self._local(v).reshape(lanes, hkv, hd))
        return run

    def _op_attention(self, op):
        q, ck, cv = op.inputs
        out = op.outputs[0]
        H, Hkv, hd = op.attr("n_heads"), op.attr("n_kv_heads"), op.attr("head_dim")
        window, scale = op.attr("window"), np.float32(op.attr("scale"))

        def run():
            start = max(0, self.pos - window + 1) if window else 0
            K = self.t[ck][:, :, start:self.pos + 1, :]  # [lanes, hkv, n, hd]
            Vv = self.t[cv][:, :, start:self.pos + 1, :]
            lanes = K.shape[0]
            Q = self._local(q).reshape(lanes, Hkv, H // Hkv, hd)
            s = np.matmul(Q, K.transpose(0, 1, 3, 2)) * scale   # [lanes, hkv, g, n]
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            self._local(out)[...] = np.matmul(s, Vv).reshape(lanes, H * hd)
        return run

    def _op_swiglu(self, op):
        g, u, out = op.inputs[0], op.inputs[1], op.outputs[0]

        def run():
            a = self._local(g)
            self._local(out)[...] = a / (np.float32(1) + np.exp(-a)) * self._local(u)
        return run

    def _op_add(self, op):
        a, b, out = op.inputs[0], op.inputs[1], op.outputs[0]

        def run():
            self._local(out)[...] = self._local(a) + self._local(b)
        return run

    def _op_copy(self, op):
        x, out = op.inputs[0], op.outputs[0]

        def run():
            self.t[out].reshape(-1)[...] = self.t[x].reshape(-1)
        return run

    def _op_lane_mean(self, op):
        x, out = op.inputs[0], op.outputs[0]

        def run():
            self.t[out][...] = self._lane_sum(self.t[x]) / np.float32(self.t[x].shape[0])
        return run

    def _op_lane_sum(self, op):
        x, out = op.inputs[0], op.outputs[0]

        def run():
            self.t[out][...] = self._lane_sum(self.t[x])
        return run

    @staticmethod
    def _lane_sum(a: np.ndarray) -> np.ndarray:
        acc = a[0].copy()
        for j in range(1, a.shape[0]):  # fixed order: identical on any number of ranks
            acc += a[j]
        return acc

    def _op_collective(self, op):
        x = op.outputs[0]
        kind = op.attr("kind", "all_gather")
        if kind != "all_gather":
            raise ValueError(f"collective kind {kind!r} is not supported")

        def run():
            if self.ranks > 1:
                full = self.collective.all_gather(x, np.ascontiguousarray(self.t[x][self.lo:self.hi]))
                self.t[x][...] = full
        return run

    def _op_lane_residual(self, op):
        x, fresh = op.inputs[0], op.inputs[1]
        delayed = op.inputs[2] if len(op.inputs) > 2 else None
        mode, scale = op.attr("mode"), np.float32(op.attr("scale", 1.0))

        def run():
            X, F = self._local(x), self.t[fresh]
            if mode == "local":
                X += scale * self._local(fresh)
            elif mode == "allreduce":
                X += self._lane_sum(F)
            elif mode == "delayed":
                D = self.t[delayed]
                for li in range(X.shape[0]):
                    lane = self.lo + li
                    acc = self._local(fresh)[li].copy()
                    for j in range(D.shape[0]):
                        if j != lane:
                            acc += D[j]
                    X[li] += acc
            else:
                raise ValueError(f"lane_residual mode {mode!r}")
        return run


def _storage_rounding(dtype: str):
    """A KV cache declared bf16/f16 holds values rounded to that type (what a GPU stores); the
    arithmetic stays float32."""
    if dtype == "bf16":
        import ml_dtypes
        return lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)
    if dtype == "f16":
        return lambda a: a.astype(np.float16).astype(np.float32)
    return lambda a: a
